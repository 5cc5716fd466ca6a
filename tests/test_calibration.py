"""Calibration: streamed statistics equal an independent computation, stop early, skip padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_WIDTH, random_tokens
from ghosted_core.calibration import (CalibrationBatch, CalibrationOptions, branch_module, capture, collect_boundary_stats,
                                      collect_stats, make_batches, run_forward, sink_mask)
from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard
from ghosted_core.operators import FitOptions, get_operator
from ghosted_core.pipeline import VariantSpec, build_recovered
from ghosted_core.plan import Boundary, PruningPlan

QUIET = CalibrationOptions(quiet=True, sink_rule="none")


def hidden_states(model, ids: torch.Tensor) -> list[np.ndarray]:
    """h_0 … h_L−1 from transformers' own output_hidden_states (independent of our hooks)."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return [h.double().numpy().reshape(-1, h.shape[-1]) for h in out.hidden_states[:-1]]


def test_moments_equal_numpy_on_activations(tiny_model):
    ids = random_tokens(6, 12)
    boundary = Boundary(2, 4)
    stats = collect_stats(tiny_model, [boundary], make_batches(ids, None, 4), QUIET)[0]
    h = hidden_states(tiny_model, ids)
    x_pre, x_post = h[2], h[4]
    delta = x_post - x_pre
    fit = stats.fit
    assert fit.tokens == 72
    np.testing.assert_allclose(fit.xtx.numpy(), x_pre.T @ x_pre, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fit.xtd.numpy(), x_pre.T @ delta, rtol=1e-5, atol=1e-5)
    assert float(fit.dd) == pytest.approx((delta**2).sum(), rel=1e-6)
    np.testing.assert_allclose(fit.abs_pre.numpy(), np.abs(x_pre).sum(0), rtol=1e-6)
    np.testing.assert_allclose(fit.abs_post_rot.numpy(), np.abs(x_post @ hadamard(TINY_WIDTH)).sum(0), rtol=1e-5)
    assert fit.xtx.dtype == torch.float64


def test_branch_moments_are_the_mlp_output_of_the_block_before(tiny_llama):
    ids = random_tokens(2, 10)
    stats = collect_stats(tiny_llama, [Boundary(3, 5)], make_batches(ids, None, 2), QUIET)[0]
    outputs = []
    handle = tiny_llama.model.layers[2].mlp.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    h = hidden_states(tiny_llama, ids)
    handle.remove()
    m = outputs[0].double().numpy().reshape(-1, TINY_WIDTH)
    np.testing.assert_allclose(stats.fit.mtm.numpy(), m.T @ m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.fit.mtd.numpy(), m.T @ (h[5] - h[3]), rtol=1e-5, atol=1e-5)


def test_boundary_at_the_end_reads_the_final_norm_input(tiny_llama):
    ids = random_tokens(2, 10)
    stats = collect_stats(tiny_llama, [Boundary(4, 6)], make_batches(ids, None, 2), QUIET)[0]
    seen = []
    handle = tiny_llama.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    h = hidden_states(tiny_llama, ids)
    handle.remove()
    x_post = seen[0].double().numpy().reshape(-1, TINY_WIDTH)
    np.testing.assert_allclose(stats.fit.xtd.numpy(), h[4].T @ (x_post - h[4]), rtol=1e-5, atol=1e-5)


def test_forward_stops_after_the_last_block_needed(tiny_llama):
    calls = []
    handles = [block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
               for i, block in enumerate(tiny_llama.model.layers)]
    head_calls = []
    handles.append(tiny_llama.lm_head.register_forward_pre_hook(lambda m, a: head_calls.append(1)))
    try:
        collect_stats(tiny_llama, [Boundary(1, 3)], make_batches(random_tokens(2, 8), None, 2), QUIET)
    finally:
        for handle in handles:
            handle.remove()
    assert set(calls) == {0, 1, 2, 3}  # block 3's input is the last thing needed: 4, 5 and the head never run
    assert not head_calls


def test_hooks_are_removed_even_on_error(tiny_llama):
    before = [dict(b._forward_pre_hooks) for b in tiny_llama.model.layers]
    with pytest.raises(RuntimeError):
        with capture(tiny_llama, [1, 2]):
            raise RuntimeError("boom")
    assert [dict(b._forward_pre_hooks) for b in tiny_llama.model.layers] == before
    with torch.no_grad():
        tiny_llama(random_tokens(1, 4))  # no stray hook fires or stops the forward


def test_padded_positions_are_excluded(tiny_llama):
    ids = random_tokens(2, 12)
    full = collect_stats(tiny_llama, [Boundary(2, 4)], [CalibrationBatch(ids[:, :8], None, False)], QUIET)[0]
    mask = torch.ones_like(ids)
    mask[:, 8:] = 0  # right padding: earlier tokens see the same causal context
    padded = collect_stats(tiny_llama, [Boundary(2, 4)], [CalibrationBatch(ids, mask, False)], QUIET)[0]
    assert padded.fit.tokens == full.fit.tokens == 16
    torch.testing.assert_close(padded.fit.xtx, full.fit.xtx, rtol=1e-5, atol=1e-5)


def test_memory_does_not_grow_with_tokens(tiny_llama):
    small = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(2, 8), None, 2), QUIET)[0]
    large = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(16, 64), None, 8), QUIET)[0]

    def sizes(stats):
        return sorted(t.numel() for m in (stats.fit_ordinary, stats.fit_sink) for t in vars(m).values()
                      if isinstance(t, torch.Tensor))

    assert large.fit.tokens == 64 * small.fit.tokens
    assert sizes(small) == sizes(large)
    assert max(sizes(large)) == TINY_WIDTH**2


def test_heldout_sequences_feed_only_heldout_moments(tiny_llama):
    ids = random_tokens(6, 8)
    stats = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[:4], ids[4:], 2), QUIET)[0]
    alone = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[:4], None, 2), QUIET)[0]
    torch.testing.assert_close(stats.fit.xtx, alone.fit.xtx)
    assert stats.heldout.tokens == 16 and alone.heldout is None


def test_sink_detection_flags_massive_tokens():
    x = torch.randn(2, 20, 8)
    x[:, 0] *= 300.0
    valid = torch.ones(2, 20, dtype=torch.bool)
    mask = sink_mask(x, x, valid, CalibrationOptions())
    assert mask[:, 0].all() and not mask[:, 1:].any()
    by_position = sink_mask(x, x, valid, CalibrationOptions(sink_rule="position", sink_positions=2))
    assert by_position[:, :2].all() and not by_position[:, 2:].any()
    with pytest.raises(GhostedError):
        CalibrationOptions(sink_rule="sometimes")


def test_sequential_stats_come_from_the_recovered_upstream_model(tiny_llama):
    plan = PruningPlan(6, (1, 4), "manual")  # two boundaries: 1 and 4
    ids = random_tokens(4, 10)
    batches = make_batches(ids, None, 4)
    first = collect_stats(tiny_llama, plan.boundaries[:1], batches, QUIET)[0]
    fit = get_operator("ghost").fit(first, FitOptions())
    upstream = build_recovered(tiny_llama, PruningPlan(6, (1,), "manual"), VariantSpec("ghost", "ghost"), [fit])
    second = collect_boundary_stats(upstream, 3, tiny_llama, plan.boundaries[1], batches, QUIET)
    x_pre = hidden_states(upstream, ids)[3]  # upstream layer 3 is dense block 4
    x_post = hidden_states(tiny_llama, ids)[5]
    np.testing.assert_allclose(second.fit.xtd.numpy(), x_pre.T @ (x_post - x_pre), rtol=1e-5, atol=1e-5)
    independent = collect_stats(tiny_llama, plan.boundaries[1:], batches, QUIET)[0]
    assert not torch.allclose(second.fit.xtx, independent.fit.xtx)


def test_branch_module_per_family(tiny_llama, tiny_gemma):
    assert branch_module(tiny_llama.model.layers[0]) is tiny_llama.model.layers[0].mlp
    assert branch_module(tiny_gemma.model.layers[0]) is tiny_gemma.model.layers[0].post_feedforward_layernorm


def test_run_forward_without_capture_runs_whole_model(tiny_llama):
    run_forward(tiny_llama, random_tokens(1, 4))  # no hook: completes without raising


def test_merged_stats_equal_one_pass_over_both(tiny_llama):
    ids = random_tokens(8, 10)
    both = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids, None, 4), QUIET)[0]
    first = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[:4], None, 4), QUIET)[0]
    second = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[4:], None, 4), QUIET)[0]
    merged = first.merged(second)
    assert merged.fit.tokens == both.fit.tokens
    torch.testing.assert_close(merged.fit.xtd, both.fit.xtd)
