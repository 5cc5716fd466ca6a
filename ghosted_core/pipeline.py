"""The one entry point the CLI and the app share: load → select → calibrate → fit → evaluate.

`run_stages` is a generator: after each stage it yields the stage's name and the result
so far, so the app can fill its page while later stages run; `run` just drains it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

from ghosted_core import data
from ghosted_core.calibration import BoundaryStats, CalibrationOptions, collect_boundary_stats, collect_stats, make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation import BlockDrift, GenerationOptions, block_drift, generate, perplexity
from ghosted_core.models import DEFAULT_MODEL, LoadedModel, LoadOptions, decoder_blocks, load_model, peek_config
from ghosted_core.operators import Fit, FitOptions, FitReport, assess, branch_replacement, get_operator, module_device, \
    residual_module
from ghosted_core.plan import PruningPlan
from ghosted_core.selection import SelectionRequest, SimilarityStats, check_request, get_criterion, select_blocks
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.surgery import build_variant, patch_site
from ghosted_core.tasks import TaskResults, evaluate_tasks, parse_tasks

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
    train_size: int = 64  # calibration sequences (the paper: 128)
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
    quiet: bool = False

    @property
    def heldout(self) -> int:
        return self.heldout_size if self.heldout_size is not None else max(1, self.train_size // 8)


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
                reports = self.fits[name]
                entry["boundary_error"] = [
                    {"boundary": r.boundary, "fit": r.fit_error, "fit_ordinary": r.fit_error_ordinary,
                     "heldout": r.heldout_error, "heldout_ordinary": r.heldout_error_ordinary} for r in reports]
                entry["antisym_fraction"] = [r.antisym_fraction for r in reports]
                entry["fits"] = [r.to_json() for r in reports]
            if name in self.drift:
                entry["drift"] = self.drift[name].to_json()
            if name in self.generations:
                entry["generation"] = self.generations[name]
            if name in self.tasks:
                entry["tasks"] = self.tasks[name].to_json()
            variants[name] = entry
        plan = self.plan.to_json() if self.plan else {}
        return {
            "model": opts.model,
            "model_description": self.model_description,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "criterion": opts.criterion,
            "removed_layers": plan.get("removed_layers", []),
            "boundaries": plan.get("boundaries", []),
            "scores": plan.get("scores", []),
            "score_label": plan.get("score_label", ""),
            "calibration": {
                "corpus": opts.calibration, "label": self.calibration_label, "sequences": opts.train_size,
                "heldout_sequences": opts.heldout, "seqlen": opts.seqlen, "tokens": self.calibration_tokens,
                "seed": opts.seed, "sink_rule": opts.calibrate.sink_rule, "sink_ratio": opts.calibrate.sink_ratio,
            },
            "evaluation": {"seqlen": opts.eval_seqlen or opts.seqlen, "max_tokens": opts.eval_max_tokens},
            "corpora": self.corpora,
            "prompt": opts.prompt,
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "notes": self.notes,
            "variants": variants,
        }


def validate(options: RunOptions, num_layers: int | None = None) -> None:
    """Refuse bad input before any expensive step."""
    get_criterion(options.criterion)
    for name in (options.calibration, *options.eval_corpora):
        if name not in data.corpus_names():
            raise GhostedError(f"unknown corpus {name!r}; known corpora: {', '.join(data.corpus_names())}")
    if options.tasks:
        parse_tasks(",".join(options.tasks))  # unknown task names fail before any work
        if options.task_limit is not None and options.task_limit < 1:
            raise GhostedError(f"--task_limit must be at least 1 (got {options.task_limit})")
    if options.train_size < 1 or options.seqlen < 2:
        raise GhostedError("--train_size must be at least 1 and --seqlen at least 2")
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


def build_recovered(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, fits: Sequence[Fit]) -> PreTrainedModel:
    """The pruned model with a variant's fitted operators, sharing the dense weights."""
    patches, replacements = _realize(dense, fits)
    record = {"removed_layers": list(plan.removed), "boundaries": [[b.start, b.end] for b in plan.boundaries],
              "operator": variant.operator, "sequential": variant.sequential}
    return build_variant(dense, plan.removed, patches, replacements, record)


def fit_variant(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, stats: Sequence[BoundaryStats],
                batches, options: RunOptions) -> tuple[list[Fit], list[FitReport]]:
    """Fit a variant's operator at every boundary, independently or sequentially."""
    spec = get_operator(variant.operator)
    fits: list[Fit] = []
    reports: list[FitReport] = []
    for k, boundary_stats in enumerate(stats):
        if variant.sequential and k > 0:
            upstream = [b for b in plan.boundaries[:k]]
            removed = [i for b in upstream for i in b.blocks]
            partial = PruningPlan(plan.num_layers, tuple(removed), plan.criterion)
            view = build_recovered(dense, partial, variant, fits)
            boundary = boundary_stats.boundary
            source_start = boundary.start - len(removed)
            boundary_stats = collect_boundary_stats(view, source_start, dense, boundary, batches, options.calibrate)
        fit = spec.fit(boundary_stats, options.fit)
        fits.append(fit)
        reports.append(assess(fit, boundary_stats))
    return fits, reports


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

    if loaded is None:
        validate(options, peek_config(options.model).num_hidden_layers)  # refuse bad depths before loading weights
        loaded = load_model(options.model, options.load)
    dense, tokenizer = loaded.model, loaded.tokenizer
    result.model_description = loaded.description
    result.num_layers, result.hidden_size = loaded.num_layers, loaded.hidden_size
    result.tokenizer = tokenizer
    result.models["dense"] = dense
    validate(options, loaded.num_layers)
    yield done("load model")

    check_stop(should_stop, "score blocks")
    spec = get_criterion(options.criterion)
    needs_data = spec.needs_similarity or options.criterion != "none"
    batches = []
    if needs_data:
        fit_ids, heldout_ids = data.calibration_windows(tokenizer, options.calibration, options.train_size,
                                                        options.seqlen, options.seed, options.heldout)
        batches = make_batches(fit_ids, heldout_ids, options.calibrate.batch_size)
        result.calibration_label = data.load_corpus(options.calibration, "calibration").label
        result.calibration_tokens = int(fit_ids.numel())
        result.corpora[options.calibration] = _corpus_entry(options.calibration, "calibration")
    plan, sim = select_blocks(dense, options.criterion, _request(options, loaded.num_layers), batches, options.quiet)
    result.plan, result.similarity = plan, sim
    yield done("score blocks")

    if plan.removed:
        check_stop(should_stop, "calibrate")
        stats = collect_stats(dense, plan.boundaries, batches, options.calibrate)
        yield done("calibrate")
        for variant in options.variants:
            check_stop(should_stop, "fit operators")
            fits, reports = fit_variant(dense, plan, variant, stats, batches, options)
            result.fits[variant.name] = reports
            result.notes += [f"{variant.name}, boundary {r.boundary}: {note}" for r in reports for note in r.notes]
            result.models[variant.name] = build_recovered(dense, plan, variant, fits)
        yield done("fit operators")

    eval_seqlen = options.eval_seqlen or options.seqlen
    first_windows = None
    for corpus in options.eval_corpora:
        windows = data.evaluation_windows(tokenizer, corpus, eval_seqlen, options.eval_max_tokens)
        first_windows = windows if first_windows is None else first_windows
        result.corpora[corpus] = _corpus_entry(corpus, "evaluation") | {"windows": len(windows), "tokens": int(windows.numel())}
        result.perplexity[corpus] = perplexity(dense, result.models, windows, options.eval_batch_size, options.quiet,
                                               desc=f"perplexity {corpus}", should_stop=should_stop)
        yield done("perplexity")

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


def _corpus_entry(name: str, split: str) -> dict:
    corpus = data.load_corpus(name, split)
    return {"label": corpus.label, "real": corpus.real}


def run(options: RunOptions, loaded: LoadedModel | None = None) -> RunResult:
    """Run all stages and return the final result."""
    result = None
    for _stage, result in run_stages(options, loaded):
        pass
    return result
