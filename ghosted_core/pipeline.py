"""The one entry point the CLI and the app share: load → select → calibrate → fit → evaluate.

`run_stages` is a generator: after each stage it yields the stage's name and the result
so far, so the app can fill its page while later stages run; `run` just drains it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

from ghosted_core import data
from ghosted_core.calibration import BoundaryStats, CalibrationOptions, collect_boundary_stats, collect_stats, make_batches
from ghosted_core.heldout import measure_errors
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation import BlockDrift, GenerationOptions, block_drift, generate, perplexity
from ghosted_core.memory import MemoryPlan, max_boundaries, min_calibration_sequences, plan_memory
from ghosted_core.model_card import run_record
from ghosted_core.models import DEFAULT_MODEL, LoadedModel, LoadOptions, check_load_options, decoder_blocks, load_model, \
    max_positions, peek_config, resolve_device, resolve_dtype
from ghosted_core.operators import BoundaryMap, Fit, FitOptions, FitReport, assess, branch_replacement, \
    choose_by_heldout, get_operator, module_device, needs_of, residual_module
from ghosted_core.plan import PruningPlan
from ghosted_core.selection import SelectionRequest, SimilarityStats, check_request, get_criterion, select_blocks
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.surgery import build_variant, patch_site
from ghosted_core.tasks import TaskResults, evaluate_tasks, parse_tasks
from ghosted_core.user_text import USER_CORPUS, UserText

log = logging.getLogger(__name__)

SEQUENTIAL_SUFFIX = "+seq"
DEFAULT_VARIANTS = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme")


@dataclass(frozen=True)
class VariantSpec:
    """One recovered variant: an operator, fitted independently (paper) or sequentially."""

    name: str  # as shown in results, e.g. "ghost" or "ghost+seq"
    operator: str
    sequential: bool = False


def parse_variants(names: str | Sequence[str]) -> tuple[VariantSpec, ...]:
    """'none,ghost,ghost+seq' → specs; unknown operators are refused with the known names."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if not items:
        raise GhostedError("no recovery operator given; e.g. --insert_type none,diag,rotate,ghost,replaceme")
    specs = []
    for item in dict.fromkeys(items):
        operator = item.removesuffix(SEQUENTIAL_SUFFIX)
        get_operator(operator)
        specs.append(VariantSpec(item, operator, item.endswith(SEQUENTIAL_SUFFIX)))
    return tuple(specs)


@dataclass(frozen=True)
class RunOptions:
    """Everything one run needs; defaults are sized for a 2-core CPU and the embedded SmolLM2."""

    model: str = DEFAULT_MODEL
    load: LoadOptions = LoadOptions()
    criterion: str = "streamline"
    num_prune: int = 7  # blocks to remove (similarity criteria)
    layers: tuple[int, ...] = ()  # blocks to remove (manual criterion)
    cosine: str = "hidden"  # "hidden" (papers) or "token-axis" (reference repos)
    variants: tuple[VariantSpec, ...] = parse_variants(DEFAULT_VARIANTS)
    calibration: str = "mix"  # calibration corpus
    train_size: int | None = None  # calibration sequences (None: enough for 4·C fit tokens, at least 64; the paper: 128)
    seqlen: int = 512  # calibration sequence length (the paper: 2048)
    heldout_size: int | None = None  # held-out calibration sequences for boundary errors (None: train_size // 8, at least 1)
    seed: int = 0
    eval_corpora: tuple[str, ...] = ("ptb", "wiki")
    eval_seqlen: int | None = None  # perplexity window length (None: seqlen)
    eval_max_tokens: int | None = 8192  # perplexity token cap per corpus (None: the whole split)
    eval_batch_size: int = 4
    drift_windows: int = 2  # windows of the first evaluation corpus used for per-block drift
    tasks: tuple[str, ...] = ()  # zero-shot tasks through lm-eval (see tasks.parse_tasks); empty: none
    task_limit: int | None = None  # examples per task (a seeded subset, the same for every variant); None: all
    task_batch_size: int = 8
    prompt: str | None = None  # generation prompt (None: no generation)
    generation: GenerationOptions = GenerationOptions()
    fit: FitOptions = FitOptions()
    calibrate: CalibrationOptions = CalibrationOptions()
    user_text: UserText | None = None  # the text behind the corpus name "your text" (in memory, this run only)
    quiet: bool = False

    @property
    def heldout(self) -> int:
        return self.heldout_size if self.heldout_size is not None else max(1, (self.train_size or 64) // 8)

    def corpus(self, name: str, split: str) -> str | data.Corpus:
        """What the data functions read for corpus `name`: its registered name, or the user's text
        (disjoint calibration and evaluation parts when this run uses it for both)."""
        if name != USER_CORPUS:
            return name
        if self.user_text is None:
            raise GhostedError(f"the corpus {USER_CORPUS!r} needs your text: paste or upload it "
                               "(command line: --user_text FILE.txt or FILE.jsonl)")
        shared = self.calibration == USER_CORPUS and USER_CORPUS in self.eval_corpora
        return self.user_text.corpus(split, shared)


@dataclass
class RunResult:
    """What a run found so far; `to_json` is the results.json layout."""

    options: RunOptions
    model_description: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    plan: PruningPlan | None = None
    similarity: SimilarityStats | None = None
    calibration_label: str = ""
    calibration_tokens: int = 0
    fits: dict[str, list[FitReport]] = field(default_factory=dict)
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)  # corpus → variant → ppl
    corpora: dict[str, dict] = field(default_factory=dict)  # corpus → {label, real}
    drift: dict[str, BlockDrift] = field(default_factory=dict)
    generations: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, TaskResults] = field(default_factory=dict)  # variant → zero-shot task scores
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_plan: MemoryPlan | None = None
    models: dict[str, PreTrainedModel] = field(default_factory=dict, repr=False)  # dense + variants (not serialized)
    tokenizer: object = field(default=None, repr=False)

    @property
    def variant_names(self) -> list[str]:
        return ["dense"] + [v.name for v in self.options.variants] if self.plan and self.plan.removed else ["dense"]

    def to_json(self) -> dict:
        opts = self.options
        variants: dict[str, dict] = {}
        for name in self.variant_names:
            entry: dict = {"ppl": {corpus: table[name] for corpus, table in self.perplexity.items() if name in table}}
            if name in self.fits:
                entry |= fit_json(self.fits[name])
            if name in self.drift:
                entry["drift"] = self.drift[name].to_json()
            if name in self.generations:
                entry["generation"] = self.generations[name]
            if name in self.tasks:
                entry["tasks"] = self.tasks[name].to_json()
            variants[name] = entry
        plan = self.plan.to_json() if self.plan else {}
        return run_json(self) | {
            "removed_layers": plan.get("removed_layers", []),
            "boundaries": plan.get("boundaries", []),
            "scores": plan.get("scores", []),
            "score_label": plan.get("score_label", ""),
            "prompt": opts.prompt,
            "variants": variants,
        }


def run_json(result) -> dict:
    """What every results.json states about a run or a sweep: model, criterion, calibration, memory plan,
    corpora, timings and notes (`result`: a RunResult or a SweepResult)."""
    opts = result.options
    cal = opts.calibrate
    return {
        "model": opts.model,
        "model_description": result.model_description,
        "num_layers": result.num_layers,
        "hidden_size": result.hidden_size,
        "criterion": opts.criterion,
        "calibration": {
            "corpus": opts.calibration, "label": result.calibration_label, "sequences": opts.train_size,
            "heldout_sequences": opts.heldout, "seqlen": opts.seqlen, "tokens": result.calibration_tokens,
            "seed": opts.seed, "sink_rule": cal.sink_rule, "sink_ratio": cal.sink_ratio, "pipeline": cal.pipeline,
            "stats_device": cal.stats_device, "products": cal.products,
        },
        "memory_plan": result.memory_plan.to_json() if result.memory_plan else None,
        "evaluation": {"seqlen": opts.eval_seqlen or opts.seqlen, "max_tokens": opts.eval_max_tokens},
        "corpora": result.corpora,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "notes": result.notes,
    }


def fit_json(reports: Sequence[FitReport]) -> dict:
    """A variant's boundary errors, anti-symmetric shares and full fit reports, one per boundary (results.json)."""
    return {
        "boundary_error": [{"boundary": r.boundary, "fit": r.fit_error, "fit_ordinary": r.fit_error_ordinary,
                            "heldout": r.heldout_error, "heldout_ordinary": r.heldout_error_ordinary,
                            "heldout_worse_than_pruning": r.heldout_worse_than_pruning, "ridge_fallback": r.ridge_fallback}
                           for r in reports],
        "antisym_fraction": [r.antisym_fraction for r in reports],
        "fits": [r.to_json() for r in reports],
    }


def validate(options: RunOptions, num_layers: int | None = None, max_positions: int | None = None) -> None:
    """Refuse bad input before any expensive step (`max_positions`: the model's max_position_embeddings)."""
    get_criterion(options.criterion)
    check_load_options(options.load)
    for name in (options.calibration, *options.eval_corpora):
        if name == USER_CORPUS:
            options.corpus(name, "evaluation")  # refuses "your text" without the text
        elif name not in data.corpus_names():
            raise GhostedError(f"unknown corpus {name!r}; known corpora: {', '.join(data.corpus_names())}, "
                               f"or {USER_CORPUS!r} with your own text")
    if options.tasks:
        parse_tasks(",".join(options.tasks))  # unknown task names fail before any work
        if options.task_limit is not None and options.task_limit < 1:
            raise GhostedError(f"--task_limit must be at least 1 (got {options.task_limit})")
    if options.train_size is not None and options.train_size < 1 or options.seqlen < 2:
        raise GhostedError("--train_size must be at least 1 and --seqlen at least 2")
    sizes = {"--batch_size": options.calibrate.batch_size, "eval batch size": options.eval_batch_size,
             "--task_batch_size": options.task_batch_size}
    for flag, size in sizes.items():
        if size < 1:
            raise GhostedError(f"{flag} must be at least 1 (got {size})")
    longest = max(options.seqlen, options.eval_seqlen or 0)
    if max_positions is not None and longest > max_positions:
        raise GhostedError(f"sequences of {longest} tokens exceed the model's {max_positions} positions "
                           f"(max_position_embeddings); use --seqlen/--eval_seqlen of at most {max_positions}")
    if num_layers is not None:
        check_request(options.criterion, _request(options, num_layers))


def _request(options: RunOptions, num_layers: int) -> SelectionRequest:
    return SelectionRequest(num_layers, options.num_prune, options.layers, options.cosine)


def _realize(dense: PreTrainedModel, fits: Sequence[Fit]) -> tuple[dict[int, nn.Module], dict[int, dict[str, nn.Module]]]:
    """Boundary modules (keyed by the dense index they feed) and ReplaceMe replacements (keyed by block)."""
    blocks = decoder_blocks(dense)
    patches: dict[int, nn.Module] = {}
    replacements: dict[int, dict[str, nn.Module]] = {}
    for fit in fits:
        if fit.update is None:
            continue
        if fit.site == "residual":
            site = patch_site(fit.boundary)
            target = blocks[site] if site < len(blocks) else dense.model.norm
            patches[site] = residual_module(fit, module_device(target))
        else:
            replacements[fit.boundary.start - 1] = branch_replacement(fit, blocks[fit.boundary.start - 1])
    return patches, replacements


def _record(plan: PruningPlan, variant: VariantSpec) -> dict:
    return {"dense_layers": plan.num_layers, "removed_layers": list(plan.removed),
            "boundaries": [[b.start, b.end] for b in plan.boundaries], "operator": variant.operator,
            "sequential": variant.sequential}


def build_recovered(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, fits: Sequence[Fit]) -> PreTrainedModel:
    """The pruned model with a variant's fitted operators, sharing the dense weights."""
    patches, replacements = _realize(dense, fits)
    return build_variant(dense, plan.removed, patches, replacements, _record(plan, variant))


def _upstream(plan: PruningPlan, k: int) -> PruningPlan:
    """The plan that removes only the runs before boundary k (the sequential fit's source model)."""
    removed = tuple(i for b in plan.boundaries[:k] for i in b.blocks)
    return PruningPlan(plan.num_layers, removed, plan.criterion)


def _sequential_stats(dense: PreTrainedModel, plan: PruningPlan, k: int, view: PreTrainedModel, batches,
                      options: RunOptions, operator: str) -> tuple[BoundaryStats, int]:
    """Boundary k's statistics with x_pre from the upstream-recovered `view` (and where it reads them)."""
    boundary = plan.boundaries[k]
    source_start = boundary.start - len(_upstream(plan, k).removed)
    stats = collect_boundary_stats(view, source_start, dense, boundary, batches, options.calibrate, needs_of([operator]))
    return stats, source_start


def _with_heldout(report: FitReport, errors) -> FitReport:
    return report if errors is None else dataclasses.replace(
        report, heldout_error=errors.relative, heldout_error_ordinary=errors.relative_ordinary,
        heldout_worse_than_pruning=errors.relative is not None and errors.relative > 1.0)


def choose_fit(dense: PreTrainedModel, fit: Fit, batches, options: RunOptions, source: PreTrainedModel | None = None,
               source_start: int | None = None) -> Fit:
    """A fit that carries candidates (replaceme_keepsink: one per number of sink directions) becomes the
    candidate with the lowest held-out boundary error. Time: one held-out pass up to the boundary for
    all candidates (one per candidate for a sequential fit); memory: the candidates' C×C updates."""
    if not fit.candidates:
        return fit
    if source is None:
        errors = measure_errors(dense, list(fit.candidates), batches, options.calibrate)
    else:
        errors = [measure_errors(dense, [c], batches, options.calibrate, source, source_start)[0] for c in fit.candidates]
    return choose_by_heldout(fit, errors)


def fit_variant(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, stats: Sequence[BoundaryStats],
                batches, options: RunOptions) -> tuple[list[Fit], list[FitReport]]:
    """Fit a variant's operator at every boundary, independently or sequentially, with held-out errors.

    Keeps every float64 fit (C×C per boundary); `fit_variants` is the memory-lean path for many variants.
    """
    spec = get_operator(variant.operator)
    fits: list[Fit] = []
    reports: list[FitReport] = []
    held: list = []
    for k, boundary_stats in enumerate(stats):
        source, source_start = None, None
        if variant.sequential and k > 0:
            source = build_recovered(dense, _upstream(plan, k), variant, fits)
            boundary_stats, source_start = _sequential_stats(dense, plan, k, source, batches, options, variant.operator)
        fit = choose_fit(dense, spec.fit(boundary_stats, options.fit), batches, options, source, source_start)
        fits.append(fit)
        reports.append(assess(fit, boundary_stats))
        if source is not None:
            held.append(measure_errors(dense, [fit], batches, options.calibrate, source, source_start)[0])
    independent = [k for k in range(len(fits)) if not (variant.sequential and k > 0)]
    for k, errors in zip(independent, measure_errors(dense, [fits[k] for k in independent], batches, options.calibrate)):
        reports[k] = _with_heldout(reports[k], errors)
    for k, errors in zip([k for k in range(len(fits)) if k not in independent], held):
        reports[k] = _with_heldout(reports[k], errors)
    return fits, reports


@dataclass
class VariantBuild:
    """A variant being fitted: its boundary modules so far, what applies each fit, its reports."""

    spec: VariantSpec
    patches: dict[int, nn.Module] = field(default_factory=dict)
    replacements: dict[int, dict[str, nn.Module]] = field(default_factory=dict)
    maps: list[BoundaryMap] = field(default_factory=list)
    reports: list[FitReport] = field(default_factory=list)

    def add(self, dense: PreTrainedModel, fit: Fit, stats: BoundaryStats) -> None:
        """Realize, assess and compact one fit; the float64 update is not kept."""
        patches, replacements = _realize(dense, [fit])
        self.patches.update(patches)
        self.replacements.update(replacements)
        self.reports.append(assess(fit, stats))
        self.maps.append(BoundaryMap.of(fit))


def fit_variants(dense: PreTrainedModel, plan: PruningPlan, variants: Sequence[VariantSpec],
                 stats: list[BoundaryStats | None], batches,
                 options: RunOptions) -> tuple[dict[str, list[FitReport]], dict[str, PreTrainedModel]]:
    """Fit every variant at every boundary, build the variants, then measure held-out errors in one pass.

    Memory: boundary by boundary, every fit that reads a boundary's statistics is made, realized
    as its module and compacted (`BoundaryMap`), then that entry of `stats` is set to None (the
    caller's list: statistics are freed as soon as the fits exist). Boundary 0's statistics wait
    for the sequential variants. Time: one C×C solve per least-squares fit and one held-out pass
    for all independent fits, plus two forwards per batch per later boundary of a sequential variant.
    """
    builds = {v.name: VariantBuild(v) for v in variants}
    sequential = [v for v in variants if v.sequential]
    for k in range(len(stats)):
        for variant in variants:
            if not variant.sequential or k == 0:
                fit = choose_fit(dense, get_operator(variant.operator).fit(stats[k], options.fit), batches, options)
                builds[variant.name].add(dense, fit, stats[k])
                del fit
        if k > 0 or not sequential:
            stats[k] = None
    if stats:
        stats[0] = None
    independent = [(b, k) for b in builds.values() for k in range(len(b.maps))]
    for variant in sequential:
        build = builds[variant.name]
        for k in range(1, len(plan.boundaries)):
            upstream = _upstream(plan, k)
            view = build_variant(dense, upstream.removed, build.patches, build.replacements, _record(upstream, variant))
            boundary_stats, source_start = _sequential_stats(dense, plan, k, view, batches, options, variant.operator)
            fit = get_operator(variant.operator).fit(boundary_stats, options.fit)
            fit = choose_fit(dense, fit, batches, options, view, source_start)
            build.add(dense, fit, boundary_stats)
            del boundary_stats
            errors = measure_errors(dense, [build.maps[k]], batches, options.calibrate, view, source_start)[0]
            build.reports[k] = _with_heldout(build.reports[k], errors)
    measured = measure_errors(dense, [b.maps[k] for b, k in independent], batches, options.calibrate)
    for (build, k), errors in zip(independent, measured):
        build.reports[k] = _with_heldout(build.reports[k], errors)
    reports = {name: b.reports for name, b in builds.items()}
    models = {name: build_variant(dense, plan.removed, b.patches, b.replacements, _record(plan, b.spec))
              for name, b in builds.items()}
    return reports, models


def sized(options: RunOptions, width: int) -> RunOptions:
    """Options with the calibration size resolved: enough sequences for 4·C fit tokens, at least 64."""
    if options.train_size is not None:
        return options
    return dataclasses.replace(options, train_size=min_calibration_sequences(width, options.seqlen))


def memory_plan(options: RunOptions, config, device: str | None = None, dtype=None,
                boundaries: int | None = None) -> MemoryPlan:
    """The run's memory plan from the config (before loading: device and dtype as the load options say)."""
    device = device or resolve_device(options.load.device)
    dtype = dtype or resolve_dtype(options.load.dtype, device)
    if boundaries is None:
        boundaries = max_boundaries(options.criterion, config.num_hidden_layers, options.num_prune, options.layers)
    sequences = options.train_size or min_calibration_sequences(config.hidden_size, options.seqlen)
    cal = options.calibrate
    return plan_memory(config, options.model, device, dtype, needs_of(v.operator for v in options.variants),
                       boundaries, sequences, options.seqlen, cal.batch_size, cal.capacity(sequences),
                       options.eval_batch_size, options.eval_seqlen, cal.pipeline, cal.stats_device)


def planned(options: RunOptions, loaded: LoadedModel | None = None,
            boundaries: int | None = None) -> tuple[RunOptions, MemoryPlan]:
    """Options with the calibration size resolved and calibration placed, and the memory plan behind them.

    Before loading (`loaded` None) the plan comes from the config alone; a plan that cannot fit
    is refused here, before any weight is read. `boundaries`: how many boundaries the statistics
    hold at once (None: the most this criterion and depth can make).
    """
    if loaded is None:
        config = peek_config(options.model)
        options = sized(options, config.hidden_size)
        plan = memory_plan(options, config, boundaries=boundaries)
    else:
        options = sized(options, loaded.hidden_size)
        plan = memory_plan(options, loaded.model.config, *_loaded_placement(loaded.model), boundaries=boundaries)
    plan.check()
    log.info(plan.summary())
    return _placed(plan, options), plan


def _placed(plan: MemoryPlan, options: RunOptions) -> RunOptions:
    """Options with the plan's calibration pipeline and, on a GPU, its statistics device."""
    cal = options.calibrate
    stats_device = plan.stats_device if cal.stats_device == "auto" and plan.device != "cpu" else cal.stats_device
    compute = cal.compute_device
    if plan.pipeline == "blocks" and compute is None and plan.device.startswith("cuda"):
        compute = plan.device
    return dataclasses.replace(options, calibrate=dataclasses.replace(cal, pipeline=plan.pipeline,
                                                                      stats_device=stats_device, compute_device=compute))


def _loaded_placement(model: PreTrainedModel) -> tuple[str, object]:
    """(device, dtype) of an already loaded model, as the memory plan names them."""
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "map", model.dtype
    return str(module_device(model.model.embed_tokens)), model.dtype


def run_stages(options: RunOptions, loaded: LoadedModel | None = None,
               should_stop: StopCheck = None) -> Iterator[tuple[str, RunResult]]:
    """Run everything `options` asks for, yielding (stage, result so far) after each stage.

    `should_stop` (e.g. `threading.Event().is_set`) is polled before every stage and between the
    batches of perplexity and drift and the variants of generation and tasks; when it returns
    True the generator raises `stopping.RunStopped` naming the stage, and the result yielded last
    holds every stage finished before it.
    """
    validate(options)
    result = RunResult(options)
    clock = time.perf_counter()

    def done(stage: str) -> tuple[str, RunResult]:
        nonlocal clock
        now = time.perf_counter()
        result.timings[stage] = result.timings.get(stage, 0.0) + now - clock
        clock = now
        return stage, result

    if loaded is None:  # refuse bad depths, and what cannot fit, before loading any weight
        config = peek_config(options.model)
        validate(options, config.num_hidden_layers, max_positions(config))
    options, plan = planned(options, loaded)
    result.options, result.memory_plan = options, plan
    if loaded is None:
        loaded = load_model(options.model, options.load)
    dense, tokenizer = loaded.model, loaded.tokenizer
    result.model_description = loaded.description
    result.num_layers, result.hidden_size = loaded.num_layers, loaded.hidden_size
    result.tokenizer = tokenizer
    result.models["dense"] = dense
    validate(options, loaded.num_layers, max_positions(dense.config))
    yield done("load model")

    check_stop(should_stop, "score blocks")
    spec = get_criterion(options.criterion)
    needs_data = spec.needs_similarity or options.criterion != "none"
    batches = []
    if needs_data:
        batches, result.calibration_tokens = calibration_batches(tokenizer, options)
        result.corpora[options.calibration] = corpus_entry(options, options.calibration, "calibration")
        result.calibration_label = result.corpora[options.calibration]["label"]
        result.notes += calibration_size_notes(result.calibration_tokens, loaded.hidden_size, options)
    plan, sim = select_blocks(dense, options.criterion, _request(options, loaded.num_layers), batches, options.quiet)
    result.plan, result.similarity = plan, sim
    yield done("score blocks")

    if plan.removed:
        check_stop(should_stop, "calibrate")
        result.memory_plan = memory_plan(options, dense.config, *_loaded_placement(dense), len(plan.boundaries))
        needs = needs_of(v.operator for v in options.variants)
        stats = collect_stats(dense, plan.boundaries, batches, options.calibrate, needs)
        yield done("calibrate")
        check_stop(should_stop, "fit operators")
        reports, models = fit_variants(dense, plan, options.variants, stats, batches, options)
        del stats  # every entry was released as soon as its fits existed
        for variant in options.variants:
            result.fits[variant.name] = reports[variant.name]
            result.notes += [f"{variant.name}, boundary {r.boundary}: {note}"
                             for r in reports[variant.name] for note in r.notes]
            result.models[variant.name] = models[variant.name]
        yield done("fit operators")

    eval_seqlen = options.eval_seqlen or options.seqlen
    first_windows = None
    for corpus in options.eval_corpora:
        windows = data.evaluation_windows(tokenizer, options.corpus(corpus, "evaluation"), eval_seqlen,
                                          options.eval_max_tokens)
        first_windows = windows if first_windows is None else first_windows
        result.corpora[corpus] = corpus_entry(options, corpus, "evaluation") | {"windows": len(windows),
                                                                                 "tokens": int(windows.numel())}
        result.perplexity[corpus] = perplexity(dense, result.models, windows, options.eval_batch_size, options.quiet,
                                               desc=f"perplexity {corpus}", should_stop=should_stop)
        yield done("perplexity")
    _record_run(result)

    if plan.removed and first_windows is not None and options.drift_windows > 0:
        pruned = {name: model for name, model in result.models.items() if name != "dense"}
        result.drift = block_drift(dense, pruned, plan, first_windows[: options.drift_windows], options.calibrate,
                                   should_stop=should_stop)
        yield done("drift")

    if options.prompt:
        result.generations = generate(result.models, tokenizer, options.prompt, options.generation, should_stop)
        yield done("generate")

    for name, model in result.models.items() if options.tasks else ():
        check_stop(should_stop, "tasks")
        result.tasks[name] = evaluate_tasks(model, tokenizer, options.tasks, options.task_limit, options.seed,
                                            options.task_batch_size, progress=not options.quiet)
        yield done("tasks")


def calibration_size_notes(tokens: int, width: int, options: RunOptions) -> list[str]:
    """A warning (logged and returned for the result) when a least-squares fit gets fewer than 4·C tokens."""
    needs = needs_of(v.operator for v in options.variants)
    if not (needs.residual or needs.branch) or tokens >= 4 * width:
        return []
    wanted = min_calibration_sequences(width, options.seqlen, floor=1)
    note = (f"calibration has {tokens} tokens, fewer than 4·C = {4 * width} for a {width}-wide model: the least-squares "
            f"fits are poorly determined{' (rank-deficient: a relative ridge decides them)' if tokens < width else ''}; "
            f"use --train_size {wanted} or more at --seqlen {options.seqlen}")
    log.warning(note)
    return [note]


def _record_run(result: RunResult) -> None:
    """Add the run's facts (base model, calibration, perplexities) to each variant's `ghosted` record,
    so that an export of the variant can state them in its model card."""
    report = result.to_json()
    for name, model in result.models.items():
        if name != "dense" and getattr(model.config, "ghosted", None) is not None:
            model.config.ghosted.update(run_record(report, name))


def calibration_batches(tokenizer, options: RunOptions) -> tuple[list, int]:
    """The seeded calibration windows of a run as forward-pass batches (fit, then held-out), and the fit token count."""
    fit_ids, heldout_ids = data.calibration_windows(tokenizer, options.corpus(options.calibration, "calibration"),
                                                    options.train_size, options.seqlen, options.seed, options.heldout)
    return make_batches(fit_ids, heldout_ids, options.calibrate.batch_size), int(fit_ids.numel())


def corpus_entry(options: RunOptions, name: str, split: str) -> dict:
    """The results.json record of a corpus: its label, whether it is the paper's own data, whether it is the user's."""
    corpus = data.get_corpus(options.corpus(name, split), split)
    return {"label": corpus.label, "real": corpus.real, "user": name == USER_CORPUS}


def run(options: RunOptions, loaded: LoadedModel | None = None) -> RunResult:
    """Run all stages and return the final result."""
    result = None
    for _stage, result in run_stages(options, loaded):
        pass
    return result
