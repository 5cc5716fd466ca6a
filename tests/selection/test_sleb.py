"""sleb's greedy against brute force over the same NLLs, computed with full forwards of hand-pruned models."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.model.surgery import build_variant
from ghosted_core.selection import sleb
from ghosted_core.selection.criteria import CRITERIA, Scoring, SelectionRequest
from ghosted_core.selection.suffixes import Work

ROUNDS = 4


class BruteForce:
    """Summed NLL of the calibration targets for any removed set: a full forward of the pruned model, float64."""

    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids, self.table = model, ids, {}

    def __call__(self, removed) -> float:
        key = tuple(sorted(removed))
        if key not in self.table:
            with torch.no_grad():
                logits = build_variant(self.model, key)(self.ids).logits.double()  # (B, T, V)
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            self.table[key] = float(-logp.gather(-1, self.ids[:, 1:, None]).sum())
        return self.table[key]

    def greedy(self, rounds: int, keep=()) -> list[int]:
        """Replay SLEB's rule on the table: lowest NLL each round, ties to the lowest block (never one in `keep`)."""
        removed: list[int] = []
        for _ in range(rounds):
            alive = [j for j in range(TINY_LAYERS) if j not in removed and j not in keep]
            removed.append(min(alive, key=lambda j: (self([*removed, j]), j)))
        return removed


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    model = make_tiny_model(request.param).double()  # float64: the cached and full paths agree to rounding
    ids = random_tokens(4, 16, seed=1)
    return model, make_batches(ids, None, 2), BruteForce(model, ids)


def test_sleb_greedy_equals_brute_force_over_the_same_nlls(setup):
    model, batches, brute = setup
    result = sleb.sleb_order(model, ROUNDS, batches)
    assert list(result.order) == brute.greedy(ROUNDS)
    for k, rnd in enumerate(result.rounds):
        removed = list(result.order[:k])
        for j in range(TINY_LAYERS):
            if rnd.nll[j] is not None:  # exact where it was computed ...
                assert rnd.nll[j] == pytest.approx(brute([*removed, j]), rel=1e-10)
            if rnd.bound[j] is not None:  # ... and a true lower bound everywhere
                assert rnd.bound[j] <= brute([*removed, j]) * (1 + 1e-12)
        assert rnd.nll[rnd.removed] is not None


def test_without_kept_states_or_bounds_the_choice_is_the_same(setup, monkeypatch):
    model, batches, brute = setup
    monkeypatch.setattr(sleb, "FINALS_BUDGET", 0)  # every candidate gets its exact head
    work = Work()
    result = sleb.sleb_order(model, ROUNDS, batches, work, memo_budget=0)  # only each round's own cache
    assert list(result.order) == brute.greedy(ROUNDS)
    assert all(x is not None for j, x in enumerate(result.rounds[0].nll))
    assert work.passes == len(batches)  # the embedding ran once per batch, for all rounds


def test_prefix_sharing_runs_fewer_blocks_than_naive(setup):
    model, batches, _ = setup
    work = Work()
    sleb.sleb_order(model, ROUNDS, batches, work)
    windows = sum(len(b.input_ids) for b in batches)
    naive = sum((TINY_LAYERS - r) * (TINY_LAYERS - r - 1) for r in range(ROUNDS)) * windows  # one full pass each
    assert work.block_runs < 0.6 * naive


def test_the_criterion_reports_its_order_rounds_and_scores(setup):
    model, batches, brute = setup
    scoring = Scoring(model, batches)
    plan = CRITERIA["sleb"].select(SelectionRequest(TINY_LAYERS, 2), scoring)
    assert set(plan.removed) == set(brute.greedy(2)) and len(plan.scores) == TINY_LAYERS
    assert scoring.details["sleb"]["order"] == brute.greedy(2) and "reference code" in scoring.details["sleb"]["reference_note"]
    tokens = scoring.details["sleb"]["tokens"]
    assert tokens == 4 * 15
    first = min(range(TINY_LAYERS), key=lambda j: (brute([j]), j))
    assert plan.scores[first] == pytest.approx(brute([first]) / tokens)


def test_sleb_refuses_depths_that_leave_nothing(setup):
    model, batches, _ = setup
    with pytest.raises(GhostedError, match="removes 1 to 5"):
        sleb.sleb_order(model, TINY_LAYERS, batches)


@pytest.mark.parametrize("memo_budget", [sleb.MEMO_BUDGET, 0])
def test_sleb_on_gemma4_e2b_carries_per_layer_inputs_and_shared_keys_and_values(memo_budget):
    """Gemma 4 E2B's blocks read per-layer inputs of the tokens, and its last two attend with the keys and values
    blocks 2 and 3 store on the same pass: run block by block from cached states (kept ones and recomputed ones),
    every candidate's NLL equals the full forward of the hand-pruned model, and the greedy never removes a store
    or the last block (required: the family's rule)."""
    from ghosted_core.model.layer_config import required_blocks

    model = make_tiny_model("gemma4_e2b").double()
    ids = random_tokens(4, 16, seed=1)
    brute = BruteForce(model, ids)
    keep = required_blocks(model.config)
    assert keep == (2, 3, 5)
    result = sleb.sleb_order(model, 3, make_batches(ids, None, 2), memo_budget=memo_budget)
    assert list(result.order) == brute.greedy(3, keep)
    for k, rnd in enumerate(result.rounds):
        assert all(rnd.nll[j] is None for j in keep)
        for j in range(TINY_LAYERS):
            if rnd.nll[j] is not None:
                assert rnd.nll[j] == pytest.approx(brute([*result.order[:k], j]), rel=1e-10)


def test_screening_keeps_the_minimum_and_skips_only_candidates_that_cannot_win():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        exact = (torch.rand(12, generator=generator) * 10).round(decimals=1).tolist()  # ties happen
        bounds = [x - float(torch.rand(1, generator=generator)) * 3 for x in exact]
        asked = []
        found = sleb.screened(bounds, lambda p: asked.append(p) or exact[p])
        best = min(range(12), key=lambda p: (exact[p], p))
        assert min((p for p in range(12) if found[p] is not None), key=lambda p: (found[p], p)) == best
        skipped = [p for p in range(12) if found[p] is None]
        assert all(bounds[p] > exact[best] for p in skipped) and sorted(asked) == [p for p in range(12) if p not in skipped]


def test_screening_skips_heads_on_a_real_vocabulary_subset_and_still_equals_brute_force(monkeypatch):
    model = make_tiny_model("gemma3").double()
    ids = random_tokens(4, 16, seed=1)
    monkeypatch.setattr(sleb, "SUBSET_TOP", 1)  # a subset smaller than the vocabulary: bounds below the NLLs
    result = sleb.sleb_order(model, ROUNDS, make_batches(ids, None, 2))
    brute = BruteForce(model, ids)
    assert list(result.order) == brute.greedy(ROUNDS)
    assert any(x is None for x in result.rounds[0].nll)  # some full heads were skipped
    assert any(b < brute([j]) * (1 - 1e-6) for j, b in enumerate(result.rounds[0].bound))  # strict bounds
