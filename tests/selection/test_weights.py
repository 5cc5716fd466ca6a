"""weights: no forward pass at all, and the similarity and redundancy it reports computed independently with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_LAYERS, make_tiny_model
from ghosted_core.selection.choose import score_criteria
from ghosted_core.selection.criteria import CRITERIA, Scoring, SelectionRequest


def gram_cosines(matrices: list[np.ndarray]) -> np.ndarray:
    grams = [a @ a.T for a in matrices]
    return np.array([[np.sum(g * h) / (np.linalg.norm(g) * np.linalg.norm(h)) for h in grams] for g in grams])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_weights_runs_no_forward_pass_and_matches_numpy(family):
    model = make_tiny_model(family)
    calls = []
    handle = model.model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    try:
        scoring = Scoring(model, ())  # no calibration text at all
        plan = CRITERIA["weights"].select(SelectionRequest(TINY_LAYERS, 2), scoring)
        selections, sim = score_criteria(model, ["weights"], SelectionRequest(TINY_LAYERS, 2), [], with_map=False)
    finally:
        handle.remove()
    assert calls == [] and sim is None  # the embedding never ran
    assert selections[0].plan.removed == plan.removed and selections[0].cost["passes"] == 0

    layers = model.model.layers
    if family == "gemma3":  # behind a post-norm, the norm's gains (1 + γ) scale the rows and set the size
        attn = [(1 + b.post_attention_layernorm.weight.numpy())[:, None] * b.self_attn.o_proj.weight.numpy() for b in layers]
        mlp = [(1 + b.post_feedforward_layernorm.weight.numpy())[:, None] * b.mlp.down_proj.weight.numpy() for b in layers]
        scale = np.sqrt([np.sum((1 + b.post_attention_layernorm.weight.numpy()) ** 2)
                         + np.sum((1 + b.post_feedforward_layernorm.weight.numpy()) ** 2) for b in layers])
    else:
        attn = [b.self_attn.o_proj.weight.numpy() for b in layers]
        mlp = [b.mlp.down_proj.weight.numpy() for b in layers]
        scale = np.sqrt([np.sum(a ** 2) + np.sum(m ** 2) for a, m in zip(attn, mlp)])
    sim = (gram_cosines(attn) + gram_cosines(mlp)) / 2
    np.testing.assert_allclose(scoring.details["weights"]["similarity"], sim, rtol=1e-4)
    np.testing.assert_allclose(scoring.details["weights"]["scale"], scale, rtol=1e-5)
    redundancy = sim * scale[None, :] / (scale[:, None] + scale[None, :])
    np.fill_diagonal(redundancy, 0)
    first = int(np.argmax(redundancy.max(axis=1)))
    assert plan.removed[0] == first or scoring.details["weights"]["order"][0] == first
    np.testing.assert_allclose(plan.scores, redundancy.max(axis=1), rtol=1e-4)
