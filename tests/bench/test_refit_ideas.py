"""The quality bench's extra stock ideas: each is a stock checkpoint that reloads as it computed, and does what it says."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.refit_ideas import gemma_gains, joint_o_refit, magcomp_keepsink, magcomp_refit_down
from conftest import make_tiny_model, random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.export.fold import stock_blockers
from ghosted_core.export.folder import export_variant
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import get_operator
from ghosted_core.run.fitting import build_recovered, choose_fit
from ghosted_core.run.options import RunOptions, VariantSpec


def setting(model, removed):
    plan = PruningPlan(6, removed, "manual")
    batches = make_batches(random_tokens(12, 16), random_tokens(2, 16, seed=5), 4)
    options = RunOptions(calibrate=CalibrationOptions(quiet=True))
    return plan, batches, options, collect_stats(model, plan.boundaries, batches, options.calibrate)


def reloads_as_computed(variant, tmp_path) -> None:
    assert not stock_blockers(variant)
    folder = export_variant(variant, None, tmp_path / "idea", mode="stock").folder
    ids = random_tokens(2, 10, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(folder)(ids).logits, variant(ids).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("idea", ["magcomp_keepsink", "magcomp_refit_down", "joint_o_refit"])
def test_llama_ideas_are_stock_and_change_the_pruned_model(tiny_llama, idea, tmp_path):
    plan, batches, options, stats = setting(tiny_llama, (2, 3))
    if idea == "magcomp_refit_down":
        fits = [choose_fit(tiny_llama, get_operator("magcomp_refit").fit(s, options.fit), batches, options)
                for s in stats]
        variant = magcomp_refit_down(tiny_llama, plan, fits, batches, options)
        base = build_recovered(tiny_llama, plan, VariantSpec("magcomp_refit", "magcomp_refit"), fits)
        changed = variant.model.layers[2].mlp.down_proj  # dense block 4, the first after the cut
        assert changed is not tiny_llama.model.layers[4].mlp.down_proj
    else:
        variant = {"magcomp_keepsink": magcomp_keepsink, "joint_o_refit": joint_o_refit}[idea](
            tiny_llama, plan, stats, batches, options)
        base = build_recovered(tiny_llama, plan, VariantSpec("none", "none"), [])
    ids = random_tokens(2, 10, seed=3)
    with torch.no_grad():
        assert float((variant(ids).logits - base(ids).logits).abs().max()) > 1e-3
    reloads_as_computed(variant, tmp_path)


def test_gemma_gains_fold_into_the_post_norm_and_the_final_norm(tmp_path):
    gemma = make_tiny_model("gemma3")
    plan, batches, options, stats = setting(gemma, (2, 3, 5))  # one cut inside, one reaching the end
    variant = gemma_gains(gemma, plan, stats, batches, options)
    m2, md = stats[0].ordinary.mtm.diagonal(), stats[0].ordinary.mtd.diagonal()
    gain = (1 + gemma.model.layers[1].post_feedforward_layernorm.weight.double()) * (1 + md / m2)
    torch.testing.assert_close(1 + variant.model.layers[1].post_feedforward_layernorm.weight.double(), gain)
    assert variant.model.norm is not gemma.model.norm  # the cut at the end refits the final norm's gain
    reloads_as_computed(variant, tmp_path)
    assert gemma_gains(make_tiny_model("llama"), plan, stats, batches, options) is None  # Gemma-3 only
