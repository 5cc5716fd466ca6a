"""The stock-foldable ReplaceMe family: the sink-preserving fit against numpy, its choice of k, and why it exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_tokens
from ghosted_core.calibration import BoundaryAccumulator, CalibrationOptions, capture, make_batches, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.operators import FitOptions, get_operator, relative_error, sink_branch_gram, sink_directions, \
    solve_keeping
from ghosted_core.plan import Boundary

WIDTH = 24


def test_solve_keeping_equals_the_least_squares_in_the_complement_basis():
    """Against numpy: A = Q (QᵀGQ + εI)⁻¹ QᵀR with Q an orthonormal basis of range(I − UUᵀ)."""
    rng = np.random.default_rng(1)
    m = rng.normal(size=(600, WIDTH))
    delta = m @ (0.3 * rng.normal(size=(WIDTH, WIDTH))) + 0.1 * rng.normal(size=(600, WIDTH))
    keep, _ = np.linalg.qr(rng.normal(size=(WIDTH, 3)))  # (C, k) orthonormal
    eps = FitOptions().epsilon
    full, _ = np.linalg.qr(np.concatenate([keep, rng.normal(size=(WIDTH, WIDTH - 3))], axis=1))
    q = full[:, 3:]  # (C, C−k), orthogonal to keep
    expected = q @ np.linalg.solve(q.T @ m.T @ m @ q + eps * np.eye(WIDTH - 3), q.T @ m.T @ delta)
    update, used_eps, _cond, _notes = solve_keeping(torch.from_numpy(m.T @ m), torch.from_numpy(m.T @ delta),
                                                    torch.from_numpy(keep), 600, FitOptions())
    assert used_eps == eps
    got = update.numpy()
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-10
    transform = np.eye(WIDTH) + got
    assert np.abs(keep.T @ transform - keep.T).max() < 1e-12  # u T = u on every kept direction


def test_sink_directions_are_the_top_eigenvectors_with_weight():
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(3, WIDTH)) * np.array([[50.0], [10.0], [1.0]])  # three sink rows: rank 3
    gram = rows.T @ rows
    values, vectors = np.linalg.eigh(gram)
    got = sink_directions(torch.from_numpy(gram), 5).numpy()
    assert got.shape == (WIDTH, 3)  # only the directions that carry weight, even when 5 are allowed
    for j in range(3):
        assert abs(abs(got[:, j] @ vectors[:, -1 - j]) - 1) < 1e-10
    assert sink_directions(torch.zeros(WIDTH, WIDTH, dtype=torch.float64), 4).shape == (WIDTH, 0)


def sink_stats(seed: int = 0, sequences: int = 24, length: int = 32, sink_norm: float = 300.0):
    """Statistics of synthetic MLP outputs with a massive-activation token at position 0 of every sequence.

    Ordinary tokens: Δ = m A + noise. The sink's MLP output is huge and along one direction u,
    and the dense model leaves it nearly alone (Δ small): a T ≠ I on u breaks it.
    """
    rng = np.random.default_rng(seed)
    true_update = 0.4 * rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)
    u = rng.normal(size=WIDTH)
    u /= np.linalg.norm(u)
    acc = BoundaryAccumulator(Boundary(3, 5), CalibrationOptions(sink_rule="position", sink_positions=1))
    held = {}
    for heldout in (False, True):
        n = sequences if not heldout else sequences // 2
        m = rng.normal(size=(n, length, WIDTH))
        m[:, 0] = sink_norm * u + rng.normal(size=(n, WIDTH))
        delta = m @ true_update + 0.3 * rng.normal(size=m.shape)
        delta[:, 0] = 0.5 * rng.normal(size=(n, WIDTH))
        x_pre = rng.normal(size=m.shape)
        acc.add(*(torch.from_numpy(a) for a in (x_pre, x_pre + delta, m)), torch.ones(n, length, dtype=torch.bool), heldout)
        if heldout:
            held = {"m": m.reshape(-1, WIDTH), "delta": delta.reshape(-1, WIDTH)}
    return acc.freeze(), held, u


def heldout_error(update: torch.Tensor | None, held: dict) -> float:
    """‖m T − (m + Δ)‖ / ‖Δ‖ on the held-out rows, computed from the rows themselves."""
    a = np.zeros((WIDTH, WIDTH)) if update is None else update.numpy()
    return float(np.linalg.norm(held["m"] @ a - held["delta"]) / np.linalg.norm(held["delta"]))


def test_keepsink_picks_the_count_with_the_lowest_heldout_error_and_preserves_the_sink():
    stats, held, u = sink_stats()
    fit = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    assert fit.sink_directions >= 1 and any(f"kept {fit.sink_directions} sink direction" in n for n in fit.notes)
    errors = {}
    for k in FitOptions().sink_directions:  # every candidate, refitted and measured on the raw held-out rows
        one = get_operator("replaceme_keepsink").fit(stats, FitOptions(sink_directions=(k,)))
        errors[one.sink_directions] = heldout_error(one.update, held)
    assert min(errors, key=errors.get) == fit.sink_directions
    assert heldout_error(fit.update, held) == pytest.approx(errors[fit.sink_directions], rel=1e-9)
    kept = sink_directions(sink_branch_gram(stats), fit.sink_directions).numpy()  # (C, k) estimated sink directions
    assert np.abs(kept.T @ fit.update.numpy()).max() < 1e-12  # T = I on them exactly
    assert np.linalg.norm(u @ fit.update.numpy()) < 1e-3 * np.linalg.norm(fit.update.numpy())  # ≈ on the true one
    # k = 0 is ReplaceMe on ordinary tokens: it maps the huge sink output and loses to plain pruning
    assert errors[0] > 1.0 > errors[fit.sink_directions]
    # the paper's ReplaceMe spends itself on the sinks; keepsink beats it on held-out text
    assert heldout_error(get_operator("replaceme").fit(stats, FitOptions()).update, held) > errors[fit.sink_directions]


def test_keepsink_without_sinks_is_replaceme_on_ordinary_tokens():
    stats, _held, _u = sink_stats()
    plain = BoundaryAccumulator(Boundary(3, 5), CalibrationOptions(sink_rule="none"))
    rng = np.random.default_rng(5)
    m = rng.normal(size=(8, 32, WIDTH))
    delta = 0.2 * m + 0.1 * rng.normal(size=m.shape)
    plain.add(torch.zeros_like(torch.from_numpy(m)), torch.from_numpy(delta), torch.from_numpy(m),
              torch.ones(8, 32, dtype=torch.bool), False)
    stats = plain.freeze()
    fit = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    reference = get_operator("replaceme").fit(stats, FitOptions())
    assert fit.sink_directions == 0
    torch.testing.assert_close(fit.update, reference.update, rtol=1e-10, atol=1e-12)
    assert "calibration tokens" in fit.notes[-1]  # nothing held out: judged on calibration tokens, and says so


def test_replaceme_capped_equals_numpy_weighted_least_squares():
    stats, _held, _u = sink_stats(sequences=8)
    fit = get_operator("replaceme_capped").fit(stats, FitOptions())
    capped = stats.fit_ordinary + stats.fit_sink_capped
    expected = np.linalg.solve(capped.mtm.numpy() + 1e-6 * np.eye(WIDTH), capped.mtd.numpy())
    assert np.linalg.norm(fit.update.numpy() - expected) / np.linalg.norm(expected) < 1e-10
    assert fit.sink_handling == "capped" and fit.sink_tokens == 8


def test_keepsink_on_a_model_matches_the_activations(tiny_llama):
    """On a real forward pass: the chosen T's error on held-out tokens, recomputed from captured activations."""
    from ghosted_core.calibration import collect_stats

    boundary = Boundary(2, 4)
    ids = random_tokens(6, 16, seed=11)
    batches = make_batches(ids[:4], ids[4:], 2)
    options = CalibrationOptions(sink_rule="position", sink_positions=1, quiet=True)
    (stats,) = collect_stats(tiny_llama, [boundary], batches, options)
    fit = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    with capture(tiny_llama, {2, 4}, {1}) as seen:
        run_forward(tiny_llama, ids[4:])
    m = seen[("branch", 1)].reshape(-1, tiny_llama.config.hidden_size).double().numpy()
    delta = (seen[("residual", 4)] - seen[("residual", 2)]).reshape(-1, tiny_llama.config.hidden_size).double().numpy()
    direct = float(np.linalg.norm(m @ fit.update.numpy() - delta) / np.linalg.norm(delta))
    assert direct == pytest.approx(relative_error(fit, stats.heldout), rel=1e-6)


def test_sink_direction_counts_are_checked():
    with pytest.raises(GhostedError, match="≥ 0"):
        FitOptions(sink_directions=(-1, 2))
    with pytest.raises(GhostedError):
        FitOptions(sink_directions=())
