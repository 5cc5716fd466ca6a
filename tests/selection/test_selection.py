"""Selection criteria against an independent computation of the cosines."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import TINY_FAMILIES, TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.calibration.collect import make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.selection.choose import select_blocks
from ghosted_core.selection.criteria import CRITERIA, SelectionRequest, check_request, parse_layers
from ghosted_core.selection.similarity import measure_similarity


def residuals(model, ids: torch.Tensor) -> list[np.ndarray]:
    """h_0 … h_L as (B, T, C) arrays."""
    with capture(model, range(TINY_LAYERS + 1)) as seen:
        run_forward(model, ids)
    return [seen[("residual", j)].double().numpy() for j in range(TINY_LAYERS + 1)]


def per_token_cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def setup(tiny_llama):
    ids = random_tokens(6, 10, seed=2)
    return tiny_llama, ids, make_batches(ids, None, 4), residuals(tiny_llama, ids)


def test_streamline_is_argmax_of_per_token_cosine(setup):
    model, _ids, batches, h = setup
    n = 2
    expected = [per_token_cos(h[s], h[s + n]).mean() for s in range(TINY_LAYERS - n + 1)]
    plan, sim = select_blocks(model, "streamline", SelectionRequest(TINY_LAYERS, n), batches, quiet=True)
    np.testing.assert_allclose(sim.run_cosine, expected, rtol=1e-5)
    start = int(np.argmax(expected))
    assert plan.removed == (start, start + 1) and plan.scores == sim.run_cosine


def test_shortgpt_removes_lowest_block_influence(setup):
    model, _ids, batches, h = setup
    influence = [1 - per_token_cos(h[i], h[i + 1]).mean() for i in range(TINY_LAYERS)]
    plan, _ = select_blocks(model, "shortgpt", SelectionRequest(TINY_LAYERS, 3), batches, quiet=True)
    np.testing.assert_allclose(plan.scores, influence, rtol=1e-5, atol=1e-7)
    assert set(plan.removed) == set(np.argsort(influence)[:3].tolist())


def test_angular_uses_the_last_token(setup):
    model, _ids, batches, h = setup
    n = 2
    expected = [np.mean(np.arccos(np.clip(per_token_cos(h[s][:, -1], h[s + n][:, -1]), -1, 1)) / math.pi)
                for s in range(TINY_LAYERS - n + 1)]
    plan, sim = select_blocks(model, "angular", SelectionRequest(TINY_LAYERS, n), batches, quiet=True)
    np.testing.assert_allclose(sim.run_angular, expected, rtol=1e-4, atol=1e-6)
    assert plan.removed[0] == int(np.argmin(expected))


def test_token_axis_variant_matches_torch_default_dim(setup):
    model, _ids, batches, h = setup
    n = 2
    expected = [torch.nn.functional.cosine_similarity(torch.from_numpy(h[s]), torch.from_numpy(h[s + n])).mean().item()
                for s in range(TINY_LAYERS - n + 1)]  # dim=1: the token axis of [B, T, C]
    plan, sim = select_blocks(model, "streamline", SelectionRequest(TINY_LAYERS, n, cosine="token-axis"), batches,
                              quiet=True)
    np.testing.assert_allclose(sim.run_cosine, expected, rtol=1e-4)
    assert 1 <= plan.removed[0] and plan.removed[-1] < TINY_LAYERS - 1  # the repos never touch the ends
    assert "reference-repo variant" in plan.score_label


def test_manual_and_none():
    plan = CRITERIA["manual"].select(SelectionRequest(TINY_LAYERS, 0, (4, 1, 2)), None)
    assert plan.removed == (1, 2, 4) and len(plan.boundaries) == 2
    assert CRITERIA["none"].select(SelectionRequest(TINY_LAYERS, 0), None).removed == ()


@pytest.mark.parametrize("criterion, request_, message", [
    ("streamline", SelectionRequest(6, 6), "leaves none"),
    ("shortgpt", SelectionRequest(6, 0), "at least 1"),
    ("manual", SelectionRequest(6, 0, (2, 9)), "out of range"),
    ("manual", SelectionRequest(6, 0, ()), "needs the blocks"),
    ("manual", SelectionRequest(6, 0, tuple(range(6))), "leaves none"),
    ("bogus", SelectionRequest(6, 1), "known: streamline"),
])
def test_bad_requests_are_refused(criterion, request_, message):
    with pytest.raises(GhostedError, match=message):
        check_request(criterion, request_)
        CRITERIA[criterion].select(request_, None)


def test_parse_layers():
    assert parse_layers("20, 21,25-27") == (20, 21, 25, 26, 27)
    assert parse_layers("") == ()
    with pytest.raises(GhostedError):
        parse_layers("a-b")


def test_similarity_pass_keeps_a_bounded_window(setup):
    model, _ids, batches, _h = setup
    sim = measure_similarity(model, 3, batches, quiet=True)
    assert len(sim.run_cosine) == TINY_LAYERS - 2 and len(sim.block_cosine) == TINY_LAYERS and sim.tokens == 60


FORWARD_CRITERIA = [name for name, spec in CRITERIA.items() if spec.needs != "nothing"]


@pytest.mark.parametrize("criterion", FORWARD_CRITERIA)
def test_every_criterion_leaves_the_blocks_that_must_stay(setup, criterion):
    """A block in the request's `keep` (a family's rule, as Gemma 4's last block) is never removed: asked to keep the
    block it chose first, each criterion chooses others."""
    model, _ids, batches, _h = setup
    chosen = select_blocks(model, criterion, SelectionRequest(TINY_LAYERS, 2), batches, quiet=True)[0].removed
    kept = chosen[0]
    plan = select_blocks(model, criterion, SelectionRequest(TINY_LAYERS, 2, keep=(kept,)), batches, quiet=True)[0]
    assert kept not in plan.removed and len(plan.removed) == 2, (criterion, chosen, plan.removed)


def test_a_gemma4_cut_keeps_its_last_block():
    """Gemma 4's last block must stay (transformers makes it full attention on load): every criterion is told so by
    the model itself, and a manual cut of it is refused with the reason, before the surgery."""
    model = make_tiny_model("gemma4_text")
    batches = make_batches(random_tokens(4, 10, seed=3), None, 4)
    for criterion in ("shortgpt", "sleb", "weights"):
        plan, _ = select_blocks(model, criterion, SelectionRequest(TINY_LAYERS, TINY_LAYERS - 1), batches, quiet=True)
        assert sorted(plan.removed) == list(range(TINY_LAYERS - 1)), criterion  # all but the last
    with pytest.raises(GhostedError, match="must stay"):
        select_blocks(model, "manual", SelectionRequest(TINY_LAYERS, 1, (TINY_LAYERS - 1,)), batches)


# (family, criterion) pairs refused with a reason; every other pair must choose
REFUSED = {
    ("olmo2", "prunecomp"): "OLMo-2's blocks read the stream without",  # no pre-norm: a scale is not absorbed
    ("olmo3", "prunecomp"): "OLMo-3's blocks read the stream without",
    ("gemma4_e2b", "prunecomp"): "gate their per-layer embeddings",  # the gate reads the raw stream
    ("lfm2", "sleb"): "removes every attention block",  # its greedy takes both attention blocks of six
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_criterion_chooses_on_every_family_or_refuses_in_one_line(family):
    """Every criterion on every family's tiny model chooses two blocks the family may lose, or is refused with a
    one-line reason (`REFUSED`): never another exception, never a silent refusal of a pair that should run."""
    from ghosted_core.model.layer_config import required_blocks

    model = make_tiny_model(family)
    batches = make_batches(random_tokens(4, 16, seed=3), None, 2)
    required = required_blocks(model.config)
    for criterion in [name for name in CRITERIA if name != "none"]:  # ("none": the dense model, nothing chosen)
        request = SelectionRequest(TINY_LAYERS, 1 if criterion == "manual" else 2, (1,) if criterion == "manual" else ())
        request = dataclasses.replace(request, keep=required)
        expected = REFUSED.get((family, criterion))
        try:
            plan = select_blocks(model, criterion, request, batches, quiet=True)[0]
        except GhostedError as refused:
            assert expected is not None and expected in str(refused), (family, criterion, str(refused))
            assert "\n" not in str(refused)
            continue
        assert expected is None, (family, criterion, "chose where a refusal was expected")
        assert len(plan.removed) == request.n and not set(plan.removed) & set(required), (family, criterion, plan)
