"""Depth sweep: how many blocks can go? Every depth from one scoring pass and one calibration pass.

`sweep_stages(options, depths)` answers "perplexity against removed blocks" the way the
papers draw it, and streams the curve as it grows:

1. load the model (or take the loaded one);
2. score the blocks ONCE: one similarity pass feeds an accumulator per depth, so every
   depth's plan equals that of a single-depth run (`selection.choose.select_blocks_depths`);
3. calibrate ONCE: `collect_stats` over the union of every depth's boundaries, with the
   statistics every requested operator needs. The hooks capture the residual at every index
   any depth needs; statistics are per boundary, so a boundary two depths share (same start
   and end) is accumulated once;
4. the dense perplexity once per corpus, keeping the dense residual entering each depth's
   first changed block (`evaluation.perplexity.dense_prefix_states`);
5. per depth, smallest first: fit every operator (`run.fitting.fit_variants`, which also measures
   held-out boundary errors with one pass over the held-out sequences, as a single run does),
   run only the variants' suffixes on the kept dense states; then free that depth's statistics
   (those no later depth shares), its kept states and its variants, and yield.

Memory grows with depths × boundaries × statistics. During the calibration pass every
distinct boundary's statistics are alive at once: (distinct boundaries) × (statistics of one
boundary, O(C²) float64 whatever the token count: `memory` / `statistics.statistics_bytes`).
From step 5 on they shrink depth by depth. The kept dense states cost evaluation tokens × C ×
dtype bytes per distinct first changed block; above `SweepOptions.prefix_cache_bytes` the
sweep recomputes each depth's prefix instead. `+seq` variants are supported, honestly: each
costs one extra calibration pass per boundary after the first (a dense and a recovered
forward over the calibration batches, plus its own held-out pass), counted per depth.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from ghosted_core.data import corpora
from ghosted_core.statistics import BoundaryStats
from ghosted_core.calibration.collect import collect_stats
from ghosted_core.errors import GhostedError
from ghosted_core.run.options import statistics_bytes_per_boundary
from ghosted_core.evaluation.perplexity import PrefixStates, dense_prefix_states, perplexity, perplexity_from_states
from ghosted_core.model.loading import LoadedModel, load_model, max_positions, peek_config
from ghosted_core.recovery.assessment import FitReport
from ghosted_core.recovery.operators import needs_of
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.memory import MemoryPlan, max_boundaries
from ghosted_core.run.options import RunOptions, planned, validate
from ghosted_core.run.pipeline import calibration_batches, corpus_entry
from ghosted_core.run.result import fit_json, run_json
from ghosted_core.run.fitting import fit_variants
from ghosted_core.selection.choose import select_blocks_depths
from ghosted_core.selection.criteria import SelectionRequest, get_criterion
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)

PREFIX_CACHE_BYTES = 2 * 2**30  # default cap on the kept dense evaluation states


def parse_depths(text: str) -> tuple[int, ...]:
    """'2:10:2' → (2, 4, 6, 8, 10) (STOP included); 'START:STOP' steps by 1; '7' → (7,).

    GhostedError for anything else, a step ≤ 0, START > STOP or a depth below 1. Whether a
    depth leaves a block depends on the model: `check_depths` says so once it is known.
    """
    parts = [p.strip() for p in str(text).split(":")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise GhostedError(f"cannot read the depth {text!r}: write a number of blocks (7) or START:STOP:STEP "
                           "(2:10:2 sweeps 2, 4, 6, 8, 10)") from None
    if len(numbers) == 1:
        start = stop = numbers[0]
        step = 1
    elif len(numbers) in (2, 3):
        start, stop, step = numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 1
    else:
        raise GhostedError(f"cannot read the depth range {text!r}: write START:STOP:STEP, e.g. 2:10:2")
    if step <= 0:
        raise GhostedError(f"the depth range {text!r} has step {step}; the step must be at least 1")
    if start > stop:
        raise GhostedError(f"the depth range {text!r} starts above its stop ({start} > {stop}); write START:STOP:STEP "
                           "with START ≤ STOP")
    if start < 1:
        raise GhostedError(f"the depth range {text!r} starts at {start}; remove at least 1 block")
    return tuple(range(start, stop + 1, step))


def check_depths(depths: Sequence[int], num_layers: int | None = None) -> tuple[int, ...]:
    """Sorted distinct depths, each ≥ 1 and (once the model is known) leaving at least one block."""
    chosen = tuple(sorted(set(int(d) for d in depths)))
    if not chosen:
        raise GhostedError("a sweep needs at least one depth, e.g. 2:10:2")
    if chosen[0] < 1:
        raise GhostedError(f"depth {chosen[0]} removes nothing; every depth of a sweep must remove at least 1 block")
    if num_layers is not None and chosen[-1] >= num_layers:
        raise GhostedError(f"depth {chosen[-1]} removes {chosen[-1]} of {num_layers} blocks and leaves none; "
                           f"sweep up to at most {num_layers - 1}")
    return chosen


@dataclass(frozen=True)
class SweepOptions:
    """How the sweep trades memory for time (the run's own settings stay in `RunOptions`)."""

    prefix_cache_bytes: int = PREFIX_CACHE_BYTES  # cap on the kept dense states; above it each depth recomputes its prefix


@dataclass
class DepthResult:
    """One depth of a sweep: its plan, every variant's perplexity and boundary errors."""

    n: int
    plan: PruningPlan
    fits: dict[str, list[FitReport]] = field(default_factory=dict)  # variant → one report per boundary
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)  # corpus → variant → ppl
    extra_passes: int = 0  # calibration passes beyond the shared one (+seq variants), at this depth
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
        return {
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
class SweepResult:
    """What a sweep found so far; `to_json` is its results.json (a "sweep" entry beside the run's settings)."""

    options: RunOptions
    depths: tuple[int, ...]
    model_description: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    plans: dict[int, PruningPlan] = field(default_factory=dict)  # depth → plan, all known after "score blocks"
    calibration_label: str = ""
    calibration_tokens: int = 0
    statistics: dict = field(default_factory=dict)  # distinct boundaries, bytes, passes
    dense: dict[str, float] = field(default_factory=dict)  # corpus → dense perplexity
    corpora: dict[str, dict] = field(default_factory=dict)  # corpus → label, real, user, windows, tokens
    results: list[DepthResult] = field(default_factory=list)  # one per finished depth, in depth order
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_plan: MemoryPlan | None = None  # planned before loading, for every depth's boundaries at once

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.options.variants]

    def to_json(self) -> dict:
        return run_json(self) | {
            "sweep": {
                "depths": list(self.depths),
                "variants": self.variant_names,
                "statistics": self.statistics,
                "dense": {"ppl": dict(self.dense)},
                "planned": {str(n): list(plan.removed) for n, plan in self.plans.items()},
                "results": [r.to_json(self.dense) for r in self.results],
            },
        }


def planned_stages(depths: Sequence[int]) -> list[str]:
    """The stage names `sweep_stages` yields, in order (for a progress bar)."""
    return ["load model", "score blocks", "calibrate", "perplexity dense", *(f"depth {n}" for n in sorted(set(depths)))]


class _Clock:
    """Seconds since the last tick, added under a stage name."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self.last = time.perf_counter()

    def tick(self, stage: str) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds
        return seconds


def check_sweep(options: RunOptions, depths: Sequence[int], num_layers: int | None = None,
                max_positions: int | None = None) -> tuple[int, ...]:
    """Refuse a sweep no run could do, before any expensive step; the depths, sorted."""
    chosen = check_depths(depths, num_layers)
    validate(options)
    if not get_criterion(options.criterion).needs_similarity:
        raise GhostedError(f"a depth sweep chooses blocks per depth: use streamline, shortgpt or angular, "
                           f"not {options.criterion}")
    if options.tasks or options.prompt:
        raise GhostedError("a depth sweep reports perplexity and boundary errors only; zero-shot tasks and "
                           "generations run on a single depth")
    if num_layers is not None:
        for n in chosen:
            validate(replace(options, num_prune=n), num_layers, max_positions)
    return chosen


def _first_changed_block(plan: PruningPlan) -> int:
    """The earliest dense block a variant of this plan may change: the block before its first run
    (ReplaceMe rewrites it), or block 0."""
    return max(plan.boundaries[0].start - 1, 0)


def sweep_stages(options: RunOptions, depths: Sequence[int], loaded: LoadedModel | None = None,
                 sweep: SweepOptions = SweepOptions(), should_stop: StopCheck = None) -> Iterator[tuple[str, SweepResult]]:
    """Run a depth sweep, yielding (stage, result so far) after each stage and after each depth.

    `should_stop` is polled before every stage and depth and between perplexity batches
    (`stopping.RunStopped`); the result yielded last holds every depth finished before it.
    """
    chosen = check_sweep(options, depths)
    result = SweepResult(options, chosen)
    clock = _Clock(result.timings)

    if loaded is None:
        config = peek_config(options.model)  # refuse bad depths and lengths before loading weights
        check_sweep(options, chosen, config.num_hidden_layers, max_positions(config))
    # The statistics of every depth live at once: plan for the boundaries of all depths together.
    layers = loaded.num_layers if loaded is not None else config.num_hidden_layers
    boundaries = sum(max_boundaries(options.criterion, layers, n, options.layers) for n in chosen)
    options, result.memory_plan = planned(options, loaded, boundaries)
    result.options = options
    if loaded is None:
        loaded = load_model(options.model, options.load)
    check_sweep(options, chosen, loaded.num_layers, max_positions(loaded.model.config))
    dense, tokenizer = loaded.model, loaded.tokenizer
    result.model_description = loaded.description
    result.num_layers, result.hidden_size = loaded.num_layers, loaded.hidden_size
    clock.tick("load model")
    yield "load model", result

    check_stop(should_stop, "score blocks")
    batches, result.calibration_tokens = calibration_batches(tokenizer, options)
    result.corpora[options.calibration] = corpus_entry(options, options.calibration, "calibration")
    result.calibration_label = result.corpora[options.calibration]["label"]
    requests = [SelectionRequest(loaded.num_layers, n, (), options.cosine) for n in chosen]
    for n, (plan, _sim) in zip(chosen, select_blocks_depths(dense, options.criterion, requests, batches, options.quiet)):
        result.plans[n] = plan
    clock.tick("score blocks")
    yield "score blocks", result

    # One pass for every depth. Memory: distinct boundaries × one boundary's statistics (O(C²) float64).
    uses = Counter(b for plan in result.plans.values() for b in plan.boundaries)
    boundaries = sorted(uses, key=lambda b: (b.end, b.start))
    estimated = sum(statistics_bytes_per_boundary(result.hidden_size, options, b.start > 0) for b in boundaries)
    log.info("calibrating %d distinct boundaries for depths %s in one pass: statistics of about %.0f MiB",
             len(boundaries), list(chosen), estimated / 2**20)
    check_stop(should_stop, "calibrate")
    needs = needs_of(v.operator for v in options.variants)
    live: list = []  # the accumulators, to read what they allocated
    stats: dict[Boundary, BoundaryStats] = dict(zip(boundaries, collect_stats(dense, boundaries, batches,
                                                                               options.calibrate, needs, live)))
    result.statistics = {"boundaries": [[b.start, b.end] for b in boundaries], "distinct_boundaries": len(boundaries),
                         "bytes": sum(acc.nbytes() for acc in live), "estimated_bytes": estimated,
                         "kept_bytes": sum(s.nbytes() for s in stats.values()), "calibration_passes": 1}
    del live
    clock.tick("calibrate")
    yield "calibrate", result

    check_stop(should_stop, "perplexity dense")
    cached = _dense_evaluation(dense, tokenizer, options, result, sweep)
    clock.tick("perplexity dense")
    yield "perplexity dense", result

    starts = Counter(_first_changed_block(result.plans[n]) for n in chosen)
    for n in chosen:
        check_stop(should_stop, f"depth {n}")
        depth = _run_depth(dense, options, result.plans[n], stats, batches, cached, should_stop)
        for b in depth.plan.boundaries:  # free what no later depth needs
            uses[b] -= 1
            if uses[b] == 0:
                del stats[b]
        start = _first_changed_block(depth.plan)
        starts[start] -= 1
        if starts[start] == 0:
            for states in cached.values():
                states.drop(start)
        result.results.append(depth)
        result.notes += [f"n = {n}: {note}" for note in depth.notes]
        clock.tick(f"depth {n}")
        yield f"depth {n}", result


def _dense_evaluation(dense: PreTrainedModel, tokenizer, options: RunOptions, result: SweepResult,
                      sweep: SweepOptions) -> dict[str, PrefixStates]:
    """Dense perplexity per corpus from one pass each, with the dense states kept (none when over the cap)."""
    seqlen = options.eval_seqlen or options.seqlen
    windows = {corpus: corpora.evaluation_windows(tokenizer, options.corpus(corpus, "evaluation"), seqlen,
                                               options.eval_max_tokens) for corpus in options.eval_corpora}
    starts = sorted({_first_changed_block(plan) for plan in result.plans.values()})
    element = torch.tensor([], dtype=dense.dtype).element_size()
    # memory: evaluation tokens × C × dtype bytes per distinct first changed block
    needed = sum(w.numel() for w in windows.values()) * result.hidden_size * element * len(starts)
    keep = needed <= sweep.prefix_cache_bytes
    if not keep:
        note = (f"kept dense states would take {needed / 2**30:.1f} GiB (cap {sweep.prefix_cache_bytes / 2**30:.1f} "
                "GiB): each depth recomputes its dense prefix instead")
        log.warning(note)
        result.notes.append(note)
    cached: dict[str, PrefixStates] = {}
    for corpus, win in windows.items():
        states = dense_prefix_states(dense, win, starts if keep else [], options.eval_batch_size, options.quiet,
                                     desc=f"perplexity {corpus} dense")
        result.dense[corpus] = states.dense_perplexity
        result.corpora[corpus] = corpus_entry(options, corpus, "evaluation") | {
            "windows": len(win), "tokens": int(win.numel()), "predicted_tokens": states.tokens}
        cached[corpus] = states
    return cached


def _run_depth(dense: PreTrainedModel, options: RunOptions, plan: PruningPlan, stats: dict[Boundary, BoundaryStats],
               batches, cached: dict[str, PrefixStates], should_stop: StopCheck = None) -> DepthResult:
    """Fit every operator at one depth, evaluate the variants on the kept dense states, drop them."""
    depth = DepthResult(len(plan.removed), plan)
    clock = _Clock(depth.timings)
    # fit_variants drops each entry of this list once its fits exist; `stats` keeps what later depths share
    depth.fits, models = fit_variants(dense, plan, options.variants, [stats[b] for b in plan.boundaries], batches,
                                      options)
    for variant in options.variants:
        reports = depth.fits[variant.name]
        depth.notes += [f"{variant.name}, boundary {r.boundary}: {note}" for r in reports for note in r.notes]
        if variant.sequential:
            depth.extra_passes += len(plan.boundaries) - 1
    clock.tick("fit operators")
    for corpus, states in cached.items():
        desc = f"perplexity {corpus}, n = {depth.n}"
        if _first_changed_block(plan) in states.states:
            depth.perplexity[corpus] = perplexity_from_states(dense, models, states, options.quiet, desc, should_stop)
        else:  # over the cache cap: the prefix runs again
            depth.perplexity[corpus] = perplexity(dense, models, states.windows, states.batch_size, options.quiet, desc,
                                                  should_stop)
    clock.tick("perplexity")
    return depth


def run_sweep(options: RunOptions, depths: Sequence[int], loaded: LoadedModel | None = None,
              sweep: SweepOptions = SweepOptions()) -> SweepResult:
    """Run every stage of a sweep and return the final result."""
    result = None
    for _stage, result in sweep_stages(options, depths, loaded, sweep):
        pass
    return result
