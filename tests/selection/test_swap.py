"""swap_kl's probes against hand-built swapped models (weights copied with load_state_dict), and Table 14's rule."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.model.layer_config import required_blocks
from ghosted_core.selection.criteria import CRITERIA, Scoring, SelectionRequest
from ghosted_core.selection.swap import guided_removal, layer_scores, pairs, swap_distances


def swapped(model, moves: dict[int, int]):
    """A deep copy in which slot i holds block moves[i]'s weights (slot attributes, e.g. Gemma's sliding window, stay)."""
    copied = copy.deepcopy(model)
    for slot, source in moves.items():
        copied.model.layers[slot].load_state_dict(model.model.layers[source].state_dict())
    return copied


def mean_kl(dense, other, ids) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(dense(ids).logits.double(), -1)
        logq = torch.log_softmax(other(ids).logits.double(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: slots 0,1 sliding, 2 full: pairs of mixed kinds
def test_replacement_and_interchange_equal_hand_swapped_models(family):
    model = make_tiny_model(family).double()
    ids = random_tokens(3, 12, seed=4)
    found = swap_distances(Scoring(model, make_batches(ids, None, 2)))
    assert list(found["interchange"]) == pairs(TINY_LAYERS) and len(found["interchange"]) == 5 + 4 + 3
    for i, j in [(0, 1), (1, 2), (2, 5), (3, 4)] if family == "gemma3" else [(0, 1), (2, 4), (1, 4)]:
        forward = mean_kl(model, swapped(model, {i: j}), ids)
        backward = mean_kl(model, swapped(model, {j: i}), ids)
        assert found["directions"][i, j] == pytest.approx((forward, backward), rel=1e-9)
        assert found["replacement"][i, j] == pytest.approx(max(forward, backward), rel=1e-9)
        assert found["interchange"][i, j] == pytest.approx(mean_kl(model, swapped(model, {i: j, j: i}), ids), rel=1e-9)


# heterogeneous blocks: only pairs of the same modules and tensors exchange weights
MIXED = {
    # sliding blocks 0, 1, 3, 4 alike; full blocks 2 and 5 have wider heads and keys as values
    "gemma4_text": [(0, 1), (0, 3), (1, 3), (1, 4), (2, 5), (3, 4)],
    # linear attention on 0, 2, 4; full attention on 1 (a dense MLP: mlp_only_layers), 3 and 5 (experts)
    "qwen3_next": [(0, 2), (2, 4), (3, 5)],
    # sliding 0, 1, 2 (2 stores its keys and values), full 3 (stores); 4 (sliding) and 5 (full) reuse them, without
    # key and value projections and with a double-wide MLP; every block reads its per-layer inputs
    "gemma4_e2b": [(0, 1), (0, 2), (1, 2)],
}


@pytest.mark.parametrize("family", MIXED)
def test_only_blocks_of_one_layout_swap_and_they_equal_hand_swapped_models(family):
    """In a model whose blocks differ (attention kinds of other shapes, mixers, experts), the probes pair only
    blocks with the same modules and tensors, each pair's distances equal the hand-swapped model's (persistent
    buffers too: Gemma 4's per-block output scalar, set apart here), and a block with no partner gets no score and
    is taken last."""
    model = make_tiny_model(family).double()
    model.config._experts_implementation = "eager"  # the grouped-matmul kernel has no float64
    for j, block in enumerate(model.model.layers):
        if hasattr(block, "layer_scalar"):
            block.layer_scalar.fill_(1.0 + 0.1 * j)
    ids = random_tokens(3, 12, seed=4)
    found = swap_distances(Scoring(model, make_batches(ids, None, 2)))
    assert list(found["interchange"]) == MIXED[family]
    for i, j in MIXED[family][:3]:
        forward = mean_kl(model, swapped(model, {i: j}), ids)
        backward = mean_kl(model, swapped(model, {j: i}), ids)
        assert found["directions"][i, j] == pytest.approx((forward, backward), rel=1e-9)
        assert found["interchange"][i, j] == pytest.approx(mean_kl(model, swapped(model, {i: j, j: i}), ids), rel=1e-9)
    scoring = Scoring(model, make_batches(ids, None, 2))
    keep = required_blocks(model.config)  # Gemma 4: the last block; E2B: the stores too
    plan = CRITERIA["swap_kl"].select(SelectionRequest(TINY_LAYERS, 2, keep=keep), scoring)
    paired = {k for pair in MIXED[family] for k in pair}
    unpaired = [k for k in range(TINY_LAYERS) if k not in paired]
    assert scoring.details["swap_kl"]["unpaired"] == unpaired
    assert [k for k, score in enumerate(plan.scores) if score is None] == unpaired
    assert ("taken last" in plan.score_label) == bool(unpaired)
    best = min((k for k in paired if k not in keep), key=lambda k: (plan.scores[k], k))
    assert best in plan.removed and not set(plan.removed) & set(keep)


def test_guided_removal_takes_ascending_scores_and_no_neighbours():
    scores = [0.5, 0.1, 0.1, 0.3, 0.2, 0.9]
    assert guided_removal(scores, 2) == (1, 4)  # 2 ties with 1 but is adjacent; 4 next
    assert guided_removal([0.3, 0.2, 0.2, 0.9, 0.1, 0.8, 0.5], 3) == (4, 1, 6)  # 2 next to 1; 0 next to 1; 6 free
    assert layer_scores({(0, 1): 0.4, (1, 2): 0.2, (0, 2): 0.1}, 3) == [0.1, 0.2, 0.1]
    with pytest.raises(GhostedError, match="at most 2 of 6 blocks, not 3"):
        guided_removal(scores, 3)  # 1 and 4 taken, every other block is next to one of them


def test_both_probes_come_from_one_measurement():
    model = make_tiny_model("llama")
    scoring_shared: dict = {}
    batches = make_batches(random_tokens(2, 12, seed=5), None, 2)
    first = Scoring(model, batches, shared=scoring_shared)
    CRITERIA["swap_kl"].select(SelectionRequest(TINY_LAYERS, 2), first)
    runs = first.work.block_runs
    second = Scoring(model, batches, shared=scoring_shared)
    plan = CRITERIA["swap_kl_repl"].select(SelectionRequest(TINY_LAYERS, 2), second)
    assert second.work.block_runs == runs and second.details["swap_kl_repl"]["shared_with"] == "swap_kl"
    assert len(plan.removed) == 2 and abs(plan.removed[0] - plan.removed[1]) > 1
