"""Calibration: streamed statistics equal an independent computation, stop early, skip padding,
keep sinks as rows (spilling past the capacity), and the two pipelines agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_INNER, TINY_WIDTH, random_tokens
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationBatch, CalibrationOptions, \
    collect_boundary_stats, collect_stats, make_batches, sink_mask
from ghosted_core.architectures import architecture_of
from ghosted_core.calibration.capture import branch_module, capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
from ghosted_core.run.options import VariantSpec
from ghosted_core.run.fitting import build_recovered
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.statistics import ALL_NEEDS, statistics_bytes

QUIET = CalibrationOptions(quiet=True, sink_rule="none")


def hidden_states(model, ids: torch.Tensor) -> list[np.ndarray]:
    """h_0 … h_L−1 from transformers' own output_hidden_states (independent of our hooks)."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return [h.double().numpy().reshape(-1, h.shape[-1]) for h in out.hidden_states[:-1]]


def test_moments_equal_numpy_on_activations(tiny_model, gram_block):
    ids = random_tokens(6, 12)
    boundary = Boundary(2, 4)
    stats = collect_stats(tiny_model, [boundary], make_batches(ids, None, 4), QUIET)[0]
    h = hidden_states(tiny_model, ids)
    x_pre, x_post = h[2], h[4]
    delta = x_post - x_pre
    fit = stats.token_set("all")
    assert fit.tokens == stats.tokens == 72
    np.testing.assert_allclose(fit.xtx.numpy(), x_pre.T @ x_pre, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fit.xtd.numpy(), x_pre.T @ delta, rtol=1e-5, atol=1e-5)
    assert stats.dd == pytest.approx((delta**2).sum(), rel=1e-6)
    np.testing.assert_allclose(stats.channel.abs_x.sum(0).numpy(), np.abs(x_pre).sum(0), rtol=1e-6)
    np.testing.assert_allclose(stats.channel.xy.sum(0).numpy(), (x_pre * x_post).sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.rotated.abs_y.sum(0).numpy(), np.abs(x_post @ hadamard(TINY_WIDTH)).sum(0),
                               rtol=1e-5)
    assert fit.xtx.dtype == torch.float64


def test_branch_moments_are_the_mlp_output_of_the_block_before(tiny_llama):
    ids = random_tokens(2, 10)
    stats = collect_stats(tiny_llama, [Boundary(3, 5)], make_batches(ids, None, 2), QUIET)[0]
    outputs = []
    handle = tiny_llama.model.layers[2].mlp.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    h = hidden_states(tiny_llama, ids)
    handle.remove()
    m = outputs[0].double().numpy().reshape(-1, TINY_WIDTH)
    branch = stats.token_set("all", "branch")
    np.testing.assert_allclose(branch.mtm.numpy(), m.T @ m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(branch.mtd.numpy(), m.T @ (h[5] - h[3]), rtol=1e-5, atol=1e-5)


def test_boundary_at_the_end_reads_the_final_norm_input(tiny_llama):
    ids = random_tokens(2, 10)
    stats = collect_stats(tiny_llama, [Boundary(4, 6)], make_batches(ids, None, 2), QUIET)[0]
    seen = []
    handle = tiny_llama.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    h = hidden_states(tiny_llama, ids)
    handle.remove()
    x_post = seen[0].double().numpy().reshape(-1, TINY_WIDTH)
    np.testing.assert_allclose(stats.token_set("all").xtd.numpy(), h[4].T @ (x_post - h[4]), rtol=1e-5, atol=1e-5)


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
    assert padded.tokens == full.tokens == 16
    torch.testing.assert_close(padded.ordinary.xtx, full.ordinary.xtx, rtol=1e-5, atol=1e-5)


def test_memory_does_not_grow_with_tokens(tiny_llama):
    """The statistics hold the same bytes (the plan's formula) for 64× the tokens, and every
    captured activation is released once the pass is over: nothing is stored per token."""
    import gc
    import weakref

    seen = []
    handle = tiny_llama.model.layers[2].register_forward_pre_hook(lambda m, a: seen.append(weakref.ref(a[0])))
    options = CalibrationOptions(quiet=True, sink_rule="position", sink_capacity=16)
    try:
        small = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(2, 8), None, 2), options)[0]
        large = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(16, 64), None, 8), options)[0]
    finally:
        handle.remove()
    gc.collect()
    assert large.tokens == 64 * small.tokens
    row = (3 * TINY_WIDTH + TINY_INNER + 1) * 8  # x_pre, Δ, m (C each), a (I), the cap
    assert small.nbytes() - small.sinks.kept * row == \
        large.nbytes() - large.sinks.kept * row  # only the kept sink rows differ
    assert large.sinks.kept == 16 and large.sinks.tokens == 16  # one sink per sequence, within the capacity
    assert seen and all(ref() is None for ref in seen)


def test_heldout_sequences_stay_out_of_the_statistics_and_give_direct_errors(tiny_llama):
    ids = random_tokens(6, 8)
    options = CalibrationOptions(quiet=True, sink_rule="position")
    batches = make_batches(ids[:4], ids[4:], 2)
    stats = collect_stats(tiny_llama, [Boundary(2, 4)], batches, options)[0]
    alone = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[:4], None, 2), options)[0]
    torch.testing.assert_close(stats.ordinary.xtx, alone.ordinary.xtx)
    assert stats.tokens == alone.tokens == 32
    fit = get_operator("ghost").fit(stats, FitOptions())
    (errors,) = measure_errors(tiny_llama, [fit], batches, options)
    h = hidden_states(tiny_llama, ids[4:])
    x_pre, x_post = h[2], h[4]
    error = x_pre @ (np.eye(TINY_WIDTH) + fit.update.numpy()) - x_post
    ordinary = np.arange(len(x_pre)) % 8 != 0  # position rule: the first token of each sequence is a sink
    assert errors.tokens == 16 and errors.sink_tokens == 2
    assert errors.relative == pytest.approx(np.linalg.norm(error) / np.linalg.norm(x_post - x_pre), rel=1e-6)
    assert errors.relative_ordinary == pytest.approx(
        np.linalg.norm(error[ordinary]) / np.linalg.norm((x_post - x_pre)[ordinary]), rel=1e-6)


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
    np.testing.assert_allclose(second.ordinary.xtd.numpy(), x_pre.T @ (x_post - x_pre), rtol=1e-5, atol=1e-5)
    independent = collect_stats(tiny_llama, plan.boundaries[1:], batches, QUIET)[0]
    assert not torch.allclose(second.ordinary.xtx, independent.ordinary.xtx)


def test_branch_module_per_family(tiny_llama, tiny_gemma):
    assert branch_module(tiny_llama.model.layers[0], architecture_of(tiny_llama.config)) is tiny_llama.model.layers[0].mlp
    assert branch_module(tiny_gemma.model.layers[0], architecture_of(tiny_gemma.config)) is \
        tiny_gemma.model.layers[0].post_feedforward_layernorm


def test_run_forward_without_capture_runs_every_block_but_not_the_head(tiny_llama):
    calls = []
    handles = [block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
               for i, block in enumerate(tiny_llama.model.layers)]
    handles.append(tiny_llama.model.norm.register_forward_pre_hook(lambda m, a: calls.append("norm")))
    handles.append(tiny_llama.lm_head.register_forward_pre_hook(lambda m, a: calls.append("head")))
    try:
        run_forward(tiny_llama, random_tokens(1, 4))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [0, 1, 2, 3, 4, 5, "norm"]


def test_merged_stats_equal_one_pass_over_both(tiny_llama):
    ids = random_tokens(8, 10)
    options = CalibrationOptions(quiet=True, sink_rule="position")
    both = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids, None, 4), options)[0]
    first = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[:4], None, 4), options)[0]
    second = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(ids[4:], None, 4), options)[0]
    merged = first.merged(second)
    assert merged.tokens == both.tokens and merged.sinks.kept == both.sinks.kept == 8
    torch.testing.assert_close(merged.token_set("all").xtd, both.token_set("all").xtd)
    torch.testing.assert_close(merged.token_set("capped", "branch").mtm, both.token_set("capped", "branch").mtm)


# ---------------------------------------------------------------- fits against an independent computation


def _numpy_fits(model, boundary: Boundary, ids: torch.Tensor, ratio: float, batch: int) -> dict[str, np.ndarray]:
    """ghost, ghost_capped and replaceme from the concatenated activations (numpy, float64)."""
    h = [model_h for model_h in hidden_states(model, ids)]
    outputs = []
    handle = branch_module(model.model.layers[boundary.start - 1], architecture_of(model.config)).register_forward_hook(
        lambda m, a, out: outputs.append(out.detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    m = outputs[0].double().numpy().reshape(-1, TINY_WIDTH)
    x, y = h[boundary.start], h[boundary.end]
    d = y - x
    caps = []
    for rows in np.split(np.arange(len(x)), len(x) // (batch * ids.shape[1])):  # the sink threshold is per batch
        cap = np.ones(len(rows))
        for z in (x[rows], y[rows]):
            norms = np.linalg.norm(z.astype(np.float32), axis=1)
            threshold = ratio * np.sort(norms)[(len(norms) - 1) // 2]  # torch.median: the lower median
            cap = np.minimum(cap, threshold / norms)
        caps.append(cap)
    w = np.concatenate(caps)[:, None]
    eye = 1e-6 * np.eye(TINY_WIDTH)
    return {"ghost": np.linalg.solve(x.T @ x + eye, x.T @ d),
            "ghost_capped": np.linalg.solve((x * w).T @ (x * w) + eye, (x * w).T @ (d * w)),
            "replaceme": np.linalg.solve(m.T @ m + eye, m.T @ d), "sinks": int((w < 1).sum())}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fits_from_sink_rows_equal_numpy_on_concatenated_activations(tiny_model, gram_block):
    """All-token, capped and ReplaceMe fits rebuilt from ordinary moments + sink rows."""
    ids = random_tokens(8, 16)
    boundary = Boundary(2, 4)
    options = CalibrationOptions(quiet=True, sink_ratio=1.2)  # a low threshold: many sinks on a random model
    stats = collect_stats(tiny_model, [boundary], make_batches(ids, None, 4), options)[0]
    expected = _numpy_fits(tiny_model, boundary, ids, 1.2, 4)
    assert stats.sinks.tokens == expected["sinks"] > 8
    for name in ("ghost", "ghost_capped", "replaceme"):
        fit = get_operator(name).fit(stats, FitOptions())
        assert _relative(fit.update.numpy(), expected[name]) < 1e-6, name


def test_sinks_past_the_capacity_spill_into_moments_with_a_note(tiny_llama, caplog):
    ids = random_tokens(8, 16)
    batches = make_batches(ids, None, 4)
    roomy = collect_stats(tiny_llama, [Boundary(2, 4)], batches, CalibrationOptions(quiet=True, sink_ratio=1.2))[0]
    tight = collect_stats(tiny_llama, [Boundary(2, 4)], batches,
                          CalibrationOptions(quiet=True, sink_ratio=1.2, sink_capacity=3))[0]
    assert roomy.sinks.spill is None and not roomy.notes
    assert tight.sinks.kept == 3 and tight.sinks.tokens == roomy.sinks.tokens > 3
    assert tight.sinks.spill.tokens == roomy.sinks.tokens - 3
    assert "exceeded the 3 kept rows" in tight.notes[0]
    assert any("exceeded the 3 kept rows" in r.message for r in caplog.records)
    for name in ("ghost", "ghost_capped", "ghost_nosink", "replaceme"):
        a = get_operator(name).fit(roomy, FitOptions()).update
        b = get_operator(name).fit(tight, FitOptions()).update
        assert float((a - b).norm() / a.norm()) < 1e-10, name
    from ghosted_core.recovery.assessment import assess

    report = assess(get_operator("ghost").fit(tight, FitOptions()), tight)
    assert report.fit_error == pytest.approx(assess(get_operator("ghost").fit(roomy, FitOptions()), roomy).fit_error)
    assert any("exceeded" in note for note in report.notes)


@pytest.mark.parametrize("operators", [("none",), ("diag", "rotate"), ("none", "diag", "rotate", "ghost", "ghost_capped"),
                                       ("replaceme",), ("ghost", "replaceme"), ("refit",), ("magcomp", "magcomp_refit")])
def test_allocated_statistics_equal_the_formula(tiny_llama, operators):
    """What the accumulators allocate is what `statistics_bytes` (the memory plan) counts."""
    needs = needs_of(operators)
    live = []
    options = CalibrationOptions(quiet=True, sink_capacity=32)
    boundaries = [Boundary(0, 1), Boundary(2, 4)]
    collect_stats(tiny_llama, boundaries, make_batches(random_tokens(4, 12), None, 2), options, needs, live)
    for acc, boundary in zip(live, boundaries):
        assert acc.nbytes() == statistics_bytes(TINY_WIDTH, needs, 32, branch=boundary.start > 0, inner_width=TINY_INNER)
    if operators == ("none", "diag", "rotate", "ghost", "ghost_capped"):  # the target: 2·C²·8 + O(C·rows)
        # rows: x_pre, Δ and a cap each; per basis 10 sums and the per-window ratio (C each), a window count;
        # two ‖Δ‖² scalars
        vectors, scalars = 2 * (10 + 1) * TINY_WIDTH, 2 + 2
        assert live[1].nbytes() <= 2 * TINY_WIDTH**2 * 8 + 32 * (2 * TINY_WIDTH + 1) * 8 + (vectors + scalars) * 8


def test_statistics_live_where_asked(tiny_llama):
    stats = collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(2, 8), None, 2),
                          CalibrationOptions(quiet=True, stats_device="cpu"))[0]
    assert stats.ordinary.xtx.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(GhostedError, match="no CUDA GPU"):
            collect_stats(tiny_llama, [Boundary(2, 4)], make_batches(random_tokens(2, 8), None, 2),
                          CalibrationOptions(quiet=True, stats_device="cuda"))


def test_float32_products_stay_close_to_float64(tiny_llama):
    """fp32 per-batch products summed in float64: M within 1e-3 relative of the pure float64 fit here."""
    batches = make_batches(random_tokens(16, 16), None, 4)
    exact = collect_stats(tiny_llama, [Boundary(2, 4)], batches, CalibrationOptions(quiet=True))[0]
    fast = collect_stats(tiny_llama, [Boundary(2, 4)], batches, CalibrationOptions(quiet=True, products="float32"))[0]
    assert fast.ordinary.xtx.dtype == torch.float64
    assert not torch.equal(fast.ordinary.xtx, exact.ordinary.xtx)  # the products really were fp32
    for name in ("ghost", "ghost_capped", "replaceme"):
        a = get_operator(name).fit(exact, FitOptions()).update
        b = get_operator(name).fit(fast, FitOptions()).update
        assert float((a - b).norm() / a.norm()) < 1e-3, name
    with pytest.raises(GhostedError):
        CalibrationOptions(products="float16")


def test_accumulator_for_a_boundary_at_block_zero_keeps_no_branch():
    acc = BoundaryAccumulator(Boundary(0, 2), CalibrationOptions(), ALL_NEEDS)
    x = torch.randn(1, 20, TINY_WIDTH, dtype=torch.float64)
    acc.add(x, 2 * x, x, torch.ones(1, 20, dtype=torch.bool))
    assert acc.nbytes() == statistics_bytes(TINY_WIDTH, ALL_NEEDS, acc.capacity, branch=False)
    assert acc.freeze().ordinary.mtm is None


# ---------------------------------------------------------------- the block-by-block pipeline


BLOCK_BOUNDARIES = [Boundary(1, 2), Boundary(2, 4), Boundary(4, 6), Boundary(0, 3)]  # overlapping, as a sweep asks


@pytest.mark.parametrize("sink_rule", ["norm", "position"])
def test_blocks_pipeline_gives_the_same_fits_as_full(tiny_model, sink_rule):
    batches = make_batches(random_tokens(6, 12), None, 2)
    full = collect_stats(tiny_model, BLOCK_BOUNDARIES, batches, CalibrationOptions(quiet=True, sink_rule=sink_rule))
    blocks = collect_stats(tiny_model, BLOCK_BOUNDARIES, batches,
                           CalibrationOptions(quiet=True, sink_rule=sink_rule, pipeline="blocks"))
    for a, b in zip(full, blocks):
        assert a.boundary == b.boundary and a.tokens == b.tokens and a.sinks.tokens == b.sinks.tokens
        for name in ("ghost", "ghost_capped", "replaceme", "diag", "rotate", "refit", "magcomp_refit"):
            fa, fb = get_operator(name).fit(a, FitOptions()), get_operator(name).fit(b, FitOptions())
            if fa.update is not None:
                assert float((fa.update - fb.update).norm() / fa.update.norm()) <= 1e-8, (name, a.boundary)


def test_blocks_pipeline_respects_padding(tiny_gemma):
    ids = random_tokens(4, 12)
    mask = torch.ones_like(ids)
    mask[:2, 9:] = 0
    batches = [CalibrationBatch(ids[:2], mask[:2], False), CalibrationBatch(ids[2:], mask[2:], False)]
    full = collect_stats(tiny_gemma, [Boundary(2, 5)], batches, QUIET)[0]
    blocks = collect_stats(tiny_gemma, [Boundary(2, 5)], batches, CalibrationOptions(quiet=True, sink_rule="none",
                                                                                   pipeline="blocks"))[0]
    assert full.tokens == blocks.tokens == 42
    torch.testing.assert_close(blocks.ordinary.xtd, full.ordinary.xtd, rtol=1e-10, atol=1e-10)


def test_blocks_pipeline_measures_heldout_errors_like_full(tiny_gemma):
    ids = random_tokens(6, 10)
    batches = make_batches(ids[:4], ids[4:], 2)
    stats = collect_stats(tiny_gemma, [Boundary(3, 5)], batches, CalibrationOptions(quiet=True))[0]
    fit = get_operator("ghost").fit(stats, FitOptions())
    (full,) = measure_errors(tiny_gemma, [fit], batches, CalibrationOptions(quiet=True))
    (blocks,) = measure_errors(tiny_gemma, [fit], batches, CalibrationOptions(quiet=True, pipeline="blocks"))
    assert blocks.relative == pytest.approx(full.relative, rel=1e-10)
    assert blocks.tokens == full.tokens == 20


# ---------------------------------------------------------------- the real model (slow)


def _smollm2_calibration(loaded, sequences: int, seqlen: int):
    from ghosted_core.data import corpora

    fit_ids, _ = corpora.calibration_windows(loaded.tokenizer, "mix", sequences, seqlen, 0, 0)
    return fit_ids


@pytest.mark.slow
def test_smollm2_fits_equal_numpy_on_the_concatenated_activations(smollm2, all_threads):
    """ghost, ghost_capped and replaceme from ordinary moments + sink rows equal the normal equations
    solved by numpy on every calibration activation (the statistics before this restructure)."""
    model = smollm2.model
    ids = _smollm2_calibration(smollm2, 8, 160)  # 1280 tokens > C = 576
    boundary = Boundary(16, 23)
    options = CalibrationOptions(quiet=True, batch_size=4)
    stats = collect_stats(model, [boundary], make_batches(ids, None, 4), options)[0]
    assert stats.sinks.tokens >= 8  # at least the first position of every sequence
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
    h = [t.double().numpy().reshape(-1, 576) for t in out.hidden_states]
    outputs = []
    handle = model.model.layers[15].mlp.register_forward_hook(lambda m, a, o: outputs.append(o.detach()))
    with torch.no_grad():
        model.model(ids)
    handle.remove()
    x, y = h[16], h[23]
    m = outputs[0].double().numpy().reshape(-1, 576)
    d = y - x
    caps = []
    for rows in np.split(np.arange(len(x)), 2):  # two batches of 4 sequences: per-batch sink threshold
        cap = np.ones(len(rows))
        for z in (x[rows], y[rows]):
            norms = np.linalg.norm(z.astype(np.float32), axis=1)
            cap = np.minimum(cap, 10.0 * np.sort(norms)[(len(norms) - 1) // 2] / norms)
        caps.append(cap)
    w = np.concatenate(caps)[:, None]
    assert int((w < 1).sum()) == stats.sinks.tokens == stats.sinks.kept
    np.testing.assert_allclose(stats.sinks.cap.numpy(), w[w < 1], rtol=1e-5)  # float32 norms: rounding differs
    w[w < 1] = stats.sinks.cap.numpy()  # weigh with the library's caps, so only the assembly of the fit is tested
    eye = 1e-6 * np.eye(576)
    expected = {"ghost": np.linalg.solve(x.T @ x + eye, x.T @ d),
                "ghost_capped": np.linalg.solve((x * w).T @ (x * w) + eye, (x * w).T @ (d * w)),
                "replaceme": np.linalg.solve(m.T @ m + eye, m.T @ d)}
    for name, reference in expected.items():
        fit = get_operator(name).fit(stats, FitOptions())
        assert fit.ridge == 1e-6, name  # the paper's absolute ridge: a well-posed fit
        assert _relative(fit.update.numpy(), reference) <= 1e-10, (name, _relative(fit.update.numpy(), reference))


@pytest.mark.slow
def test_smollm2_blocks_pipeline_equals_full(smollm2, all_threads):
    model = smollm2.model
    ids = _smollm2_calibration(smollm2, 8, 128)
    boundaries = [Boundary(9, 12), Boundary(20, 27)]
    batches = make_batches(ids, None, 4)
    full = collect_stats(model, boundaries, batches, CalibrationOptions(quiet=True))
    blocks = collect_stats(model, boundaries, batches, CalibrationOptions(quiet=True, pipeline="blocks"))
    for a, b in zip(full, blocks):
        assert a.sinks.tokens == b.sinks.tokens
        for name in ("ghost", "ghost_capped", "replaceme"):
            fa, fb = get_operator(name).fit(a, FitOptions()), get_operator(name).fit(b, FitOptions())
            assert float((fa.update - fb.update).norm() / fa.update.norm()) <= 1e-8, name
