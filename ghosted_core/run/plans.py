"""Several pruning plans from one calibration pass: shared by the depth sweep and the criteria comparison.

1. `calibrate_plans`: ONE `collect_stats` pass over the union of every plan's boundaries, with the
   statistics every requested operator needs. Statistics are per boundary, so a boundary two
   plans share (same start and end) is accumulated once; `PlanStatistics.release` frees it after
   the last plan that uses it. Memory: (distinct boundaries) × (statistics of one boundary, O(C²)
   float64 whatever the token count: `statistics.statistics_bytes`).
2. `dense_evaluation`: the dense perplexity once per corpus, keeping the dense residual entering
   each plan's first changed block (`evaluation.perplexity.dense_prefix_states`). Memory:
   evaluation tokens × C × dtype bytes per distinct first changed block; above the cap each plan
   recomputes its prefix instead.
3. `evaluate_plan`: fit every operator on one plan (`run.fitting.fit_variants`, held-out errors
   included) and run only the variants' suffixes on the kept dense states.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ghosted_core.calibration.collect import collect_stats
from ghosted_core.data import corpora
from ghosted_core.export.gain import REFERENCE, GainReport, measure_gain
from ghosted_core.evaluation.perplexity import PrefixStates, dense_prefix_states, perplexity, perplexity_from_states, \
    shared_prefix
from ghosted_core.memory import MemoryPlan
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.recovery.assessment import FitReport
from ghosted_core.recovery.operators import needs_of
from ghosted_core.run.fitting import fit_variants
from ghosted_core.run.options import PREFIX_CACHE_BYTES, RunOptions, check_family, for_family, \
    statistics_bytes_per_boundary
from ghosted_core.model.loading import LoadedModel, load_model, max_positions, peek_config
from ghosted_core.run.options import planned
from ghosted_core.run.pipeline import calibration_batches, corpus_entry, window_counts
from ghosted_core.run.result import fit_json
from ghosted_core.statistics import BoundaryStats
from ghosted_core.stopping import StopCheck

log = logging.getLogger(__name__)



@dataclass(kw_only=True)
class ManyPlansResult:
    """What a run over several plans from one calibration pass records beside its plans (a depth sweep's and a
    criteria comparison's results share these; `run.result.run_json` writes them)."""

    options: RunOptions
    model_description: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    calibration_label: str = ""
    calibration_tokens: int = 0
    statistics: dict = field(default_factory=dict)  # distinct boundaries, bytes, calibration passes
    dense: dict[str, float] = field(default_factory=dict)  # corpus → dense perplexity
    corpora: dict[str, dict] = field(default_factory=dict)  # corpus → label, real, user, windows, tokens
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_plan: MemoryPlan | None = None  # planned before loading, for every plan's boundaries at once
    bos: dict = field(default_factory=dict)  # the BOS rule and what it gave (corpora.BosRule.to_json)

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.options.variants]


def plan_and_load(options: RunOptions, loaded: LoadedModel | None, check: Callable[[int, int | None], None], result: ManyPlansResult,
                  boundaries: Callable[[int], int] | None = None,
                  depths: Sequence[int] | None = None,
                  criteria: Sequence[str] | None = None) -> tuple[RunOptions, LoadedModel]:
    """Refuse what `check(num_layers, max_positions)` refuses before any weight loads, plan the memory
    (for `boundaries(num_layers)` boundaries alive at once, or a sweep's `depths`: `run.options.planned`),
    load, and record the model's facts in `result` (a sweep's or a comparison's; a comparison passes its
    `criteria`, whose scoring and layer-similarity map the plan then counts)."""
    config = loaded.model.config if loaded is not None else peek_config(options.model, options.load.local_folders)
    options, notes = for_family(options, config)  # the defaults a family refuses are left out, with a note
    result.notes += notes
    check_family(options, config, criteria)
    if loaded is None:
        check(config.num_hidden_layers, max_positions(config))
        layers = config.num_hidden_layers
    else:
        layers = loaded.num_layers
    options, result.memory_plan = planned(options, loaded, boundaries(layers) if boundaries else None, depths,
                                           criteria)
    result.options = options
    if loaded is None:
        loaded = load_model(options.model, options.load)
    check(loaded.num_layers, max_positions(loaded.model.config))
    result.bos = corpora.resolve_bos(loaded.tokenizer, options.bos).to_json()
    result.model_description = loaded.description
    result.num_layers, result.hidden_size = loaded.num_layers, loaded.hidden_size
    return options, loaded


def calibration_for(options: RunOptions, tokenizer, result) -> list:
    """The run's calibration batches, with the corpus and its token count recorded in `result`."""
    batches, result.calibration_tokens = calibration_batches(tokenizer, options)
    result.corpora[options.calibration] = corpus_entry(options, options.calibration, "calibration")
    result.calibration_label = result.corpora[options.calibration]["label"]
    return batches


class Clock:
    """Seconds since the last tick, added under a stage name."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self.last = time.perf_counter()

    def tick(self, stage: str) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds
        return seconds


@dataclass
class PlanResult:
    """One plan's variants: every variant's perplexity and boundary errors."""

    n: int
    plan: PruningPlan
    fits: dict[str, list[FitReport]] = field(default_factory=dict)  # variant → one report per boundary
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)  # corpus → variant → ppl
    extra_passes: int = 0  # calibration passes beyond the shared one (+seq variants), for this plan
    gain: GainReport | None = None  # size and speed of the variants, and of dense timed in the same rounds
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def recovered(self, corpus: str, variant: str, dense_ppl: float | None) -> float | None:
        """Share of the pruning damage recovered, (ppl_none − ppl_op) / (ppl_none − ppl_dense); None without "none"."""
        table = self.perplexity.get(corpus, {})
        none, op = table.get("none"), table.get(variant)
        if none is None or op is None or dense_ppl is None or none == dense_ppl:
            return None
        return (none - op) / (none - dense_ppl)

    def to_json(self, dense: dict[str, float]) -> dict:
        variants = {}
        for name, reports in self.fits.items():
            ppl = {corpus: table[name] for corpus, table in self.perplexity.items() if name in table}
            recovered = {corpus: self.recovered(corpus, name, dense.get(corpus)) for corpus in ppl}
            variants[name] = {"ppl": ppl, "recovered": recovered} | fit_json(reports)
            if self.gain is not None:
                variants[name]["gain"] = self.gain.variant_json(name)
        gain = {} if self.gain is None else {"dense_gain": self.gain.variant_json(REFERENCE),
                                             "gain": self.gain.settings_json()}
        return gain | {
            "n": self.n,
            "removed_layers": list(self.plan.removed),
            "boundaries": [[b.start, b.end] for b in self.plan.boundaries],
            "scores": list(self.plan.scores),
            "score_label": self.plan.score_label,
            "variants": variants,
            "extra_calibration_passes": self.extra_passes,
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "notes": self.notes,
        }


@dataclass
class PlanStatistics:
    """Every distinct boundary's statistics from one pass, freed after the last plan that needs them."""

    stats: dict[Boundary, BoundaryStats]
    uses: Counter
    summary: dict  # for results.json: the boundaries, bytes allocated and estimated, calibration passes (1)

    def for_plan(self, plan: PruningPlan) -> list[BoundaryStats]:
        return [self.stats[b] for b in plan.boundaries]

    def release(self, plan: PruningPlan) -> None:
        for b in plan.boundaries:
            self.uses[b] -= 1
            if self.uses[b] == 0:
                del self.stats[b]


def first_changed_block(plan: PruningPlan) -> int:
    """The earliest dense block a variant of this plan may change: the block before its first run
    (ReplaceMe rewrites it), or block 0."""
    return max(plan.boundaries[0].start - 1, 0)


def calibrate_plans(dense: PreTrainedModel, plans: Sequence[PruningPlan], batches, options: RunOptions,
                    hidden_size: int) -> PlanStatistics:
    """ONE calibration pass for the boundaries of every plan (each distinct boundary accumulated once)."""
    uses = Counter(b for plan in plans for b in plan.boundaries)
    boundaries = sorted(uses, key=lambda b: (b.end, b.start))
    estimated = sum(statistics_bytes_per_boundary(hidden_size, options, b.start > 0) for b in boundaries)
    log.info("calibrating %d distinct boundaries of %d plans in one pass: statistics of about %.0f MiB",
             len(boundaries), len(plans), estimated / 2**20)
    live: list = []  # the accumulators, to read what they allocated
    needs = needs_of(v.operator for v in options.variants)
    stats = dict(zip(boundaries, collect_stats(dense, boundaries, batches, options.calibrate, needs, live)))
    summary = {"boundaries": [[b.start, b.end] for b in boundaries], "distinct_boundaries": len(boundaries),
               "bytes": sum(acc.nbytes() for acc in live), "estimated_bytes": estimated,
               "kept_bytes": sum(s.nbytes() for s in stats.values()), "calibration_passes": 1}
    return PlanStatistics(stats, uses, summary)


@dataclass
class DenseEvaluation:
    """The dense perplexity per corpus and the kept dense states the plans' suffixes start from."""

    cached: dict[str, PrefixStates]
    perplexity: dict[str, float]
    corpora: dict[str, dict]
    notes: list[str]
    starts: Counter  # first changed block → plans still to evaluate from it

    def record(self, result) -> None:
        """The dense perplexities, the corpora's entries and the notes, into a sweep's or a comparison's result."""
        result.dense = self.perplexity
        result.notes += self.notes
        result.corpora |= self.corpora

    def release(self, plan: PruningPlan) -> None:
        """Free the kept states at this plan's first changed block once no later plan needs them."""
        start = first_changed_block(plan)
        self.starts[start] -= 1
        if self.starts[start] == 0:
            for states in self.cached.values():
                states.drop(start)


def dense_evaluation(dense: PreTrainedModel, tokenizer, options: RunOptions, plans: Sequence[PruningPlan],
                     hidden_size: int, cap: int = PREFIX_CACHE_BYTES) -> DenseEvaluation:
    """Dense perplexity per corpus from one pass each, with the dense states kept (none when over the cap)."""
    seqlen = options.eval_seqlen or options.seqlen
    windows = {corpus: corpora.evaluation_windows(tokenizer, options.corpus(corpus, "evaluation"), seqlen,
                                               options.eval_max_tokens, options.bos) for corpus in options.eval_corpora}
    starts = Counter(first_changed_block(plan) for plan in plans)
    element = torch.tensor([], dtype=dense.dtype).element_size()
    # memory: evaluation tokens × C × dtype bytes per distinct first changed block
    needed = sum(w.numel() for w in windows.values()) * hidden_size * element * len(starts)
    keep = needed <= cap
    notes = []
    if not keep:
        note = (f"kept dense states would take {needed / 2**30:.1f} GiB (cap {cap / 2**30:.1f} GiB): each plan "
                "recomputes its dense prefix instead")
        log.warning(note)
        notes.append(note)
    evaluation = DenseEvaluation({}, {}, {}, notes, starts)
    for corpus, win in windows.items():
        states = dense_prefix_states(dense, win, sorted(starts) if keep else [], options.eval_batch_size,
                                     options.quiet, desc=f"perplexity {corpus} dense")
        evaluation.perplexity[corpus] = states.dense_perplexity
        evaluation.corpora[corpus] = corpus_entry(options, corpus, "evaluation") | window_counts(win)
        evaluation.cached[corpus] = states
    return evaluation


def evaluate_plan(dense: PreTrainedModel, options: RunOptions, plan: PruningPlan, stats: list[BoundaryStats],
                  batches, cached: dict[str, PrefixStates], should_stop: StopCheck = None,
                  label: str = "") -> PlanResult:
    """Fit every operator on one plan, evaluate the variants on the kept dense states (or their recomputed prefix)."""
    result = PlanResult(len(plan.removed), plan)
    clock = Clock(result.timings)
    # fit_variants drops each entry of `stats` once its fits exist
    result.fits, models = fit_variants(dense, plan, options.variants, stats, batches, options)
    for variant in options.variants:
        reports = result.fits[variant.name]
        result.notes += [f"{variant.name}, boundary {r.boundary}: {note}" for r in reports for note in r.notes]
        if variant.sequential:
            result.extra_passes += len(plan.boundaries) - 1
    clock.tick("fit operators")
    for corpus, states in cached.items():
        desc = f"perplexity {corpus}, {label or f'n = {result.n}'}"
        result.perplexity[corpus] = {}
        for start, group in _by_kept_start(dense, models, states).items():
            if start is None:  # no kept state before its first changed block (over the cap, or magcomp's block 0)
                table = perplexity(dense, group, states.windows, states.batch_size, options.quiet, desc, should_stop)
            else:
                table = perplexity_from_states(dense, group, states, options.quiet, desc, should_stop)
            result.perplexity[corpus] |= table
        result.perplexity[corpus] = {name: result.perplexity[corpus][name] for name in models}  # the variants' order
    clock.tick("perplexity")
    result.gain = measure_gain({REFERENCE: dense, **models}, options.speed, should_stop, options.quiet)  # dense in the same rounds
    clock.tick("size and speed")
    return result


def _by_kept_start(dense: PreTrainedModel, models: dict[str, PreTrainedModel],
                   states: PrefixStates) -> dict[int | None, dict[str, PreTrainedModel]]:
    """Variants grouped by the latest kept dense state they can start from (None: none, the prefix runs again).

    A variant that changes blocks from the start (magcomp scales every writer before its cut) would
    otherwise pull the whole group back to block 0."""
    groups: dict[int | None, dict[str, PreTrainedModel]] = {}
    for name, model in models.items():
        prefix = shared_prefix(dense, model)
        start = max((j for j in states.states if j <= prefix), default=None)
        groups.setdefault(start, {})[name] = model
    return groups
