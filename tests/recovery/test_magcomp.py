"""magcomp: its scalar against numpy on captured activations, and its fold against the unfolded scaling.

The unfolded computation is the pruned model with the residual stream entering each cut multiplied by
s (a patch at the cut, written here); the fold scales the embeddings and every residual writer before
the cut instead (o_proj/down_proj, Gemma3's post-norms, and the final norm where the head is tied).
Models are float64 with a tiny RMSNorm ε, so only the norms' own float32 arithmetic separates them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from conftest import TINY_FAMILIES, _tiny_config, make_tiny_model, random_tokens
from ghosted_core.architectures import architecture_of
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.export.folder import export_variant
from ghosted_core.model.modeling_ghosted import PatchedBlock
from ghosted_core.model.loading import final_norm
from ghosted_core.model.scaling import ScaledOutput, StreamScale, scale_before, scale_writers
from ghosted_core.model.layer_config import required_blocks
from ghosted_core.model.surgery import assemble, build_variant
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.magcomp import MAGCOMP_FORMS, magnitude_scale
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec

# family → config overrides: tied Llama with biases on both writers, untied Qwen2, tied Gemma-3 (1 + γ norms)
MODELS = {"llama": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
          "qwen2": dict(tie_word_embeddings=False),
          "gemma3": dict(tie_word_embeddings=True)}
PLANS = [(0, 1), (2, 3), (1, 4)]  # a cut at block 0, one inside, two cuts
FORCED = 1.7  # a scale far from 1 (the tiny random models' own ratios are close to it)


class Times(nn.Module):
    """x ↦ s·x, in the tensor's own precision: the unfolded compensation at a cut."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


def float64_model(family: str):
    return make_tiny_model(family, rms_norm_eps=1e-12, **MODELS[family]).double()


def magcomp_view(model, removed, scale: float | None = None):
    """(plan, fits, the magcomp variant), the fitted scalar replaced by `scale` when given."""
    plan = PruningPlan(model.config.num_hidden_layers, removed, "manual")
    stats = collect_stats(model, plan.boundaries, make_batches(random_tokens(4, 12), None, 4),
                          CalibrationOptions(quiet=True))
    fits = [get_operator("magcomp").fit(s, FitOptions()) for s in stats]
    if scale is not None:
        fits = [dataclasses.replace(f, upstream_scale=scale) for f in fits]
    return plan, fits, build_recovered(model, plan, VariantSpec("magcomp", "magcomp"), fits)


def unfolded(model, plan, fits):
    patches = {f.boundary.end: Times(f.upstream_scale) for f in fits}
    return build_variant(model, plan.removed, patches, None, {"operator": "magcomp"})


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("removed", PLANS)
def test_fold_equals_the_unfolded_scaling(family, removed):
    model = float64_model(family)
    plan, fits, view = magcomp_view(model, removed, FORCED)
    ids = random_tokens(2, 10, seed=3)
    with torch.no_grad():
        folded, reference = view(ids).logits, unfolded(model, plan, fits)(ids).logits
        pruned = build_variant(model, plan.removed)(ids).logits
    assert relative_gap(folded, reference) < 1e-6  # the norms compute in float32 inside transformers
    assert relative_gap(pruned, reference) > 1e-3  # the scale matters (1000x the gap above): the test can fail
    generated = view.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)  # KV cache path
    expected = unfolded(model, plan, fits).generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected)


def test_view_shares_every_weight_and_scales_compose(tiny_llama):
    plan = PruningPlan(6, (3,), "manual")
    pruned = build_variant(tiny_llama, plan.removed)
    once = scale_before(scale_before(pruned, 3, 1.5), 2, 2.0)
    writer = once.model.layers[1].self_attn.o_proj
    assert isinstance(writer, ScaledOutput) and writer.scale == pytest.approx(3.0)
    assert once.model.layers[2].mlp.down_proj.scale == pytest.approx(1.5)
    assert isinstance(once.model.layers[0], PatchedBlock) and once.model.layers[0].patch.scale == pytest.approx(3.0)
    assert writer.inner.weight.data_ptr() == tiny_llama.model.layers[1].self_attn.o_proj.weight.data_ptr()
    assert once.model.embed_tokens is tiny_llama.model.embed_tokens
    assert not isinstance(pruned.model.layers[1].self_attn.o_proj, ScaledOutput)  # the source view is untouched
    ids = random_tokens(1, 8)
    with torch.no_grad():
        direct = scale_before(scale_before(pruned, 2, 2.0), 3, 1.5)(ids).logits  # the other order
        torch.testing.assert_close(once(ids).logits, direct, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(MODELS))
def test_stock_export_loads_without_ghosted_core(family, tmp_path):
    from fresh_process import assert_same_model, load_in_fresh_process, weight_keys

    model = make_tiny_model(family, **MODELS[family])
    folders, views = {}, {}
    for removed in PLANS:
        name = "cut" + "".join(map(str, removed))
        _plan, _fits, views[name] = magcomp_view(model, removed, FORCED)
        result = export_variant(views[name], None, tmp_path / name, mode="stock")
        assert result.mode == "stock" and "magnitude scale" in result.reason
        keys = weight_keys(result.folder)
        assert not any(".inner." in k for k in keys)
        assert ("lm_head.weight" in keys) == (not model.config.tie_word_embeddings)
        folders[name] = result.folder
    ids = random_tokens(2, 12, seed=9)
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=False)
    for name, view in views.items():
        assert loaded[name]["class"] == type(model).__name__
        assert_same_model(loaded[name], view, ids)


def test_tied_export_keeps_the_tie_and_moves_the_scale_into_the_final_norm(tiny_gemma, tmp_path):
    from transformers import AutoModelForCausalLM

    _plan, _fits, view = magcomp_view(tiny_gemma, (2, 3), FORCED)
    loaded = AutoModelForCausalLM.from_pretrained(export_variant(view, None, tmp_path / "m").folder)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.model.embed_tokens.weight, tiny_gemma.model.embed_tokens.weight * FORCED)
    gain = 1 + tiny_gemma.model.norm.weight  # Gemma's norm multiplies by 1 + γ
    torch.testing.assert_close(1 + loaded.model.norm.weight, gain / FORCED)
    post = 1 + tiny_gemma.model.layers[1].post_feedforward_layernorm.weight
    torch.testing.assert_close(1 + loaded.model.layers[1].post_feedforward_layernorm.weight, post * FORCED)


def test_remote_code_export_of_magcomp_folds_the_scale_too(tiny_llama, tmp_path):
    from ghosted_core.export.folder import load_recovered

    _plan, _fits, view = magcomp_view(tiny_llama, (2, 3), FORCED)
    result = export_variant(view, None, tmp_path / "remote", mode="remote_code")
    model, _ = load_recovered(result.folder)
    ids = random_tokens(2, 10, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, view(ids).logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the scalar


def captured(model, plan, options):
    """x_pre, x_post (N·T, C) of the one boundary, and the sink mask, computed with output_hidden_states."""
    ids = random_tokens(4, 12)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # [i] enters block i (i < L)
    (boundary,) = plan.boundaries
    x_pre, x_post = states[boundary.start], states[boundary.end]
    sinks = torch.zeros(ids.shape, dtype=torch.bool)
    sinks[:, : options.sink_positions] = True
    flat = lambda t: t.reshape(-1, t.shape[-1]).double().numpy()  # noqa: E731
    return flat(x_pre), flat(x_post), sinks.reshape(-1).numpy()


@pytest.mark.parametrize("form", MAGCOMP_FORMS)
def test_scalar_matches_numpy(tiny_model, form):
    options = CalibrationOptions(quiet=True, sink_rule="position", sink_positions=1)
    plan = PruningPlan(6, (2, 3), "manual")
    (stats,) = collect_stats(tiny_model, plan.boundaries, make_batches(random_tokens(4, 12), None, 4), options,
                             get_operator("magcomp").needs)
    x_pre, x_post, sinks = captured(tiny_model, plan, options)
    if form.endswith("_ordinary"):
        x_pre, x_post = x_pre[~sinks], x_post[~sinks]
    if form.startswith("global"):
        expected = np.abs(x_post).mean() / np.abs(x_pre).mean()
    else:
        expected = (np.abs(x_post).mean(0) / np.abs(x_pre).mean(0)).mean()
    assert magnitude_scale(stats, form) == pytest.approx(expected, rel=1e-6)
    assert stats.ordinary.xtx is None and stats.ordinary.mtm is None  # no C×C statistic was kept


def test_unknown_form_and_missing_sums_are_refused(tiny_llama):
    with pytest.raises(GhostedError, match="magcomp form"):
        FitOptions(magcomp_form="median")
    plan = PruningPlan(6, (2,), "manual")
    (stats,) = collect_stats(tiny_llama, plan.boundaries, make_batches(random_tokens(2, 8), None, 2),
                             CalibrationOptions(quiet=True), get_operator("ghost").needs)
    with pytest.raises(GhostedError, match="per-channel sums"):
        magnitude_scale(stats)


SCALED_FAMILIES = [f for f in TINY_FAMILIES
                   if architecture_of(_tiny_config(f)[1]).refusal("scale", "magcomp", _tiny_config(f)[1]) is None]


@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_every_family_carries_the_scale_in_its_writers(family):
    """The architecture table's writers are all that write the residual stream: scaling them (and the embeddings)
    scales the stream entering the cut by s exactly, on every family (experts, shared experts, post-norms, linear-
    attention, convolution and Mamba mixers, Granite's multipliers), in float64 with a tiny norm ε."""
    config = _tiny_config(family)[1]
    eps = {key: 1e-12 for key in ("rms_norm_eps", "norm_eps") if hasattr(config, key)}
    model = make_tiny_model(family, **eps).double()
    model.config._experts_implementation = "eager"  # the grouped-matmul kernel has no float64
    removed = (2, 3) if not {2, 3} & set(required_blocks(model.config)) else (0, 1)  # shared KV keeps 2 and 3
    plan, fits, view = magcomp_view(model, removed, FORCED)
    ids = random_tokens(2, 10, seed=3)
    with torch.no_grad():
        folded, reference = view(ids).logits, unfolded(model, plan, fits)(ids).logits
        pruned = build_variant(model, plan.removed)(ids).logits
    gap = relative_gap(folded, reference)
    assert gap < 1e-6, family
    assert relative_gap(pruned, reference) > 100 * max(gap, 1e-7), family  # the scale matters: the test can fail


@pytest.mark.parametrize("family", ["llama", "gemma3", "olmo2", "olmo3", "gemma4_e2b"])
def test_the_scale_folds_only_where_every_block_reads_the_stream_through_a_norm(family):
    """Scaling the embeddings and every writer of every block by s leaves a pre-norm model's logits as they were
    (each block reads RMSNorm(s·h) = RMSNorm(h)); OLMo-2/3 put their norms after each branch only, and Gemma 4 E2B
    gates its per-layer embeddings with the raw stream, so their blocks read the scaled stream itself and compute
    something else: magcomp is refused there, with that reason."""
    model = make_tiny_model(family, rms_norm_eps=1e-12).double()
    arch = architecture_of(model.config)
    normed = arch.refusal("scale", "magcomp", model.config) is None
    blocks = [scale_writers(block, arch.residual_writers, FORCED) for block in model.model.layers]
    blocks[0] = PatchedBlock(StreamScale(FORCED), blocks[0])
    scaled = assemble(model, blocks, model.config, final_norm(model))
    ids = random_tokens(2, 10, seed=3)
    with torch.no_grad():
        gap = relative_gap(scaled(ids).logits, model(ids).logits)
    if normed:
        assert gap < 1e-6
        scale_before(model, 3, FORCED)
    else:
        assert gap > 1e-3
        with pytest.raises(GhostedError, match="read the stream without a norm|reads it without a norm"):
            scale_before(model, 3, FORCED)
