"""An orthogonal boundary map folded exactly into a stock model by rotating everything upstream."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_tiny_model, random_tokens
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions, collect_stats, make_batches
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.export.folder import export_variant
from ghosted_core.export.fold import stock_blockers
from ghosted_core.model.modeling_ghosted import ResidualLinear
from ghosted_core.run.options import RunOptions
from ghosted_core.plan import Boundary, PruningPlan
from bench.rotation_fold import fold_upstream_rotation, orthogonal_fold_variants, procrustes_map
from ghosted_core.statistics import StatNeeds
from ghosted_core.model.modeling_ghosted import PatchedBlock
from ghosted_core.model.surgery import assemble
from conftest import recovered_variants


def random_rotation(width: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(width, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_folded_rotation_computes_the_patched_model(family, tmp_path):
    dense = make_tiny_model(family)
    removed = (2, 3)
    q = random_rotation(dense.config.hidden_size)
    _plan, variants = recovered_variants(dense, removed)
    ids = random_tokens(2, 12, seed=3)
    for name in ("none", "replaceme"):  # replaceme's map sits in block 1's down_proj, upstream of the cut
        base = variants[name]
        blocks = dict(enumerate(base.model.layers))  # pruned index → block (a view)
        folded = fold_upstream_rotation(base, 2, q, record={"removed_layers": list(removed), "operator": "ghost_orth"})
        assert not folded.config.tie_word_embeddings
        assert all(folded.model.layers[i].mlp.down_proj.weight.data_ptr() == blocks[i].mlp.down_proj.weight.data_ptr()
                   for i in (2, 3))  # blocks after the cut share the tensors
        with torch.no_grad():
            expected = _patched(base, q)(ids).logits
            got = folded(ids).logits
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5, name
    result = export_variant(folded, None, tmp_path / "orth", mode="stock")
    loaded = AutoModelForCausalLM.from_pretrained(result.folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, got, rtol=0, atol=0)


def _patched(variant, q):
    """The variant with x ↦ xQ on the stream entering its block 2 (a view, for reference)."""
    layers = list(variant.model.layers)
    layers[2] = PatchedBlock(ResidualLinear(q), layers[2])
    return assemble(variant, layers, copy.deepcopy(variant.config), variant.model.norm)


def test_gemma3_is_refused(tiny_gemma):
    _plan, variants = recovered_variants(tiny_gemma, (2, 3))
    with pytest.raises(GhostedError, match="Llama-style"):
        fold_upstream_rotation(variants["none"], 2, random_rotation(tiny_gemma.config.hidden_size))


def test_procrustes_equals_numpy():
    rng = np.random.default_rng(0)
    x_pre = rng.normal(size=(500, 12))
    x_post = x_pre @ np.linalg.qr(rng.normal(size=(12, 12)))[0] * 1.3 + 0.1 * rng.normal(size=(500, 12))
    acc = BoundaryAccumulator(Boundary(2, 4), CalibrationOptions(sink_rule="none"), StatNeeds(residual=True), 1)
    acc.add(torch.from_numpy(x_pre)[None], torch.from_numpy(x_post)[None], None, torch.ones(1, 500, dtype=torch.bool))
    q = procrustes_map(acc.freeze(), "all").numpy()
    u, _, vt = np.linalg.svd(x_pre.T @ x_post)
    np.testing.assert_allclose(q, u @ vt, atol=1e-10)
    np.testing.assert_allclose(q @ q.T, np.eye(12), atol=1e-12)


def test_orthogonal_fold_variants_recover_on_a_tiny_model(tiny_llama):
    """Both fold-gap variants are stock (nothing blocks the fold) and the branch refit lowers the boundary error."""
    plan = PruningPlan(6, (2, 3), "manual")
    ids = random_tokens(8, 16, seed=4)
    batches = make_batches(ids[:6], ids[6:], 3)
    options = RunOptions(calibrate=CalibrationOptions(quiet=True))
    (stats,) = collect_stats(tiny_llama, plan.boundaries, batches, options.calibrate)
    variants = orthogonal_fold_variants(tiny_llama, plan, stats, batches, options)
    assert set(variants) == {"ghost_orth", "ghost_orth+replaceme_keepsink"}
    assert all(not stock_blockers(v) for v in variants.values())
    errors = {}
    for name, model in variants.items():  # ‖h_4^dense − (stream entering pruned block 2)‖ on all windows
        with capture(tiny_llama, {4}) as target, torch.no_grad():
            run_forward(tiny_llama, ids)
        with capture(model, {2}) as seen, torch.no_grad():
            run_forward(model, ids)
        errors[name] = float((seen[("residual", 2)] - target[("residual", 4)]).norm())
    assert errors["ghost_orth+replaceme_keepsink"] < errors["ghost_orth"]
