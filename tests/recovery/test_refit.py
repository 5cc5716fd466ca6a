"""The down_proj refit: its solution against numpy, its errors from the statistics, its fold, its export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_tiny_model, random_tokens
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions, collect_stats, make_batches
from ghosted_core.export.folder import export_variant
from ghosted_core.model.surgery import build_variant
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.recovery.assessment import BoundaryMap
from ghosted_core.recovery.operators import FitOptions, calibration_errors, choose_by_heldout, get_operator, needs_of
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.run.fitting import build_recovered, choose_fit
from ghosted_core.run.options import RunOptions, VariantSpec

WIDTH, INNER = 12, 30


def synthetic(tokens: int = 300, sinks: int = 3, seed: int = 0):
    """Statistics of random rows where x_post depends on the intermediate a, with `sinks` massive sink tokens."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(tokens, INNER))
    x_pre = rng.normal(size=(tokens, WIDTH))
    x_post = 1.3 * x_pre + a @ (0.2 * rng.normal(size=(INNER, WIDTH))) + 0.1 * rng.normal(size=(tokens, WIDTH))
    x_pre[:sinks] *= 100.0
    x_post[:sinks] *= 100.0
    a[:sinks] *= 30.0
    acc = BoundaryAccumulator(Boundary(2, 4), CalibrationOptions(), needs_of(["refit", "magcomp_refit"]))
    t = lambda v: torch.from_numpy(v).unsqueeze(0)  # noqa: E731  (1, T, ·)
    acc.add(t(x_pre), t(x_post), None, torch.ones(1, tokens, dtype=torch.bool), t(a))
    stats = acc.freeze()
    assert stats.sinks.tokens == sinks and stats.sinks.inner.shape == (sinks, INNER)
    return stats, x_pre, x_post, a


def numpy_refit(a, target, sinks: int, k: int, lam: float):
    """min ‖a_ord B − target_ord‖² + ε‖B‖² with B = 0 on the top-k right singular vectors of the sink rows of a,
    solved in an explicit basis Q of their orthogonal complement."""
    ordinary = slice(sinks, None)
    g = a[ordinary].T @ a[ordinary]
    eps = lam * np.trace(g) / g.shape[0]
    if k:
        u = np.linalg.svd(a[:sinks], full_matrices=False)[2][:k].T  # (I, k)
        q = np.linalg.svd(np.eye(g.shape[0]) - u @ u.T)[0][:, : g.shape[0] - k]  # (I, I − k) spans the complement
    else:
        q = np.eye(g.shape[0])
    small = q.T @ g @ q + eps * np.eye(q.shape[1])
    return q @ np.linalg.solve(small, q.T @ a[ordinary].T @ target[ordinary])


@pytest.mark.parametrize("scaled", [False, True])
def test_every_candidate_equals_the_constrained_least_squares(scaled, gram_block):
    stats, x_pre, x_post, a = synthetic()
    name = "magcomp_refit" if scaled else "refit"
    fit = get_operator(name).fit(stats, FitOptions())
    s = fit.upstream_scale or 1.0
    if scaled:
        assert s == pytest.approx(np.abs(x_post).mean() / np.abs(x_pre).mean(), rel=1e-10)
    target = x_post / s - x_pre
    assert len(fit.candidates) == 2 * 4  # λ in (0.1, 1), k in (0, 1, 2, 4, 8) capped at the 3 sink rows: 0, 1, 2, 3
    for candidate in fit.candidates:
        expected = numpy_refit(a, target, 3, candidate.sink_directions, candidate.ridge_lambda)
        got = candidate.update.double().numpy()
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-5  # float32 storage
        if candidate.sink_directions == 3:  # every sink row of a is left alone
            assert np.abs(a[:3] @ got).max() < 1e-4 * np.abs(a[:3]).max()


@pytest.mark.parametrize("name", ["refit", "magcomp_refit"])
def test_calibration_errors_equal_the_direct_computation(name):
    stats, x_pre, x_post, a = synthetic()
    fit = get_operator(name).fit(stats, FitOptions())
    s = fit.upstream_scale or 1.0
    error = s * (x_pre + a @ fit.update.double().numpy()) - x_post  # (T, C)
    total, ordinary = calibration_errors(fit, stats)
    assert total == pytest.approx(float((error**2).sum()), rel=1e-6)
    assert ordinary == pytest.approx(float((error[3:] ** 2).sum()), rel=1e-6)
    rows = BoundaryMap.of(fit).error_rows(torch.from_numpy(x_pre), None, torch.from_numpy(x_post - x_pre),
                                          torch.from_numpy(a))
    np.testing.assert_allclose(rows.numpy(), error, rtol=1e-4, atol=1e-6 * np.abs(error).max())


def test_heldout_choice_picks_the_candidate_with_the_lowest_measured_error():
    stats, *_ = synthetic()
    provisional = get_operator("refit").fit(stats, FitOptions())
    held, x_pre, x_post, a = synthetic(seed=1)
    errors = []
    for candidate in provisional.candidates:
        rows = BoundaryMap.of(candidate).error_rows(torch.from_numpy(x_pre), None, torch.from_numpy(x_post - x_pre),
                                                    torch.from_numpy(a))
        errors.append(float((rows**2).sum()))
    from ghosted_core.statistics import BoundaryErrors

    dd = float(((x_post - x_pre) ** 2).sum())
    chosen = choose_by_heldout(provisional, [BoundaryErrors(300, 3, e, e, dd, dd) for e in errors])
    best = provisional.candidates[int(np.argmin(errors))]
    assert (chosen.ridge_lambda, chosen.sink_directions) == (best.ridge_lambda, best.sink_directions)
    assert chosen.candidates == () and "held-out" in chosen.notes[-1] and "ridge λ" in chosen.notes[-1]


def test_refit_fold_equals_adding_aB_to_the_mlp_output(tiny_llama):
    """The refit view (W_down + Bᵀ) against the dense block with a hook adding a·B to its down_proj output."""
    plan = PruningPlan(6, (2, 3), "manual")
    stats = collect_stats(tiny_llama, plan.boundaries, make_batches(random_tokens(6, 16), None, 3),
                          CalibrationOptions(quiet=True), get_operator("refit").needs)
    (fit,) = [get_operator("refit").fit(s, FitOptions()) for s in stats]
    view = build_recovered(tiny_llama, plan, VariantSpec("refit", "refit"), [fit])
    b = fit.update.float()
    down = tiny_llama.model.layers[1].mlp.down_proj
    handle = down.register_forward_hook(lambda _m, args, out: out + args[0] @ b)
    ids = random_tokens(2, 10, seed=4)
    try:
        with torch.no_grad():
            expected = build_variant(tiny_llama, plan.removed)(ids).logits
    finally:
        handle.remove()
    with torch.no_grad():
        got = view(ids).logits
        pruned = build_variant(tiny_llama, plan.removed)(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert float((pruned - expected).abs().max()) > 1e-2  # the refit changed something


def test_pipeline_measures_heldout_errors_of_the_refit_directly(tiny_llama):
    """The held-out pass's refit error equals ‖x + aB − y‖² computed here from hidden states and a hook."""
    plan = PruningPlan(6, (2, 3), "manual")
    held = random_tokens(2, 16, seed=7)
    batches = make_batches(random_tokens(12, 16), held, 3)
    options = RunOptions(calibrate=CalibrationOptions(quiet=True, sink_rule="none"))
    (stats,) = collect_stats(tiny_llama, plan.boundaries, batches, options.calibrate, get_operator("refit").needs)
    fit = choose_fit(tiny_llama, get_operator("refit").fit(stats, FitOptions()), batches, options)
    assert fit.candidates == () and "held-out" in fit.notes[-1]
    (measured,) = measure_errors(tiny_llama, [fit], batches, options.calibrate)
    seen = []
    handle = tiny_llama.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            states = tiny_llama(held, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    x, y, a = (t.reshape(-1, t.shape[-1]).double() for t in (states[2], states[4], seen[0]))
    error = x + a @ fit.update.double() - y
    assert measured.error == pytest.approx(float((error**2).sum()), rel=1e-5)
    assert measured.dd == pytest.approx(float(((y - x) ** 2).sum()), rel=1e-9)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stock_exports_of_refits_load_without_ghosted_core(family, tmp_path):
    from fresh_process import assert_same_model, load_in_fresh_process

    model = make_tiny_model(family, tie_word_embeddings=True)
    plan = PruningPlan(6, (0, 2, 3), "manual")  # a cut at block 0 (no block before it) and one inside
    stats = collect_stats(model, plan.boundaries, make_batches(random_tokens(6, 16), None, 3),
                          CalibrationOptions(quiet=True), needs_of(["refit", "magcomp_refit"]))
    folders, views = {}, {}
    for name in ("refit", "magcomp_refit"):
        fits = [get_operator(name).fit(s, FitOptions()) for s in stats]
        assert fits[0].update is None or fits[0].site == "residual"  # block 0: nothing, or the scale alone
        views[name] = build_recovered(model, plan, VariantSpec(name, name), fits)
        result = export_variant(views[name], None, tmp_path / name, mode="stock")
        assert result.mode == "stock" and "down_proj" in result.reason
        folders[name] = result.folder
    ids = random_tokens(2, 12, seed=9)
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=False)
    for name, view in views.items():
        assert_same_model(loaded[name], view, ids)


def test_gemma_gets_no_refit_and_says_why(tiny_gemma):
    plan = PruningPlan(6, (2, 3), "manual")
    (stats,) = collect_stats(tiny_gemma, plan.boundaries, make_batches(random_tokens(4, 12), None, 2),
                             CalibrationOptions(quiet=True), needs_of(["refit", "magcomp_refit"]))
    assert stats.ordinary.ata is None  # nothing I×I was collected where the refit cannot fold
    refit = get_operator("refit").fit(stats, FitOptions())
    assert refit.update is None and "post_feedforward_layernorm" in refit.notes[0]
    scaled = get_operator("magcomp_refit").fit(stats, FitOptions())
    assert scaled.upstream_scale == pytest.approx(get_operator("magcomp").fit(stats, FitOptions()).upstream_scale)
