"""Depth sweep: how many blocks can go? Every depth from one scoring pass and one calibration pass.

`sweep_stages(options, depths)` answers "perplexity against removed blocks" the way the
papers draw it, and streams the curve as it grows:

1. load the model (or take the loaded one);
2. score the blocks ONCE: one similarity pass feeds an accumulator per depth, so every
   depth's plan equals that of a single-depth run (`selection.choose.select_blocks_depths`);
3. calibrate ONCE over the union of every depth's boundaries (`run.plans.calibrate_plans`: a
   boundary two depths share, same start and end, is accumulated once);
4. the dense perplexity once per corpus, keeping the dense residual entering each depth's
   first changed block (`run.plans.dense_evaluation`);
5. per depth, smallest first: fit every operator and run only the variants' suffixes on the kept
   dense states (`run.plans.evaluate_plan`, held-out boundary errors included, as a single run
   does); then free that depth's statistics (those no later depth shares), its kept states and
   its variants, and yield.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import LoadedModel
from ghosted_core.oom import guard_stages
from ghosted_core.plan import PruningPlan, check_block_number
from ghosted_core.run.options import PREFIX_CACHE_BYTES, RunOptions, single_run_only, validate
from ghosted_core.run.plans import Clock, ManyPlansResult, PlanResult, calibrate_plans, calibration_for, \
    dense_evaluation, evaluate_plan, plan_and_load
from ghosted_core.run.result import run_json
from ghosted_core.selection.choose import select_blocks_depths
from ghosted_core.selection.criteria import SelectionRequest, get_criterion
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)


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
    return tuple(range(start, check_block_number(stop, str(text)) + 1, step))


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
class SweepResult(ManyPlansResult):
    """What a sweep found so far; `to_json` is its results.json (a "sweep" entry beside the run's settings)."""

    depths: tuple[int, ...]
    plans: dict[int, PruningPlan] = field(default_factory=dict)  # depth → plan, all known after "score blocks"
    results: list[PlanResult] = field(default_factory=list)  # one per finished depth, in depth order

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
    single_run_only(options, "a depth sweep")
    if num_layers is not None:
        for n in chosen:
            validate(replace(options, num_prune=n), num_layers, max_positions)
    return chosen


def sweep_stages(options: RunOptions, depths: Sequence[int], loaded: LoadedModel | None = None,
                 sweep: SweepOptions = SweepOptions(), should_stop: StopCheck = None) -> Iterator[tuple[str, SweepResult]]:
    """Run a depth sweep, yielding (stage, result so far) after each stage and after each depth.

    `should_stop` is polled before every stage and depth and between perplexity batches
    (`stopping.RunStopped`); the result yielded last holds every depth finished before it.
    Running out of memory raises a `GhostedError` naming the way out (`oom.guard_stages`).
    """
    return guard_stages(_sweep_stages(options, depths, loaded, sweep, should_stop), "load model")


def _sweep_stages(options: RunOptions, depths: Sequence[int], loaded: LoadedModel | None, sweep: SweepOptions,
                  should_stop: StopCheck) -> Iterator[tuple[str, SweepResult]]:
    chosen = check_sweep(options, depths)
    result = SweepResult(chosen, options=options)
    clock = Clock(result.timings)

    # The statistics of every depth live at once: plan for the boundaries of all depths together.
    options, loaded = plan_and_load(options, loaded, lambda layers, positions: check_sweep(options, chosen, layers,
                                                                                           positions), result,
                                    depths=chosen)
    dense, tokenizer = loaded.model, loaded.tokenizer
    clock.tick("load model")
    yield "load model", result

    check_stop(should_stop, "score blocks")
    batches = calibration_for(options, tokenizer, result)
    requests = [SelectionRequest(loaded.num_layers, n, (), options.cosine) for n in chosen]
    for n, (plan, _sim) in zip(chosen, select_blocks_depths(dense, options.criterion, requests, batches, options.quiet)):
        result.plans[n] = plan
    clock.tick("score blocks")
    yield "score blocks", result

    check_stop(should_stop, "calibrate")
    statistics = calibrate_plans(dense, list(result.plans.values()), batches, options, result.hidden_size)
    result.statistics = statistics.summary
    clock.tick("calibrate")
    yield "calibrate", result

    check_stop(should_stop, "perplexity dense")
    evaluation = dense_evaluation(dense, tokenizer, options, list(result.plans.values()), result.hidden_size,
                                  sweep.prefix_cache_bytes)
    evaluation.record(result)
    clock.tick("perplexity dense")
    yield "perplexity dense", result

    for n in chosen:
        check_stop(should_stop, f"depth {n}")
        plan = result.plans[n]
        depth = evaluate_plan(dense, options, plan, statistics.for_plan(plan), batches, evaluation.cached, should_stop)
        statistics.release(plan)  # free what no later depth needs
        evaluation.release(plan)
        result.results.append(depth)
        result.notes += [f"n = {n}: {note}" for note in depth.notes]
        clock.tick(f"depth {n}")
        yield f"depth {n}", result


def run_sweep(options: RunOptions, depths: Sequence[int], loaded: LoadedModel | None = None,
              sweep: SweepOptions = SweepOptions()) -> SweepResult:
    """Run every stage of a sweep and return the final result."""
    result = None
    for _stage, result in sweep_stages(options, depths, loaded, sweep):
        pass
    return result
