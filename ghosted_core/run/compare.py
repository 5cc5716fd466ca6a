"""Criteria compared in one run: which blocks each criterion removes, and what every operator gives back on each.

`compare_stages(options, criteria)` streams, criterion by criterion:

1. load the model (or take the loaded one);
2. score every criterion at the run's depth (`selection.choose.iter_criteria`): ONE similarity pass
   serves every similarity criterion and the layer-similarity map; every other criterion runs its
   own scoring, timed and counted. The calibration text that chose the blocks is named in the result;
3. calibrate ONCE over the boundaries of every distinct plan (`run.plans.calibrate_plans`): plans
   that coincide (two criteria removing the same blocks) are one plan, and a boundary two plans
   share is accumulated once;
4. the dense perplexity once per corpus, keeping the dense states each plan's suffixes start from;
5. per criterion: fit and evaluate every operator on its plan, unless an earlier criterion chose the
   same blocks (then its numbers are those, computed once), and yield.

Memory: as a sweep (`run.plans`), for the distinct plans' boundaries, plus what each criterion's
scoring holds while it runs (stated in its registry entry). results.json gets a "compare" entry:
every criterion's blocks, scores and cost, the map, and the criterion × operator table.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ghosted_core.errors import GhostedError
from ghosted_core.memory_parts import max_boundaries
from ghosted_core.model.loading import LoadedModel
from ghosted_core.run.options import RunOptions, selection_request, single_run_only, validate
from ghosted_core.run.plans import Clock, ManyPlansResult, PlanResult, calibrate_plans, calibration_for, \
    dense_evaluation, evaluate_plan, plan_and_load
from ghosted_core.run.result import run_json
from ghosted_core.selection.choose import Selection, iter_criteria
from ghosted_core.selection.criteria import get_criterion
from ghosted_core.selection.similarity import SimilarityMap
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)


def parse_criteria(text: str | Sequence[str]) -> tuple[str, ...]:
    """'streamline, shortgpt,sleb' → the names in order, each once; unknown names refused with the known ones."""
    items = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    names = tuple(dict.fromkeys(items))
    for name in names:
        get_criterion(name)
    if "none" in names:
        raise GhostedError("'none' removes nothing: the dense model is in every comparison's table already; "
                           "leave it out of the criteria list")
    return names


def check_compare(options: RunOptions, criteria: Sequence[str], num_layers: int | None = None,
                  max_positions: int | None = None) -> tuple[str, ...]:
    """Refuse a comparison no run could do, before any expensive step; the criteria, checked."""
    chosen = parse_criteria(criteria)
    if len(chosen) < 2:
        raise GhostedError("a comparison needs at least two criteria, e.g. --pruning_method streamline,shortgpt,sleb")
    if options.tasks or options.prompt:
        raise GhostedError("a criteria comparison reports perplexity and boundary errors only; zero-shot tasks and "
                           "generations run on a single criterion")
    single_run_only(options, "a criteria comparison")
    for name in chosen:
        validate(dataclasses.replace(options, criterion=name), num_layers, max_positions)
    return chosen


def planned_stages(criteria: Sequence[str]) -> list[str]:
    """The stage names `compare_stages` yields, in order (for a progress bar)."""
    names = parse_criteria(criteria)
    return ["load model", *(f"score {c}" for c in names), "calibrate", "perplexity dense",
            *(f"evaluate {c}" for c in names)]


@dataclass
class CompareResult(ManyPlansResult):
    """What a comparison found so far; `to_json` is its results.json (a "compare" entry beside the run's settings)."""

    criteria: tuple[str, ...]
    selections: dict[str, Selection] = field(default_factory=dict)  # criterion → its plan, cost, details
    similarity_map: SimilarityMap | None = None
    plans: list[PlanResult] = field(default_factory=list)  # distinct plans evaluated so far, first chooser's order
    evaluated: dict[str, int] = field(default_factory=dict)  # criterion → index into `plans`

    def calibration_note(self) -> str:
        """Which text chose the blocks (and fitted the operators)."""
        opts = self.options
        return (f"blocks chosen (and operators fitted) on {self.calibration_label or opts.calibration}: "
                f"{opts.train_size} × {opts.seqlen} tokens, seed {opts.seed}")

    def table(self) -> list[dict]:
        """The criterion × operator table: one row per criterion and operator (criteria that share a plan share
        its numbers), with the criterion's blocks and cost."""
        rows = []
        for name in self.criteria:
            if name not in self.evaluated:
                continue
            selection, plan = self.selections[name], self.plans[self.evaluated[name]]
            first = next(c for c in self.criteria if self.evaluated.get(c) == self.evaluated[name])
            for variant in self.variant_names:
                rows.append({"criterion": name, "label": get_criterion(name).label,
                             "removed_layers": list(selection.plan.removed), "operator": variant,
                             "ppl": {c: t[variant] for c, t in plan.perplexity.items() if variant in t},
                             "recovered": {c: plan.recovered(c, variant, self.dense.get(c)) for c in plan.perplexity},
                             "cost": selection.cost, "plan": self.evaluated[name],
                             "same_plan_as": first if first != name else None})
        return rows

    def to_json(self) -> dict:
        plan_criteria = {k: [c for c in self.criteria if self.evaluated.get(c) == k] for k in range(len(self.plans))}
        return run_json(self) | {
            "criterion": ",".join(self.criteria),
            "compare": {
                "criteria": list(self.criteria),
                "n": self.options.num_prune,
                "variants": self.variant_names,
                "calibration_note": self.calibration_note(),
                "selections": {name: s.to_json() for name, s in self.selections.items()},
                "similarity_map": self.similarity_map.to_json() if self.similarity_map else None,
                "statistics": self.statistics,
                "dense": {"ppl": dict(self.dense)},
                "plans": [p.to_json(self.dense) | {"criteria": plan_criteria[k]} for k, p in enumerate(self.plans)],
                "table": self.table(),
            },
        }


def compare_stages(options: RunOptions, criteria: Sequence[str], loaded: LoadedModel | None = None,
                   should_stop: StopCheck = None, shared: dict | None = None) -> Iterator[tuple[str, CompareResult]]:
    """Run a comparison, yielding (stage, result so far) after each criterion's scoring and evaluation.

    `should_stop` is polled before every stage and between perplexity batches (`stopping.RunStopped`).
    `shared`: pass one table to comparisons at several depths on the same calibration text (deepest first)
    and sleb's and prunecomp's rounds and the swap probes are measured once (`selection.choose.iter_criteria`).
    """
    chosen = check_compare(options, criteria)
    options = dataclasses.replace(options, criterion=chosen[0])
    result = CompareResult(chosen, options=options)
    clock = Clock(result.timings)
    options, loaded = plan_and_load(
        options, loaded, lambda layers, positions: check_compare(options, chosen, layers, positions), result,
        boundaries=lambda layers: sum(max_boundaries(c, layers, options.num_prune, options.layers) for c in chosen),
        criteria=chosen)
    dense, tokenizer = loaded.model, loaded.tokenizer
    clock.tick("load model")
    yield "load model", result

    check_stop(should_stop, f"score {chosen[0]}")
    batches = calibration_for(options, tokenizer, result)
    request = selection_request(options, loaded.num_layers)
    for selection, sim in iter_criteria(dense, chosen, request, batches, options.quiet, shared=shared):
        result.selections[selection.criterion] = selection
        result.similarity_map = sim.map if sim is not None else None
        clock.tick(f"score {selection.criterion}")
        yield f"score {selection.criterion}", result
        check_stop(should_stop, "score blocks")

    firsts: dict[tuple[int, ...], str] = {}
    for name in chosen:
        firsts.setdefault(result.selections[name].plan.removed, name)
    plans = [result.selections[name].plan for name in firsts.values()]
    statistics = calibrate_plans(dense, plans, batches, options, result.hidden_size)
    result.statistics = statistics.summary | {"distinct_plans": len(plans), "criteria": len(chosen)}
    clock.tick("calibrate")
    yield "calibrate", result

    check_stop(should_stop, "perplexity dense")
    evaluation = dense_evaluation(dense, tokenizer, options, plans, result.hidden_size)
    evaluation.record(result)
    clock.tick("perplexity dense")
    yield "perplexity dense", result

    index: dict[tuple[int, ...], int] = {}
    for name in chosen:
        check_stop(should_stop, f"evaluate {name}")
        plan = result.selections[name].plan
        if plan.removed not in index:
            done = evaluate_plan(dense, options, plan, statistics.for_plan(plan), batches, evaluation.cached,
                                 should_stop, label=name)
            statistics.release(plan)
            evaluation.release(plan)
            index[plan.removed] = len(result.plans)
            result.plans.append(done)
            result.notes += [f"{name}: {note}" for note in done.notes]
        result.evaluated[name] = index[plan.removed]
        clock.tick(f"evaluate {name}")
        yield f"evaluate {name}", result


def run_compare(options: RunOptions, criteria: Sequence[str], loaded: LoadedModel | None = None,
                shared: dict | None = None) -> CompareResult:
    """Run every stage of a comparison and return the final result."""
    result = None
    for _stage, result in compare_stages(options, criteria, loaded, shared=shared):
        pass
    return result
