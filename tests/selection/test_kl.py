"""kl against KL computed from the full logits of the dense model and of each hand-pruned model."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import make_batches
from ghosted_core.model.surgery import build_variant
from ghosted_core.selection.criteria import CRITERIA, Scoring, SelectionRequest
from ghosted_core.selection.kl import run_kl


def full_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), dim=-1)  # (B, T, V)


def mean_kl(dense, removed, ids) -> float:
    """Mean over every position of KL(p_dense ‖ p_pruned), from full forwards."""
    logp, logq = full_logprobs(dense, ids), full_logprobs(build_variant(dense, removed), ids)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


# gemma4_e2b: per-layer inputs of the tokens, and keys and values stored by blocks 2 and 3 for the last two (so
# runs over 2, 3 or 5 are not scored: those blocks must stay)
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4_e2b"])
@pytest.mark.parametrize("n", [1, 2])
def test_kl_equals_kl_from_full_logits(family, n):
    from ghosted_core.model.layer_config import required_blocks

    model = make_tiny_model(family).double()
    ids = random_tokens(4, 16, seed=3)
    scoring = Scoring(model, make_batches(ids, None, 3))  # batches of 3 and 1: sums must add up across batches
    required = set(required_blocks(model.config))
    expected = [None if set(range(s, s + n)) & required else mean_kl(model, range(s, s + n), ids)
                for s in range(TINY_LAYERS - n + 1)]
    found = run_kl(scoring, n)
    assert [x is None for x in found] == [x is None for x in expected]
    assert [x for x in found if x is not None] == pytest.approx([x for x in expected if x is not None], rel=1e-9,
                                                               abs=1e-12)
    keep = tuple(sorted(required))
    plan = CRITERIA["kl"].select(SelectionRequest(TINY_LAYERS, n, keep=keep), Scoring(model, make_batches(ids, None, 3)))
    start = min((s for s in range(len(expected)) if expected[s] is not None), key=lambda s: (expected[s], s))
    assert plan.removed == tuple(range(start, start + n)) and "per run start" in plan.score_label
