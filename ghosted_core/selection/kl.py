"""`kl`: output-grounded removal. The run of n blocks whose removal moves the next-token distribution least.

For every run start s, the mean over calibration positions of KL(p_dense ‖ p_pruned) with
blocks s … s+n−1 removed, and the run with the smallest one. It is the quantity the cosine
criteria (streamline, angular) stand in for: they compare the residual entering and leaving
the run, this compares what the model then predicts.

Cost per calibration window: one dense pass that keeps the residual entering every block
(memory: L+1 states of B × T × C per batch), then each candidate runs only the blocks after its
run from the cached h_s, all candidates batched slot by slot: (L−n+1)(L−n)/2 block runs and
L−n+2 heads, against L−n+1 full passes naively. Memory: the candidates' states (under
`suffixes.STATE_BUDGET`) and one chunk of logits (three copies, under `memory_parts.LOGITS_BUDGET`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ghosted_core.model.layer_config import required_blocks
from ghosted_core.plan import PruningPlan
from ghosted_core.progress import Tracker
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes, candidate_group, group_size, logits_chunk
from ghosted_core.selection.next_token import count_targets, kl_sums
from ghosted_core.selection.suffixes import CandidateRunner, chunks

COST = ("one dense pass per window, then every run start's suffix from the cached state: (L−n+1)(L−n)/2 block runs "
        "and L−n+2 heads per window (naive: L−n+1 full passes); memory: L+1 residual states per batch")


def mean_kl(scoring: Scoring, runner: CandidateRunner, variants: Sequence[tuple[int, tuple]],
            what: str = "score kl", unit: str = "candidates") -> list[float]:
    """Per variant (entry slot, steps from it): mean KL(p_dense ‖ p_variant) per calibration position, each variant
    run from the dense state entering its entry slot (one dense pass per batch keeps them all). Progress: one step
    per variant and batch, reported as `what`."""
    num_layers = len(runner.blocks)
    totals = [0.0] * len(variants)
    positions = 0
    batches = scoring.fit_batches
    progress = Tracker(what, len(variants) * len(batches), unit, scoring.quiet)
    for batch in batches:
        entries = runner.dense_states(batch.input_ids, batch.attention_mask)  # h_0 … h_L (and the KV stored)
        candidates = [dataclasses.replace(entries[entry], steps=steps) for entry, steps in variants]
        sums: list[float] = []
        for group in chunks(candidates):
            finals = runner.run(group, batch.attention_mask, input_ids=batch.input_ids)
            sums += kl_sums(scoring.model, finals, entries[num_layers].state, batch.attention_mask, scoring.work)
            progress.advance(len(group))
        totals = [t + x for t, x in zip(totals, sums)]
        positions += count_targets(batch.input_ids, batch.attention_mask, targets=False)
    return [t / max(positions, 1) for t in totals]


def run_kl(scoring: Scoring, n: int, keep: Sequence[int] = ()) -> list[float | None]:
    """Mean KL(p_dense ‖ p_without s…s+n−1) per position, for s = 0 … L−n; None for a run that would remove a
    block in `keep` or one the family requires (not run: Gemma 4 E2B's later blocks cannot run without the keys
    and values such a block stores)."""
    runner = CandidateRunner(scoring.model, scoring.work)
    num_layers = len(runner.blocks)
    keep = set(keep) | set(required_blocks(scoring.model.config))
    starts = [s for s in range(num_layers - n + 1) if not set(range(s, s + n)) & keep]
    found = mean_kl(scoring, runner, [(s, tuple((j, runner.blocks[j]) for j in range(s + n, num_layers)))
                                      for s in starts], "score kl", "run starts")
    scores: list[float | None] = [None] * (num_layers - n + 1)
    for s, value in zip(starts, found):
        scores[s] = value
    return scores


def dense_states_bytes(shapes: ScoreShapes, candidates: int, tallest: int | None = None) -> int:
    """`mean_kl` at its peak: the dense pass's L+1 states of one batch, and then either one group of `candidates`
    running (at most `tallest` of them through one module together; all when None), or its final states, the rows
    of one chunk gathered for the head and the KL's logits chunk (the reference's log-probabilities and
    probabilities, a candidate's, their difference and its product), which come one after the other."""
    heads = (group_size(shapes, candidates) + 1) * shapes.state() + logits_chunk(shapes, 3, 5)
    return (shapes.layers + 1) * shapes.state() + max(candidate_group(shapes, candidates, tallest), heads)


def kl_bytes(shapes: ScoreShapes) -> Footprint:
    """kl: `dense_states_bytes` with the L−n+1 run starts as candidates."""
    return Footprint(dense_states_bytes(shapes, shapes.layers - shapes.n + 1))


@register_criterion("kl", memory=kl_bytes, paper="output-grounded removal (the measure the cosine criteria approximate)", needs="forward",
                    contiguous=True, cost=COST, label="KL to the dense next-token distribution")
def select_kl(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The run start s with the lowest mean KL(p_dense ‖ p_pruned); ties to the lowest s."""
    scores = run_kl(scoring, request.n, request.keep)
    start = min(filter(request.run_removable, range(len(scores))), key=lambda s: (scores[s], s))
    return PruningPlan(request.num_layers, tuple(range(start, start + request.n)), "kl", tuple(scores),
                       f"mean KL(p_dense ‖ p_pruned) per token with blocks s…s+{request.n - 1} removed, per run start s")
