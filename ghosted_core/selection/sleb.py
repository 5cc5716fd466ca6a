"""SLEB (Song et al. 2024): greedy block removal by calibration NLL, computed exactly with far fewer FLOPs.

The paper's rule: n rounds; each round removes the block whose removal (on top of the blocks
already removed) gives the lowest NLL summed over the calibration tokens, then rescores every
remaining block from scratch. Ties go to the lowest block. Every remaining block is a
candidate, as in the paper's algorithm; the reference code (jiwonsong-dev/SLEB) never removes
the first or the last block (its barriers of 1): `REFERENCE_NOTE` says so wherever sleb is named.

Naively a round is one full forward per candidate, Σ_r (L − r) passes for n rounds. Three exact
savings, none of which changes a number the choice rests on:

1. Shared prefixes (`_Memo`): a residual state depends only on the blocks run to reach it, so
   states are kept by that block sequence, per calibration batch, on the model's device. The
   candidate that skips block q starts from the current model's input of q; in the next round,
   a candidate that skipped q < p* (p* the block just removed) resumes from its own state
   entering p*, and one that skips q > p* from the winner's state entering q. Only blocks no
   earlier candidate ran with the same inputs are run, all candidates batched slot by slot.
2. The head only where it can matter: for a vocabulary subset S holding every target (the
   targets and the current model's top tokens), logsumexp over S bounds the NLL from below at
   |S|/V of the head's cost. Candidates are then evaluated exactly in the order of their bounds,
   until the next bound exceeds the best exact NLL so far: no skipped candidate can win.
3. The head as logsumexp minus the target logit, in token chunks (no V-wide log-softmax copy).

Memory (`sleb_bytes` declares it): every batch's embedding; the kept states, the current model's
first, at most `memo_budget` bytes (`MEMO_BUDGET` by default): what the budget cannot hold is
recomputed from the longest kept prefix, down to the embedding, never kept anyway; every
candidate's final state for the bounds (L_r × calibration tokens × C, under `FINALS_BUDGET`; above
it the exact head runs for every candidate and no bound is used); one chunk of candidates run
together (under `suffixes.STATE_BUDGET`) and one chunk of logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ghosted_core.progress import track
from ghosted_core.calibration.collect import CalibrationBatch
from ghosted_core.errors import GhostedError
from ghosted_core.model.layer_config import required_blocks
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes, candidate_group, group_size, logits_chunk
from ghosted_core.selection.next_token import count_targets, nll_sums, vocabulary_subset
from ghosted_core.selection.suffixes import Candidate, CandidateRunner, Work, carried_bytes, chunks

log = logging.getLogger(__name__)

REFERENCE_NOTE = "every block is a candidate (paper); the reference code never removes the first or last block"
MEMO_BUDGET = 2**30  # bytes of residual states kept for later candidates and rounds
FINALS_BUDGET = 2**29  # bytes of candidates' final states kept for the lower-bound screening
SUBSET_TOP = 32  # per position, the current model's top tokens added to the screening subset
BOUND_MARGIN = 1e-5  # relative: a bound must exceed the best NLL by this much to skip a candidate


@dataclass(frozen=True)
class SlebRound:
    """One round: per dense block, the summed NLL with it also removed (None: not evaluated exactly, or gone)."""

    removed: int
    nll: tuple[float | None, ...]  # exact sums
    bound: tuple[float | None, ...]  # lower bounds (None when no screening ran)


@dataclass(frozen=True)
class SlebResult:
    """The greedy's removal order and what each round measured."""

    order: tuple[int, ...]  # blocks in the order the rounds removed them
    rounds: tuple[SlebRound, ...]
    tokens: int  # NLL targets per round


def _steps(runner: CandidateRunner, slots: Sequence[int]) -> tuple:
    return tuple((j, runner.blocks[j]) for j in slots)


class _Memo:
    """Residual states by the block sequence run to reach them, one table per calibration batch, each with the
    keys and values its KV-storing blocks computed (`Candidate.shared`; empty for most families)."""

    def __init__(self, budget: int):
        self.tables: list[dict[tuple[int, ...], tuple[torch.Tensor, dict]]] = []
        self.budget, self.bytes = budget, 0

    def longest(self, b: int, sequence: Sequence[int], runner: CandidateRunner) -> Candidate:
        """The candidate running `sequence` from its longest stored prefix sequence[:m]."""
        table = self.tables[b]
        for m in range(len(sequence), -1, -1):
            kept = table.get(tuple(sequence[:m]))
            if kept is not None:
                return Candidate(kept[0], _steps(runner, sequence[m:]), tuple(sequence[:m]), kept[1])
        raise KeyError("the embedding of every batch is stored first")

    def storer(self, b: int):
        """A `Store` that keeps a state while the budget holds it (the rest is recomputed when needed)."""
        def store(prefix: tuple[int, ...], state: torch.Tensor, shared: dict) -> None:
            size = carried_bytes(state, shared)
            if self.bytes + size <= self.budget:
                self.tables[b][prefix] = (state, shared)
                self.bytes += size
        return store

    def keep_for(self, alive: Sequence[int]) -> None:
        """Drop what no candidate of the next round (alive minus one block) can resume from; copy the rest out of
        the batched tensors they are views of, so those can be freed."""
        alive = tuple(alive)

        def useful(key: tuple[int, ...]) -> bool:
            i = 0
            while i < min(len(key), len(alive)) and key[i] == alive[i]:
                i += 1
            return i == len(key) or key[i:] == alive[i + 1:len(key) + 1]

        self.bytes = 0
        for table in self.tables:
            for key in [k for k in table if not useful(k)]:
                del table[key]
            for key, (state, shared) in table.items():
                table[key] = state.clone(), {kind: (k.clone(), v.clone()) for kind, (k, v) in shared.items()}
                self.bytes += carried_bytes(*table[key])


def screened(bounds: Sequence[float], exact: Callable[[int], float]) -> list[float | None]:
    """Exact values (`exact(p)`) of the candidates that can still be the minimum, None for the others.

    Candidates go in ascending order of their lower bounds; once a bound exceeds the best exact value
    so far (by more than rounding), neither it nor any later candidate can be the minimum.
    """
    result: list[float | None] = [None] * len(bounds)
    best = math.inf
    for p in sorted(range(len(bounds)), key=lambda p: (bounds[p], p)):
        if bounds[p] > best + BOUND_MARGIN * abs(best):
            break
        result[p] = exact(p)
        best = min(best, result[p])
    return result


def _round(runner: CandidateRunner, model: PreTrainedModel, memo: _Memo, alive: Sequence[int],
           batches: Sequence[CalibrationBatch], keep: Sequence[int] = ()) -> tuple[list[float | None], list[float | None]]:
    """Exact NLL sums (None where the bound ruled a candidate out, or it is in `keep`: never removed, never run)
    and the bounds (None for those in `keep`), per candidate in `alive` order."""
    scored = [p for p, q in enumerate(alive) if q not in keep]
    exact, bounds = _round_of(runner, model, memo, alive, batches, [alive[p] for p in scored])
    full_exact: list[float | None] = [None] * len(alive)
    full_bounds: list[float | None] = [None] * len(alive)
    for p, x, bound in zip(scored, exact, bounds):
        full_exact[p], full_bounds[p] = x, bound
    return full_exact, full_bounds


def _round_of(runner: CandidateRunner, model: PreTrainedModel, memo: _Memo, alive: Sequence[int],
              batches: Sequence[CalibrationBatch], removable: Sequence[int]) -> tuple[list, list]:
    """`_round` over the candidates removing one block of `removable` each, in that order."""
    first = memo.tables[0][()][0]  # (B, T, C): the width and dtype of every state
    tokens = sum(batch.input_ids.numel() for batch in batches)
    screen = len(removable) * tokens * first.shape[-1] * first.element_size() <= FINALS_BUDGET
    finals: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    exact: list[float] = [0.0] * len(removable)
    for b, batch in enumerate(batches):
        # the current model: its states kept first, under the budget
        current.append(runner.run([memo.longest(b, alive, runner)], batch.attention_mask, memo.storer(b),
                                  batch.input_ids)[0])
        candidates = [memo.longest(b, [j for j in alive if j != q], runner) for q in removable]
        batch_finals: list[torch.Tensor] = []
        for group in chunks(candidates):
            batch_finals += runner.run(group, batch.attention_mask, memo.storer(b), batch.input_ids)
        if screen:
            finals.append(batch_finals)
        else:  # too big to keep for the bounds: every candidate gets its exact head now
            sums = nll_sums(model, batch_finals, batch.input_ids, batch.attention_mask, work=runner.work)
            exact = [e + s for e, s in zip(exact, sums)]
    if not screen:
        return list(exact), [None] * len(removable)
    subset = vocabulary_subset(model, current, [b.input_ids for b in batches], SUBSET_TOP, runner.work)
    bounds = [0.0] * len(removable)
    for batch, batch_finals in zip(batches, finals):
        sums = nll_sums(model, batch_finals, batch.input_ids, batch.attention_mask, subset, runner.work)
        bounds = [x + s for x, s in zip(bounds, sums)]
    def exact_sum(p: int) -> float:
        return sum(nll_sums(model, [f[p]], batch.input_ids, batch.attention_mask, work=runner.work)[0]
                   for batch, f in zip(batches, finals))

    return screened(bounds, exact_sum), bounds


def sleb_order(model: PreTrainedModel, n: int, batches: Sequence[CalibrationBatch], work: Work | None = None,
               quiet: bool = True, memo_budget: int = MEMO_BUDGET, keep: Sequence[int] = ()) -> SlebResult:
    """n greedy rounds of SLEB on the calibration batches (held-out ones skipped); blocks in `keep` stay, and so do
    those the family requires (`layer_config.required_blocks`: without them the other blocks cannot run)."""
    keep = tuple(sorted(set(keep) | set(required_blocks(model.config))))
    runner = CandidateRunner(model, work or Work())
    num_layers = len(runner.blocks)
    if not 1 <= n < num_layers:
        raise GhostedError(f"sleb removes 1 to {num_layers - 1} blocks (got {n})")
    fit = [b for b in batches if not b.heldout]
    if not fit:
        raise GhostedError("sleb needs calibration text: no calibration batch was given")
    memo = _Memo(memo_budget)
    for batch in fit:
        memo.tables.append({(): (runner.embed(batch.input_ids), {})})
    tokens = sum(count_targets(b.input_ids, b.attention_mask) for b in fit)
    removed: list[int] = []
    rounds = []
    for _ in track(range(n), "score sleb", unit="rounds", quiet=quiet):
        alive = [j for j in range(num_layers) if j not in removed]
        exact, bounds = _round(runner, model, memo, alive, fit, keep)
        best = min((p for p in range(len(alive)) if exact[p] is not None), key=lambda p: (exact[p], p))  # kept: None
        nll: list[float | None] = [None] * num_layers
        bound: list[float | None] = [None] * num_layers
        for p, j in enumerate(alive):
            nll[j], bound[j] = exact[p], bounds[p]
        removed.append(alive[best])
        rounds.append(SlebRound(alive[best], tuple(nll), tuple(bound)))
        memo.keep_for([j for j in alive if j != alive[best]])
        log.info("sleb round %d removes block %d (mean NLL %.4f)", len(removed), alive[best], exact[best] / tokens)
    return SlebResult(tuple(removed), tuple(rounds), tokens)


COST = ("n rounds; per window and round one pass of the current model's missing states, the candidates' unshared "
        "blocks (round 1: L(L−1)/2) and ~L_r·|S|/V heads plus a full head per candidate the bound cannot rule out "
        "(naive: L_r full passes per round); memory: kept states ≤ 1 GiB + L_r final states per calibration token")


def sleb_bytes(shapes: ScoreShapes) -> Footprint:
    """sleb at its peak (round 1, the largest): every batch's embedding; the kept states under the budget, no more
    than round 1 can store (the current model's L and the candidates' L(L−1)/2 per batch, finals among them); the
    final states the memo could not keep, when the bounds screen; then either one group of candidates running, or
    the logits of one chunk (the head's output and logsumexp's copies) and the vocabulary subset's head rows."""
    s = shapes
    budget = MEMO_BUDGET if s.memo_budget is None else s.memo_budget
    layers, everything = s.layers, s.state(s.tokens)
    storable = everything * (layers + layers * (layers - 1) // 2)
    kept = min(budget, storable)
    screen = layers * everything <= FINALS_BUDGET
    finals = (layers + 1 + group_size(s, layers - 1)) * everything if screen and kept < storable else 0
    subset = min(s.vocab, s.tokens * (SUBSET_TOP + 1)) * s.width * s.item if screen else 0
    heads = logits_chunk(s, 2, 3) + subset
    total = everything + kept + finals + max(candidate_group(s, layers - 1), heads)
    note = "" if storable <= budget else (f"sleb keeps {budget / 2**20:.0f} MiB of states; the rest is recomputed "
                                          "from the longest kept prefix")
    return Footprint(total, note)


@register_criterion("sleb", paper="SLEB (Song et al. 2024)", needs="forward", cost=COST, memory=sleb_bytes,
                    label="greedy by calibration NLL, every block a candidate")
def select_sleb(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """n greedy rounds, each removing the block whose removal gives the lowest calibration NLL."""
    earlier = scoring.shared.get("sleb")
    if earlier is not None and len(earlier[0].order) >= request.n:  # a deeper run on the same batches: its first rounds
        full, scoring.work = earlier
        result = SlebResult(full.order[:request.n], full.rounds[:request.n], full.tokens)
    else:
        budget = MEMO_BUDGET if scoring.memo_budget is None else scoring.memo_budget
        result = sleb_order(scoring.model, request.n, scoring.batches, scoring.work, scoring.quiet, budget,
                            request.keep)
        scoring.shared["sleb"] = (result, scoring.work)
    first = result.rounds[0]
    scores = tuple(None if x is None and b is None else (x if x is not None else b) / result.tokens
                   for x, b in zip(first.nll, first.bound))  # None: a block the family keeps (not run)
    scoring.details["sleb"] = {
        "order": list(result.order), "tokens": result.tokens, "reference_note": REFERENCE_NOTE,
        "rounds": [{"removed": r.removed, "nll": [None if x is None else x / result.tokens for x in r.nll],
                    "bound": [None if x is None else x / result.tokens for x in r.bound]} for r in result.rounds],
    }
    return PruningPlan(request.num_layers, result.order, "sleb", scores,
                       "mean NLL per token with block i removed alone (round 1; a lower bound where the full head "
                       "was not needed), per block")
