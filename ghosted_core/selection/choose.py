"""Score the blocks and choose: one criterion (`select_blocks`, a run), one criterion at several depths
(`select_blocks_depths`, a sweep), or several criteria at one depth (`score_criteria`, a comparison).

The similarity criteria share one similarity pass, the layer-similarity map included; every
other criterion runs its own scoring, timed and counted (`Selection.cost`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from ghosted_core.calibration.collect import CalibrationBatch
from ghosted_core.errors import GhostedError
from ghosted_core.model.layer_config import required_reasons
from ghosted_core.model.surgery import check_cut
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.criteria import Scoring, SelectionRequest, check_request, get_criterion
from ghosted_core.selection.similarity import SimilarityStats, measure_similarity_depths
from ghosted_core.selection.suffixes import Work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """One criterion's choice, what it cost (measured) and what else it found (JSON-ready)."""

    criterion: str
    plan: PruningPlan
    cost: dict
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        spec = get_criterion(self.criterion)
        return {"criterion": self.criterion, "label": spec.label, "paper": spec.paper, "cost_formula": spec.cost,
                "removed_layers": list(self.plan.removed), "boundaries": [[b.start, b.end] for b in self.plan.boundaries],
                "scores": list(self.plan.scores), "score_label": self.plan.score_label, "cost": self.cost,
                "details": self.details}


def select_blocks(model: PreTrainedModel, criterion: str, request: SelectionRequest,
                  batches: Sequence[CalibrationBatch], quiet: bool = False) -> tuple[PruningPlan, SimilarityStats | None]:
    """Score the blocks (if the criterion needs it) and return the plan."""
    return select_blocks_depths(model, criterion, [request], batches, quiet)[0]


def select_blocks_depths(model: PreTrainedModel, criterion: str, requests: Sequence[SelectionRequest],
                         batches: Sequence[CalibrationBatch],
                         quiet: bool = False) -> list[tuple[PruningPlan, SimilarityStats | None]]:
    """`select_blocks` for several requests (depths) with one similarity pass; plans in request order."""
    requests = [with_required(model, request) for request in requests]
    for request in requests:
        check_request(criterion, request)
    spec = get_criterion(criterion)
    sims: dict[int, SimilarityStats] = {}
    if spec.needs_similarity and requests:
        sims = measure_similarity_depths(model, [r.n for r in requests], batches, _one_cosine(requests), quiet)
    chosen = []
    shared: dict = {}
    for request in requests:
        sim = sims.get(max(request.n, 1)) if spec.needs_similarity else None
        plan = spec.select(request, Scoring(model, batches, sim, quiet, shared=shared))
        if model is not None:  # refused here, before any calibration
            check_cut(model, plan.removed)
        log.info("%s removes blocks %s", criterion, list(plan.removed))
        chosen.append((plan, sim))
    return chosen


def with_required(model: PreTrainedModel, request: SelectionRequest) -> SelectionRequest:
    """`request` with the blocks the model's family requires kept (`layer_config.required_reasons`) added."""
    if model is None:
        return request
    reasons = required_reasons(model.config)
    return dataclasses.replace(request, keep=tuple(sorted({*request.keep, *reasons})),
                               why_kept=tuple(sorted({**dict(request.why_kept), **reasons}.items())))


def _one_cosine(requests: Sequence[SelectionRequest]) -> str:
    cosines = {r.cosine for r in requests}
    if len(cosines) > 1:
        raise GhostedError("all depths of a sweep must use the same cosine axis")
    return cosines.pop()


def score_criteria(model: PreTrainedModel, criteria: Sequence[str], request: SelectionRequest,
                   batches: Sequence[CalibrationBatch], quiet: bool = False,
                   with_map: bool = True) -> tuple[list[Selection], SimilarityStats | None]:
    """Every criterion's plan at one depth, in the order given, with its measured cost (see `iter_criteria`)."""
    selections, sim = [], None
    for selection, sim in iter_criteria(model, criteria, request, batches, quiet, with_map):
        selections.append(selection)
    return selections, sim


def iter_criteria(model: PreTrainedModel, criteria: Sequence[str], request: SelectionRequest,
                  batches: Sequence[CalibrationBatch], quiet: bool = False, with_map: bool = True,
                  shared: dict | None = None) -> Iterator[tuple[Selection, SimilarityStats | None]]:
    """Each criterion's plan at one depth as soon as it is chosen, with the similarity pass's statistics.

    ONE similarity pass serves every similarity criterion and the layer-similarity map (its
    cost is stated once, as shared); each other criterion runs and is timed on its own. The
    `shared` table lets criteria that measure the same thing compute it once: swap_kl's two probes,
    and, when a caller passes the same table to several depths on the same batches, sleb's and
    prunecomp's rounds (a deeper run's first rounds are the shallower run) and the swap probes.
    """
    request = with_required(model, request)
    for name in criteria:
        check_request(name, request)
    windows = sum(len(b.input_ids) for b in batches if not b.heldout)
    sim = None
    shared_cost: dict = {}
    if with_map or any(get_criterion(c).needs_similarity for c in criteria):
        start = time.perf_counter()
        sim = measure_similarity_depths(model, [request.n], batches, request.cosine, quiet, with_map)[max(request.n, 1)]
        shared_cost = Work(passes=1, block_runs=windows * request.num_layers, seconds=time.perf_counter() - start
                           ).to_json(windows, model.config) | {"shared": "one similarity pass (no head) for every "
                                                                         "similarity criterion and the map"}
    shared = {} if shared is None else shared
    for name in criteria:
        spec = get_criterion(name)
        scoring = Scoring(model, batches, sim, quiet, shared=shared)
        fresh, start = scoring.work, time.perf_counter()
        plan = spec.select(request, scoring)
        if model is not None:  # refused here, before any calibration
            check_cut(model, plan.removed)
        if scoring.work is fresh:
            scoring.work.seconds = time.perf_counter() - start
        cost = shared_cost if spec.needs_similarity else scoring.work.to_json(windows, model.config)
        if scoring.work is not fresh:  # an earlier measurement's result (and cost), said once
            partner = scoring.details.get(name, {}).get("shared_with")
            cost = cost | {"shared": f"measured once for {partner} and {name}" if partner else
                           "the same measurement as an earlier scoring in this run (its cost)"}
        log.info("%s removes blocks %s (%.1f s)", name, list(plan.removed), cost.get("seconds", 0.0))
        yield Selection(name, plan, cost, scoring.details.get(name, {})), sim
