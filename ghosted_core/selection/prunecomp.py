"""`prunecomp`: Prune&Comp's iterative selection (arXiv 2507.18212): remove, compensate, rescore, n rounds.

Each round, on the current model (pruned and compensated so far):
1. Block Influence BI_i = 1 − mean over calibration tokens of cos(h_i, h_i+1), the per-token cosine
   (the similarity pass, `selection.similarity`), and the block with the lowest BI (ties to the lowest);
2. the magnitude scale s of that one-block cut on the current model (`recovery.magcomp.magnitude_scale`
   from the per-channel sums of one `collect_stats` pass that stops at the block after the cut), in
   the paper's channel form (the mean over channels of the per-channel ratio of mean |h|; its
   appendix calls it the channel-wise averaged magnitude gain ratio). The reference code averages
   each channel's ratio over windows; magcomp pools the sums over windows first;
3. remove the block and fold s upstream (`recovery.magcomp.compensate`, a view sharing every weight);
   scales of later rounds multiply those of earlier ones in the blocks before both cuts.

The criterion chooses blocks; the comparison then fits every operator on its plan from the dense
model like any other criterion's (pair it with `magcomp` for Prune&Comp's recovery on a one-block
plan; on several runs the iterative compensation and the per-boundary operator differ). A cut
at the last block scales only what the final norm normalizes away: no effect, as the paper's code
cannot compensate it either (it crashes there).

Cost: 2 passes per round over the calibration windows (BI on the whole current model; the scale up to
the block after the cut), 2n in all; the reference runs 128 windows for BI and 256 for s each round.
Memory: the similarity pass's last two streams of a batch, and per-channel sums of one boundary.
"""

from __future__ import annotations

import logging

from ghosted_core.calibration.collect import CalibrationOptions, collect_stats
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.progress import Tracker
from ghosted_core.recovery.magcomp import compensate, magnitude_scale
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes
from ghosted_core.selection.similarity import measure_similarity, similarity_bytes
from ghosted_core.model.surgery import build_variant
from ghosted_core.statistics import StatNeeds

log = logging.getLogger(__name__)

FORM = "channel"  # the paper's channel-wise averaged magnitude gain ratio (magcomp's default is "global")
COST = ("2 passes per round (Block Influence on the current model; the scale up to the block after the cut), 2n in "
        "all; memory: two residual streams of a batch and one boundary's per-channel sums")


def iterate(scoring: Scoring, request: SelectionRequest) -> tuple[list[dict], tuple[float, ...]]:
    """The n rounds: per round the removed block, its BI and its scale; and round 1's BI per block."""
    dense = scoring.model
    alive = list(range(request.num_layers))
    removed: list[int] = []
    current = dense
    rounds = []
    first_scores: tuple[float, ...] = ()
    windows = sum(len(b.input_ids) for b in scoring.fit_batches)
    progress = Tracker("score prunecomp", 2 * request.n, "passes", scoring.quiet)  # two passes per round
    for _ in range(request.n):
        sim = measure_similarity(current, 1, scoring.batches, quiet=True)
        progress.advance()
        scoring.work.passes += 1
        scoring.work.block_runs += windows * len(alive)
        influence = [1.0 - c for c in sim.block_cosine]  # per current block
        position = min((p for p in range(len(alive)) if request.removable(alive[p])), key=lambda p: (influence[p], p))
        if not first_scores:
            first_scores = tuple(influence)
        stats = collect_stats(current, [Boundary(position, position + 1)], scoring.batches,
                              CalibrationOptions(quiet=True), StatNeeds(channel=True))[0]
        scoring.work.passes += 1
        scoring.work.block_runs += windows * (position + 1)
        progress.advance()
        scale = magnitude_scale(stats, FORM)
        block = alive.pop(position)
        removed.append(block)
        rounds.append({"removed": block, "bi": influence[position], "scale": scale})
        current = build_variant(dense, removed)  # the pruned view, every round's scale folded upstream of its cut
        for past in rounds:
            current = compensate(current, Boundary(past["removed"], past["removed"] + 1), removed, past["scale"])
        log.info("prunecomp round %d removes block %d (BI %.5f, scale %.4f)", len(removed), block,
                 influence[position], scale)
    return rounds, first_scores


def prunecomp_bytes(shapes: ScoreShapes) -> Footprint:
    """A round at its peak: the similarity pass at n = 1, or the scale's pass, whichever is larger. The scale's
    pass holds the two captured streams, and beside them first the forward (stopped at the block after the cut),
    then the accumulator's float64 working copies (x, Δ, their ordinary-token rows, x + Δ: five T×C)."""
    s = shapes
    scale_pass = 2 * s.state() + max(s.forward(), 5 * s.batch_tokens * s.width * 8)
    return Footprint(max(similarity_bytes(ScoreShapes(s.config, s.item, s.sequences, s.seqlen, s.batch_size, 1)).bytes,
                         scale_pass))


@register_criterion("prunecomp", paper="Prune&Comp (arXiv 2507.18212)", needs="forward", cost=COST, memory=prunecomp_bytes,
                    label="iterative BI on the magnitude-compensated model")
def select_prunecomp(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """n rounds: remove the lowest-BI block of the current model, compensate its magnitude, rescore."""
    earlier = scoring.shared.get("prunecomp")
    if earlier is not None and len(earlier[0]) >= request.n:  # a deeper run on the same batches: its first rounds
        rounds, first_scores, scoring.work = earlier
        rounds = rounds[:request.n]
    else:
        rounds, first_scores = iterate(scoring, request)
        scoring.shared["prunecomp"] = (rounds, first_scores, scoring.work)
    removed = [r["removed"] for r in rounds]
    scoring.details["prunecomp"] = {"order": removed, "rounds": rounds, "form": FORM}
    return PruningPlan(request.num_layers, tuple(removed), "prunecomp", first_scores,
                       "Block Influence 1 − mean cos(h_i, h_i+1) on the dense model (round 1; later rounds rescore "
                       "the compensated model), per block")
