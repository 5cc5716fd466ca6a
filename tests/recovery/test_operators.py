"""Operators: exact linear algebra against numpy, the optimality of ghost, symmetry, fallbacks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from conftest import random_tokens
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions, collect_stats, make_batches
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.recovery.operators import OPERATORS, Fit, FitOptions, get_operator, needs_of, register_operator
from ghosted_core.recovery.assessment import BoundaryMap, antisymmetric_fraction, assess
from ghosted_core.model.modeling_ghosted import ResidualLinear
from ghosted_core.statistics import BoundaryErrors, StatNeeds
from ghosted_core.run.options import VariantSpec
from ghosted_core.run.fitting import build_recovered
from ghosted_core.plan import Boundary, PruningPlan

WIDTH = 12  # a Paley Hadamard order


def synthetic_stats(tokens: int = 400, width: int = WIDTH, seed: int = 0, sinks: int = 0, heldout: bool = True,
                    options: CalibrationOptions = CalibrationOptions()):
    """Statistics of random full-rank activations with a non-symmetric true map, plus the raw arrays."""
    rng = np.random.default_rng(seed)
    x_pre = rng.normal(size=(tokens, width))
    true_map = np.eye(width) + 0.3 * rng.normal(size=(width, width))
    x_post = x_pre @ true_map + 0.2 * rng.normal(size=(tokens, width))
    x_pre[:sinks] *= 100.0  # massive activations
    x_post[:sinks] *= 100.0
    branch = rng.normal(size=(tokens, width))
    acc = BoundaryAccumulator(Boundary(2, 4), options)
    as_t = lambda a: torch.from_numpy(a).unsqueeze(0)  # noqa: E731  (1, T, C)
    acc.add(as_t(x_pre), as_t(x_post), as_t(branch), torch.ones(1, tokens, dtype=torch.bool))
    stats = acc.freeze()
    if heldout:
        held_pre = rng.normal(size=(tokens // 4, width))
        HELD[id(stats)] = (held_pre, held_pre @ true_map, rng.normal(size=held_pre.shape))
    return stats, x_pre, x_post, branch


HELD: dict[int, tuple] = {}  # synthetic held-out rows per statistics object


def heldout_of(fit: Fit, stats) -> BoundaryErrors | None:
    """Held-out errors measured directly on the synthetic held-out rows (no sinks among them)."""
    if id(stats) not in HELD:
        return None
    x, y, m = (torch.from_numpy(a) for a in HELD[id(stats)])
    error = BoundaryMap.of(fit).error_rows(x, m, y - x)
    e, d = float((error**2).sum()), float(((y - x) ** 2).sum())
    return BoundaryErrors(x.shape[0], 0, e, e, d, d)


def test_ghost_equals_numpy_lstsq():
    stats, x_pre, x_post, _ = synthetic_stats()
    fit = get_operator("ghost").fit(stats, FitOptions())
    expected, *_ = np.linalg.lstsq(x_pre, x_post - x_pre, rcond=None)
    got = fit.update.numpy()
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-8


def test_replaceme_equals_numpy_lstsq_on_branch():
    stats, x_pre, x_post, branch = synthetic_stats()
    fit = get_operator("replaceme").fit(stats, FitOptions())
    transform, *_ = np.linalg.lstsq(branch, x_post - x_pre + branch, rcond=None)  # m T ≈ Δ + m
    got = np.eye(WIDTH) + fit.update.numpy()
    assert np.linalg.norm(got - transform) / np.linalg.norm(transform) < 1e-8


def test_diag_and_rotate_match_their_formulas():
    stats, x_pre, x_post, _ = synthetic_stats()
    diag = get_operator("diag").fit(stats, FitOptions())
    expected = np.abs(x_post).mean(0) / np.abs(x_pre).mean(0)
    np.testing.assert_allclose(np.diag(diag.update.numpy()) + 1, expected, rtol=1e-12)
    from ghosted_core.hadamard import hadamard

    h = hadamard(WIDTH)
    rotate = get_operator("rotate").fit(stats, FitOptions())
    scale = np.abs(x_post @ h).mean(0) / np.abs(x_pre @ h).mean(0)
    np.testing.assert_allclose(np.eye(WIDTH) + rotate.update.numpy(), h @ np.diag(scale) @ h.T, atol=1e-12)


@pytest.mark.parametrize("name", ["diag", "rotate"])
def test_linearpatch_operators_are_symmetric(name):
    stats, *_ = synthetic_stats()
    fit = get_operator(name).fit(stats, FitOptions())
    weight = torch.eye(WIDTH, dtype=torch.float64) + fit.update
    assert torch.allclose(weight, weight.T, atol=1e-12)
    assert antisymmetric_fraction(fit.update) < 1e-12


def test_ghost_has_an_antisymmetric_part():
    stats, *_ = synthetic_stats()
    assert antisymmetric_fraction(get_operator("ghost").fit(stats, FitOptions()).update) > 0.3


@pytest.mark.parametrize("name", [n for n in OPERATORS if n != "ghost"])
def test_ghost_beats_every_other_operator_on_calibration_tokens(name):
    stats, *_ = synthetic_stats(sinks=3)
    ghost = assess(get_operator("ghost").fit(stats, FitOptions()), stats)
    other = assess(get_operator(name).fit(stats, FitOptions()), stats)
    assert ghost.fit_error is not None and other.fit_error is not None
    assert ghost.fit_error <= other.fit_error + 1e-9


def test_ghost_is_a_minimum_of_the_calibration_error():
    """Any perturbation of ghost's M raises the all-token error: the normal equations' optimum."""
    stats, *_ = synthetic_stats(sinks=3)
    fit = get_operator("ghost").fit(stats, FitOptions())
    best = assess(fit, stats).fit_error
    rng = np.random.default_rng(1)
    for _ in range(5):
        nudge = torch.from_numpy(1e-3 * rng.normal(size=(WIDTH, WIDTH)))
        moved = Fit("ghost", fit.boundary, "residual", fit.update + nudge)
        assert assess(moved, stats).fit_error > best


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_operator_gives_finite_reports(name):
    stats, *_ = synthetic_stats(sinks=3)
    fit = get_operator(name).fit(stats, FitOptions())
    report = assess(fit, stats, heldout_of(fit, stats))
    assert fit.update is None or torch.isfinite(fit.update).all()
    for value in (report.fit_error, report.fit_error_ordinary, report.heldout_error, report.heldout_error_ordinary):
        assert value is not None and np.isfinite(value) and value >= 0
    assert report.to_json()["operator"] == name


def test_none_has_unit_error():
    stats, *_ = synthetic_stats()
    fit = get_operator("none").fit(stats, FitOptions())
    report = assess(fit, stats, heldout_of(fit, stats))
    assert report.fit_error == pytest.approx(1.0) and report.heldout_error == pytest.approx(1.0)


def test_error_formula_matches_direct_computation():
    stats, x_pre, x_post, branch = synthetic_stats(sinks=2)
    ordinary = slice(2, None)
    for name in ("none", "diag", "rotate", "ghost", "ghost_capped", "ghost_nosink", "replaceme"):
        fit = get_operator(name).fit(stats, FitOptions())
        update = np.zeros((WIDTH, WIDTH)) if fit.update is None else fit.update.numpy()
        if fit.site == "residual":
            error = x_pre @ (np.eye(WIDTH) + update) - x_post
        else:
            error = branch @ update - (x_post - x_pre)  # m (I + A) − (m + Δ)
        delta = x_post - x_pre
        report = assess(fit, stats)
        assert report.fit_error == pytest.approx(np.linalg.norm(error) / np.linalg.norm(delta), rel=1e-9), name
        assert report.fit_error_ordinary == pytest.approx(
            np.linalg.norm(error[ordinary]) / np.linalg.norm(delta[ordinary]), rel=1e-9), name


def test_sink_handling():
    stats, x_pre, x_post, _ = synthetic_stats(sinks=3)
    assert stats.sinks.tokens == 3 and stats.ordinary.tokens == 397 and stats.sinks.kept == 3
    nosink = get_operator("ghost_nosink").fit(stats, FitOptions())
    expected, *_ = np.linalg.lstsq(x_pre[3:], (x_post - x_pre)[3:], rcond=None)
    assert np.linalg.norm(nosink.update.numpy() - expected) / np.linalg.norm(expected) < 1e-8
    assert (nosink.sink_tokens, nosink.sink_handling) == (3, "excluded")
    capped = get_operator("ghost_capped").fit(stats, FitOptions())
    assert (capped.sink_tokens, capped.sink_handling, capped.tokens_used) == (3, "capped", 400)
    # capping = weighted least squares with each sink scaled to the threshold norm
    norms = np.linalg.norm(x_pre, axis=1)
    post_norms = np.linalg.norm(x_post, axis=1)
    lower_median = lambda v: np.sort(v)[(len(v) - 1) // 2]  # noqa: E731  (torch.median's convention)
    threshold = 10.0 * lower_median(norms)
    post_threshold = 10.0 * lower_median(post_norms)
    scale = np.minimum(1.0, np.minimum(threshold / norms, post_threshold / post_norms))[:, None]
    weighted, *_ = np.linalg.lstsq(x_pre * scale, (x_post - x_pre) * scale, rcond=None)
    assert np.linalg.norm(capped.update.numpy() - weighted) / np.linalg.norm(weighted) < 1e-6


def test_rank_deficient_fit_warns_and_falls_back(caplog):
    stats, *_ = synthetic_stats(tokens=8, heldout=False)  # 8 tokens < 12 channels
    with caplog.at_level(logging.WARNING):
        fit = get_operator("ghost").fit(stats, FitOptions())
    assert torch.isfinite(fit.update).all()
    assert fit.ridge > FitOptions().epsilon
    assert fit.notes and "rank-deficient" in fit.notes[0]
    assert any("rank-deficient" in r.message for r in caplog.records)
    report = assess(fit, stats)
    assert report.ridge_fallback and "8 tokens < 12 channels" in report.ridge_fallback
    assert report.to_json()["ridge_fallback"] == report.ridge_fallback
    full = assess(get_operator("ghost").fit(synthetic_stats()[0], FitOptions()), synthetic_stats()[0])
    assert full.ridge_fallback is None


def _gram_with_condition(cond: float, width: int = 64, seed: int = 0) -> torch.Tensor:
    """A symmetric PSD matrix with eigenvalues spread log-evenly from 1e3 down to 1e3 / cond, in a random basis."""
    basis, _ = torch.linalg.qr(torch.randn(width, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    values = torch.logspace(3, 3 - np.log10(cond), width, dtype=torch.float64)
    return (basis * values) @ basis.T


@pytest.mark.parametrize("cond", [1e4, 1e9, 1e11, 1e13, 1e15])
def test_the_cholesky_test_gives_the_eigenvalues_verdict(cond):
    from ghosted_core.recovery.linalg import condition_number, ill_conditioned, largest_eigenvalue

    gram = _gram_with_condition(cond)
    assert largest_eigenvalue(gram) == pytest.approx(1e3, rel=1e-2)  # to about its tolerance: the verdict needs no more
    assert ill_conditioned(gram, 1e12) == (condition_number(gram) > 1e12) == (cond > 1e12)


def test_an_ill_conditioned_fit_falls_back_with_or_without_its_condition_number():
    stats, *_ = synthetic_stats(tokens=400)
    gram = stats.ordinary.xtx.clone()
    gram[:, 0] = gram[:, 1] * (1 + 1e-15)  # two channels the same: singular up to rounding
    gram[0, :] = gram[1, :] * (1 + 1e-15)
    from ghosted_core.recovery.linalg import solve_ridge

    cheap = solve_ridge(gram, stats.ordinary.xtd, 400, FitOptions())
    exact = solve_ridge(gram, stats.ordinary.xtd, 400, FitOptions(condition_number=True))
    assert cheap[1] == exact[1] > FitOptions().epsilon  # the same relative ridge
    torch.testing.assert_close(cheap[0], exact[0], rtol=0, atol=0)
    assert "cond(XᵀX) > 1e+12" in cheap[3][0] and exact[2] > 1e12 and np.isnan(cheap[2])


def test_relative_ridge_option():
    stats, *_ = synthetic_stats()
    fit = get_operator("ghost").fit(stats, FitOptions(ridge="relative", ridge_lambda=1e-3))
    expected = 1e-3 * float(torch.trace(stats.token_set("all").xtx)) / WIDTH
    assert fit.ridge == pytest.approx(expected) and not fit.notes


def test_registry_checks_signatures_and_names():
    with pytest.raises(TypeError):
        @register_operator("broken", paper="-", description="-")
        def broken(stats, options):  # wrong names, no annotations
            return None
    assert "broken" not in OPERATORS
    with pytest.raises(GhostedError, match="unknown operator .nope.; known: none, diag"):
        get_operator("nope")


def test_replaceme_refuses_block_zero_visibly():
    acc = BoundaryAccumulator(Boundary(0, 2), CalibrationOptions())
    x = torch.randn(1, 50, WIDTH, dtype=torch.float64)
    acc.add(x, 2 * x, None, torch.ones(1, 50, dtype=torch.bool))
    fit = get_operator("replaceme").fit(acc.freeze(), FitOptions())
    assert fit.update is None and "block 0" in fit.notes[0]


# ---------------------------------------------------------------- on a real (tiny) model


def _boundary_input(model, layer_index: int, ids: torch.Tensor) -> torch.Tensor:
    with capture(model, [layer_index]) as seen:
        run_forward(model, ids)
    return seen[("residual", layer_index)].double()


@pytest.mark.parametrize("name", list(OPERATORS))
def test_assessed_error_equals_the_recovered_models_error(tiny_model, name):
    """The error computed from streamed moments equals the error of the built variant's own activations."""
    plan = PruningPlan(6, (2, 3), "manual")
    ids = random_tokens(4, 16)
    stats = collect_stats(tiny_model, plan.boundaries, make_batches(ids, None, 2), CalibrationOptions(quiet=True))[0]
    fit = get_operator(name).fit(stats, FitOptions())
    variant = build_recovered(tiny_model, plan, VariantSpec(name, name), [fit])
    h_start = _boundary_input(tiny_model, 2, ids)
    h_end = _boundary_input(tiny_model, 4, ids)
    recovered = _boundary_input(variant, 2, ids)  # variant layer 2 is dense block 4
    direct = float((recovered - h_end).norm() / (h_end - h_start).norm())
    assert assess(fit, stats).fit_error == pytest.approx(direct, rel=1e-4)


def test_replaceme_fold_equals_unfolded_computation(tiny_llama):
    plan = PruningPlan(6, (3, 4), "manual")
    ids = random_tokens(4, 16)
    stats = collect_stats(tiny_llama, plan.boundaries, make_batches(ids, None, 4), CalibrationOptions(quiet=True))[0]
    fit = get_operator("replaceme").fit(stats, FitOptions())
    folded = build_recovered(tiny_llama, plan, VariantSpec("replaceme", "replaceme"), [fit])
    assert isinstance(folded.model.layers[2].mlp.down_proj, torch.nn.Linear)  # folded: no extra module
    block = tiny_llama.model.layers[2]
    transform = torch.eye(fit.update.shape[0], dtype=torch.float64) + fit.update
    from ghosted_core.model.surgery import build_variant

    unfolded = build_variant(tiny_llama, plan.removed,
                             replacements={2: {"mlp": torch.nn.Sequential(block.mlp, ResidualLinear(transform))}})
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, unfolded(ids).logits, rtol=1e-4, atol=1e-4)


def test_replaceme_on_gemma_applies_after_the_post_norm(tiny_gemma):
    plan = PruningPlan(6, (3,), "manual")
    ids = random_tokens(4, 16)
    stats = collect_stats(tiny_gemma, plan.boundaries, make_batches(ids, None, 4), CalibrationOptions(quiet=True))[0]
    fit = get_operator("replaceme").fit(stats, FitOptions())
    variant = build_recovered(tiny_gemma, plan, VariantSpec("replaceme", "replaceme"), [fit])
    replaced = variant.model.layers[2].post_feedforward_layernorm
    assert isinstance(replaced, torch.nn.Sequential)
    assert replaced[0] is tiny_gemma.model.layers[2].post_feedforward_layernorm


def test_fit_is_a_frozen_record():
    fit = Fit("none", Boundary(1, 2), "residual", None)
    with pytest.raises(Exception):
        fit.operator = "ghost"


def test_operators_declare_only_the_statistics_they_read():
    assert needs_of(["none"]) == StatNeeds()
    assert needs_of(["diag", "rotate"]) == StatNeeds(channel=True, rotated=True)
    assert needs_of(["ghost", "ghost_capped", "ghost_nosink"]) == StatNeeds(residual=True)
    assert needs_of(["replaceme"]) == StatNeeds(branch=True)
    stats, *_ = synthetic_stats(options=CalibrationOptions())
    lean = BoundaryAccumulator(Boundary(2, 4), CalibrationOptions(), needs_of(["diag", "ghost"]))
    x = torch.randn(1, 40, WIDTH, dtype=torch.float64)
    lean.add(x, 2 * x, x, torch.ones(1, 40, dtype=torch.bool))
    lean_stats = lean.freeze()
    assert lean_stats.ordinary.mtm is None and lean_stats.rotated is None and lean_stats.channel is not None
    get_operator("ghost").fit(lean_stats, FitOptions())
    with pytest.raises(GhostedError, match="not collected"):
        get_operator("replaceme").fit(lean_stats, FitOptions())


def test_heldout_flag_marks_an_operator_worse_than_pruning():
    stats, *_ = synthetic_stats()
    fit = get_operator("ghost").fit(stats, FitOptions())
    worse = BoundaryErrors(10, 0, error=4.0, error_ordinary=4.0, dd=1.0, dd_ordinary=1.0)
    report = assess(fit, stats, worse)
    assert report.heldout_error == pytest.approx(2.0) and report.heldout_worse_than_pruning
    assert "worse than plain pruning on held-out calibration text" in report.to_json()["flags"]
    better = assess(fit, stats, BoundaryErrors(10, 0, 0.25, 0.25, 1.0, 1.0))
    assert not better.heldout_worse_than_pruning and better.to_json()["flags"] == []


def test_ghost_reports_the_singular_values_numpy_finds():
    stats, *_ = synthetic_stats()
    fit = get_operator("ghost").fit(stats, FitOptions())
    reported = np.array(assess(fit, stats).singular_values)
    exact = np.linalg.svd(fit.update.double().numpy(), compute_uv=False)
    assert reported.shape == exact.shape and np.all(np.diff(reported) <= 0)
    np.testing.assert_allclose(reported, exact, rtol=0, atol=1e-8 * exact[0])


@pytest.mark.parametrize("name", ["diag", "rotate"])
def test_scale_fits_report_the_singular_values_of_their_matrix(name):
    stats, *_ = synthetic_stats()
    fit = get_operator(name).fit(stats, FitOptions())
    report = assess(fit, stats)
    np.testing.assert_allclose(report.singular_values, torch.linalg.svdvals(fit.update).numpy(), atol=1e-12)
    assert report.antisym_fraction == pytest.approx(antisymmetric_fraction(fit.update), abs=1e-12)
