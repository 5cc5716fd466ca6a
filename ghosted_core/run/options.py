"""What a run is asked to do: `RunOptions`, its variants, its validation, and its memory plan.

`validate` refuses bad input before any expensive step. `planned` resolves the calibration size
and asks `memory.plan_memory` where things go, before loading (from the config) or after it
(from where the weights already are, counting what they hold as available to the run); the
pipeline, the sweep and the cost estimates all plan through `memory_plan` here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ghosted_core.architectures import architecture_of
from ghosted_core.data import corpora
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.export.gain import SpeedOptions
from ghosted_core.evaluation.generation import GenerationOptions
from ghosted_core.memory import MemoryPlan, PlanRequest, plan_memory, resident_bytes
from ghosted_core.memory_parts import dtype_bytes, inner_width, max_boundaries, min_calibration_sequences
from ghosted_core.model.embedded import DEFAULT_MODEL
from ghosted_core.model.loading import LoadedModel, LoadOptions, check_load_options, model_placement, peek_config, \
    resolve_device, resolve_dtype
from ghosted_core.recovery.assessment import SHOWN, Diagnostics
from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
from ghosted_core.selection.criteria import SelectionRequest, check_blocks_listed, check_request, get_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes
from ghosted_core.selection.similarity import similarity_bytes
from ghosted_core.evaluation.tasks import parse_tasks
from ghosted_core.export.gguf import GGUFOptions
from ghosted_core.data.user_text import USER_CORPUS, UserText
from ghosted_core.distill.budget import distill_plan
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions, kd_name, split_kd_name
from ghosted_core.distill.targets import TRAINABLES, get_trainable
from ghosted_core.recovery.operators import OPERATORS
from ghosted_core.statistics import statistics_bytes

log = logging.getLogger(__name__)


SEQUENTIAL_SUFFIX = "+seq"
# the paper's baselines, the recommended ghost_capped and the best stock operator beside it (docs/results.md)
DEFAULT_VARIANTS = ("none", "diag", "rotate", "ghost", "ghost_capped", "magcomp_refit")


@dataclass(frozen=True)
class VariantSpec:
    """One recovered variant: an operator, fitted independently (paper) or sequentially, and maybe distilled."""

    name: str  # as shown in results, e.g. "ghost", "ghost+seq" or "ghost+kd"
    operator: str
    sequential: bool = False
    distill: str | None = None  # what distillation trains (`distill.targets`), starting from the variant `base`

    @property
    def base(self) -> str:
        """The variant it starts from: itself, or for a distilled one the fitted variant it is distilled from."""
        return split_kd_name(self.name)[0]


def parse_variants(names: str | Sequence[str]) -> tuple[VariantSpec, ...]:
    """'none,ghost,ghost+seq,ghost+kd' → specs; unknown operators and targets are refused with the known names.

    A distilled variant brings the variant it starts from (listed before it, once), so that every run shows
    each distilled variant beside its closed-form start.
    """
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if not items:
        raise GhostedError("no recovery operator given; e.g. --insert_type none,diag,rotate,ghost,replaceme")
    specs: dict[str, VariantSpec] = {}
    for item in items:
        base, target = split_kd_name(item)
        operator = base.removesuffix(SEQUENTIAL_SUFFIX)
        get_operator(operator)
        if target is not None:
            check_target(operator, target)
        specs.setdefault(base, VariantSpec(base, operator, base.endswith(SEQUENTIAL_SUFFIX)))
        specs.setdefault(item, VariantSpec(item, operator, base.endswith(SEQUENTIAL_SUFFIX), target))
    return tuple(specs.values())


def check_target(operator: str, target: str) -> None:
    """Refuse, before any work, a distillation target that does not exist or has nothing to train."""
    get_trainable(target)
    if target == OPERATOR_TARGET and not has_own_weights(operator):
        raise GhostedError(f"{operator}+kd: {operator} has no weights of its own to distill (a scalar or no map); "
                           f"distill a stock weight instead: {', '.join(kd_name(operator, t) for t in TRAINABLES if t != OPERATOR_TARGET)}")


def single_run_only(options: RunOptions, what: str) -> None:
    """Refuse distilled variants where only a single run trains them (a sweep, a comparison), before any work."""
    wanted = [v.name for v in options.variants if v.distill]
    if wanted:
        raise GhostedError(f"{what} fits the training-free operators only; distill ({', '.join(wanted)}) in a single "
                           "run at one depth and one criterion")


def has_own_weights(operator: str) -> bool:
    """The operator's variant holds weights of its own (a boundary map, a folded or refitted down_proj), not only a
    scalar carried by the dense weights (magcomp) or nothing (none)."""
    spec = get_operator(operator)
    return not (spec.cost.kept == "none" or spec.cost.kept == "scale" and spec.stock)


def distilled(names: str | Sequence[str], variants: Sequence[str]) -> list[str]:
    """The variant names `--distill` adds: each name as given if it names a target (`ghost+kd_lora`), else the
    default for it: `+kd` (the operator) where the operator has weights of its own, `+kd_mlp` where it has none."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if items == ["all"]:
        items = list(variants)
    out = []
    for item in items:
        base, target = split_kd_name(item)
        if target is None:
            target = OPERATOR_TARGET if has_own_weights(base.removesuffix(SEQUENTIAL_SUFFIX)) else "mlp"
        out.append(kd_name(base, target))
    return out


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
    bos: str = "auto"  # every window starts with BOS: "auto" (when the tokenizer adds one), "window" (always), "none"
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
    speed: SpeedOptions = dataclasses.field(default_factory=SpeedOptions)  # each variant's size, and its prefill and decode speed against dense
    fit: FitOptions = FitOptions()
    distill: DistillOptions = DistillOptions()  # the budget and schedule of the distilled (`+kd`) variants
    calibrate: CalibrationOptions = CalibrationOptions()
    diagnostics: Diagnostics = SHOWN  # O(C³) fit-report parts beyond the summary's (--diagnostics: all)
    user_text: UserText | None = None  # the text behind the corpus name "your text" (in memory, this run only)
    quiet: bool = False

    def __post_init__(self) -> None:
        """Each corpus and task once, in the order given: a list that names one twice (an API client's
        `["ptb"] * 40`) costs one pass, not forty. Variants and criteria are de-duplicated where they are parsed."""
        for name in ("eval_corpora", "tasks"):
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))

    @property
    def heldout(self) -> int:
        return self.heldout_size if self.heldout_size is not None else max(1, (self.train_size or 64) // 8)

    def corpus(self, name: str, split: str) -> str | corpora.Corpus:
        """What the data functions read for corpus `name`: its registered name, or the user's text
        (disjoint calibration and evaluation parts when this run uses it for both)."""
        if name != USER_CORPUS:
            return name
        if self.user_text is None:
            raise GhostedError(f"the corpus {USER_CORPUS!r} needs your text: paste or upload it "
                               "(command line: --user_text FILE.txt or FILE.jsonl)")
        shared = self.calibration == USER_CORPUS and USER_CORPUS in self.eval_corpora
        return self.user_text.corpus(split, shared)


def for_family(options: RunOptions, config) -> tuple[RunOptions, list[str]]:
    """The run's default operators less those the model's family refuses (a note each: OLMo's blocks read the
    stream without a norm, so magcomp_refit's scale is left out of its defaults); operators the user chose are
    kept, and `check_family` refuses them with the reason."""
    if options.variants != parse_variants(DEFAULT_VARIANTS):
        return options, []
    arch = architecture_of(config)
    notes, kept = [], []
    for variant in options.variants:
        refusal = next((arch.refusal(r, variant.operator, config) for r in get_operator(variant.operator).requires
                        if arch.refusal(r, variant.operator, config)), None)
        if refusal:
            notes.append(f"{variant.name} left out of the default operators: {refusal}")
        else:
            kept.append(variant)
    return (dataclasses.replace(options, variants=tuple(kept)), notes) if notes else (options, [])


def check_family(options: RunOptions, config, criteria: Sequence[str] | None = None) -> None:
    """Refuse, before any work, an operator that acts on a part of a block the model's family does not have (a
    scale on residual writers the table does not name, an MLP branch no single module computes, experts where
    the refit needs one down_proj), with the reason (`Architecture.refusal`)."""
    arch = architecture_of(config)
    asked = [(r, "the weights criterion") for r in (("writers",) if options.criterion == "weights" else ())]
    for variant in options.variants:
        asked += [(r, variant.operator) for r in get_operator(variant.operator).requires]
        if variant.distill is not None:
            asked += [(r, variant.name) for r in get_trainable(variant.distill).requires]
    for requirement, what in asked:
        refusal = arch.refusal(requirement, what, config)
        if refusal:
            raise GhostedError(refusal)


def validate(options: RunOptions, num_layers: int | None = None, max_positions: int | None = None,
             config=None) -> None:
    """Refuse bad input before any expensive step (`max_positions`: the model's max_position_embeddings; `config`:
    the model's, whose family decides which operators apply)."""
    get_criterion(options.criterion)
    check_blocks_listed(options.criterion, options.layers)
    check_load_options(options.load)
    if options.bos not in corpora.BOS_RULES:
        raise GhostedError(f"unknown BOS rule {options.bos!r}; use one of: {', '.join(corpora.BOS_RULES)}")
    for name in (options.calibration, *options.eval_corpora):
        if name == USER_CORPUS:
            options.corpus(name, "evaluation")  # refuses "your text" without the text
        elif name not in corpora.corpus_names():
            raise GhostedError(f"unknown corpus {name!r}; known corpora: {', '.join(corpora.corpus_names())}, "
                               f"or {USER_CORPUS!r} with your own text")
    if options.tasks:
        parse_tasks(",".join(options.tasks))  # unknown task names fail before any work
        if options.task_limit is not None and options.task_limit < 1:
            raise GhostedError(f"--task_limit must be at least 1 (got {options.task_limit})")
    if options.train_size is not None and options.train_size < 1 or options.seqlen < 2:
        raise GhostedError("--train_size must be at least 1 and --seqlen at least 2")
    _check_counts(options)
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
        check_request(options.criterion, selection_request(options, num_layers))
    if config is not None:
        check_family(options, config)


SEED_LIMIT = 2**32  # seeds are 0 … 2³² − 1 (what every generator the run seeds accepts)


def _check_counts(options: RunOptions) -> None:
    """Sizes and seeds that no run could use, refused before any work (a negative cap, a 1-token window)."""
    if not 0 <= options.seed < SEED_LIMIT:
        raise GhostedError(f"--seed must be between 0 and {SEED_LIMIT - 1} (got {options.seed})")
    if options.eval_max_tokens is not None and options.eval_max_tokens < 1:
        raise GhostedError(f"--eval_max_tokens must be at least 1, or 0 for the whole split (got {options.eval_max_tokens})")
    if options.eval_seqlen is not None and options.eval_seqlen < 2:
        raise GhostedError(f"--eval_seqlen must be at least 2 tokens (got {options.eval_seqlen})")
    if options.heldout_size is not None and options.heldout_size < 0:
        raise GhostedError(f"--heldout_size must be at least 0 (got {options.heldout_size})")
    if options.drift_windows < 0:
        raise GhostedError(f"drift windows must be at least 0 (got {options.drift_windows})")


def selection_request(options: RunOptions, num_layers: int) -> SelectionRequest:
    return SelectionRequest(num_layers, options.num_prune, options.layers, options.cosine)


def sized(options: RunOptions, width: int) -> RunOptions:
    """Options with the calibration size resolved: enough sequences for 4·C fit tokens, at least 64."""
    if options.train_size is not None:
        return options
    return dataclasses.replace(options, train_size=min_calibration_sequences(width, options.seqlen))


PREFIX_CACHE_BYTES = 2 * 2**30  # a sweep's default cap on its kept dense evaluation states
UNCAPPED_EVAL_TOKENS = 100_000  # perplexity tokens assumed per corpus without a cap (PTB's test split: ~82k)


def plan_request(options: RunOptions, config, boundaries: int | None = None,
                 depths: Sequence[int] | None = None, kept_cap: int = PREFIX_CACHE_BYTES,
                 dtype: torch.dtype = torch.float32, train_blocks: int | None = None,
                 criteria: Sequence[str] | None = None) -> PlanRequest:
    """What `options` asks for, in the counts the memory plan multiplies out (the one place that spells
    `RunOptions` out for `memory.plan_memory`).

    `boundaries`: statistics alive at once (None: the most the criterion can make, summed over a
    sweep's `depths`). A sweep (`depths` given) keeps one dense state per depth, under `kept_cap`.
    `dtype`: the model's (distillation's activations); `train_blocks`: the blocks from the earliest one a
    distillation trains to the end, once the plan is known (None: every kept block, the worst case).
    `criteria`: a comparison's, scored one after another after one similarity pass that also makes the
    layer-similarity map; the score phase is the largest of their declarations (None: `options.criterion`).
    """
    layers = config.num_hidden_layers
    chosen = tuple(sorted(set(depths))) if depths else (options.num_prune,)
    per_depth = [max_boundaries(options.criterion, layers, n, options.layers) for n in chosen]
    if boundaries is None:
        boundaries = sum(per_depth)
    sequences = options.train_size or min_calibration_sequences(config.hidden_size, options.seqlen)
    eval_seqlen = options.eval_seqlen or options.seqlen
    per_corpus = options.eval_max_tokens // eval_seqlen * eval_seqlen if options.eval_max_tokens else UNCAPPED_EVAL_TOKENS
    cal = options.calibrate
    score = score_footprint(criteria or (options.criterion,), ScoreShapes(
        config, dtype_bytes(dtype), sequences, options.seqlen, cal.batch_size, max(chosen), with_map=bool(criteria)))
    needs = needs_of(v.operator for v in options.variants)
    if any(v.distill for v in options.variants):
        options.distill.check_vocabulary(int(config.vocab_size), options.model)
    distill = distill_plan(config, dtype_bytes(dtype), options.seqlen, max(per_depth), options.distill,
                           [(v.distill, get_operator(v.operator).cost.kept) for v in options.variants if v.distill],
                           max(1, options.distill.val_sequences or options.heldout), train_blocks)
    return PlanRequest(
        needs=needs, boundaries=boundaries, sequences=sequences,
        inner=inner_width(config, needs),
        refit_candidates=options.fit.refit_candidates,
        seqlen=options.seqlen, batch_size=cal.batch_size, sink_capacity=cal.capacity(sequences),
        operators=tuple(get_operator(v.operator).cost for v in options.variants),
        variant_boundaries=max(per_depth) if depths else boundaries, candidates=len(set(options.fit.sink_directions)),
        heldout=options.heldout, score_bytes=score.bytes, score_note=score.note, eval_batch=options.eval_batch_size,
        eval_seqlen=options.eval_seqlen, eval_tokens=len(options.eval_corpora) * per_corpus,
        kept_indices=len(chosen) if depths else 0, kept_cap=kept_cap,
        drift=not depths and options.drift_windows > 0 and bool(options.eval_corpora),
        sequential=any(v.sequential for v in options.variants), keep_heldout=not depths and options.heldout > 0,
        speed_tokens=options.speed.prefill_tokens + options.speed.decode_tokens if options.speed.measure else 0,
        pipeline=cal.pipeline, stats_device=cal.stats_device,
        distill_device=distill.device, distill_host=distill.host, distill_kept=distill.kept)


def score_footprint(criteria: Sequence[str], shapes: ScoreShapes) -> Footprint:
    """The score phase: the largest declaration of the criteria scored one after another (their notes joined);
    with the map, the similarity pass that makes it counts even where no similarity criterion is among them."""
    footprints = [get_criterion(name).memory(shapes) for name in criteria]
    if shapes.with_map:
        footprints.append(similarity_bytes(shapes))
    notes = "; ".join(f.note for f in footprints if f.note)
    return Footprint(max(f.bytes for f in footprints), notes)


def memory_plan(options: RunOptions, config, device: str | None = None, dtype=None, boundaries: int | None = None,
                depths: Sequence[int] | None = None, resident: tuple[int, int] = (0, 0),
                device_available: int | None = None, host_available: int | None = None,
                train_blocks: int | None = None, criteria: Sequence[str] | None = None) -> MemoryPlan:
    """The run's memory plan from the config (before loading: device and dtype as the load options say;
    once loaded: its placement, and `resident` = `memory.resident_bytes` of the loaded model)."""
    device = device or resolve_device(options.load.device)
    dtype = dtype or resolve_dtype(options.load.dtype, device, options.model)
    request = plan_request(options, config, boundaries, depths, dtype=dtype, train_blocks=train_blocks, criteria=criteria)
    return plan_memory(config, options.model, device, dtype, request, device_available, host_available, resident)


def planned(options: RunOptions, loaded: LoadedModel | None = None, boundaries: int | None = None,
            depths: Sequence[int] | None = None, criteria: Sequence[str] | None = None) -> tuple[RunOptions, MemoryPlan]:
    """Options with the calibration size resolved and calibration placed, and the memory plan behind them.

    Before loading (`loaded` None) the plan comes from the config alone; a plan that cannot fit
    is refused here, before any weight is read. Once loaded, the plan adds what the model already
    holds to the free memory it measures, so it is the plan made before loading. `boundaries`:
    how many boundaries the statistics hold at once (None: the most this criterion and depth, or
    a sweep's `depths`, can make).
    """
    if loaded is None:
        config = peek_config(options.model, options.load.local_folders)
        options = sized(options, config.hidden_size)
        plan = memory_plan(options, config, boundaries=boundaries, depths=depths, criteria=criteria)
    else:
        options = sized(options, loaded.hidden_size)
        plan = memory_plan(options, loaded.model.config, *model_placement(loaded.model), boundaries=boundaries,
                           depths=depths, resident=resident_bytes(loaded.model), criteria=criteria)
    plan.check()
    log.info(plan.summary())
    return _placed(plan, options), plan


def _placed(plan: MemoryPlan, options: RunOptions) -> RunOptions:
    """Options with the plan's calibration pipeline, whether the held-out rows are kept, and, on a GPU, its
    statistics device."""
    cal = options.calibrate
    stats_device = plan.stats_device if cal.stats_device == "auto" and plan.device != "cpu" else cal.stats_device
    compute = cal.compute_device
    if plan.pipeline == "blocks" and compute is None and plan.device.startswith("cuda"):
        compute = plan.device
    return dataclasses.replace(options, calibrate=dataclasses.replace(
        cal, pipeline=plan.pipeline, stats_device=stats_device, compute_device=compute,
        keep_heldout=plan.heldout_rows_bytes > 0))


OPERATOR_CHOICES = list(OPERATORS) + [f"{name}{SEQUENTIAL_SUFFIX}" for name in OPERATORS if name != "none"]
# the distilled variants a front end offers: each operator's own weights where it has some, and block s−1's MLP
DISTILL_CHOICES = [kd_name(name, OPERATOR_TARGET) for name in OPERATORS if has_own_weights(name)] + \
    [kd_name(name, "mlp") for name in OPERATORS]


def statistics_bytes_per_boundary(width: int, options: RunOptions, branch: bool = True, config=None) -> int:
    """Bytes one boundary's accumulator allocates for the operators `options` asks for (`config`: the model's,
    for the down_proj refit's I×I statistics; without it they are not counted)."""
    needs = needs_of(v.operator for v in options.variants)
    sequences = options.train_size or min_calibration_sequences(width, options.seqlen)
    inner = 0 if config is None else inner_width(config, needs)
    return statistics_bytes(width, needs, options.calibrate.capacity(sequences), branch, inner)


def gguf_options(options: RunOptions, imatrix: bool = False, **overrides) -> GGUFOptions:
    """The GGUF export's texts from a run: the importance matrix (when asked) on the run's own calibration text,
    every file's perplexity on the evaluation part of its first perplexity corpus (of its calibration corpus
    when it evaluates none). Both are the texts the run read, never new data. `overrides`: other GGUFOptions
    fields (e.g. imatrix_chunks, which the label then states)."""
    calibration = corpora.get_corpus(options.corpus(options.calibration, "calibration"), "calibration")
    name = options.eval_corpora[0] if options.eval_corpora else options.calibration
    evaluation = corpora.get_corpus(options.corpus(name, "evaluation"), "evaluation")
    shape = GGUFOptions(**overrides)
    label = (f"the run's calibration text, {calibration.label} (up to {shape.imatrix_chunks} windows of "
             f"{shape.context} tokens)")
    return dataclasses.replace(shape, imatrix_text=calibration.text if imatrix else None,
                               imatrix_label=label if imatrix else "",
                               eval_text=evaluation.text, eval_label=evaluation.label)
