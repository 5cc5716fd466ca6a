"""The stock-foldable ReplaceMe family: the sink-preserving fit against numpy, its choice of k, and why it exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_tokens
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions, make_batches
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.recovery.assessment import BoundaryMap
from ghosted_core.recovery.operators import FitOptions, choose_by_heldout, get_operator, principal_directions, \
    sink_directions, solve_keeping
from ghosted_core.plan import Boundary
from ghosted_core.statistics import BoundaryErrors, StatNeeds

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


@pytest.mark.parametrize("spilled", [False, True])
def test_principal_directions_are_the_top_eigenvectors_with_weight(spilled):
    """From the rows (SVD) or with a spilled Gram matrix added (eigh): numpy's top eigenvectors of the sum."""
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(3, WIDTH)) * np.array([[50.0], [10.0], [1.0]])  # three sink rows: rank 3
    extra = rng.normal(size=(1, WIDTH)) * 5.0 if spilled else np.zeros((0, WIDTH))
    values, vectors = np.linalg.eigh(rows.T @ rows + extra.T @ extra)
    got = principal_directions(torch.from_numpy(rows), torch.from_numpy(extra.T @ extra) if spilled else None, 5,
                               WIDTH).numpy()
    assert got.shape == (WIDTH, 3 + spilled)  # only the directions that carry weight, even when 5 are allowed
    for j in range(got.shape[1]):
        assert abs(abs(got[:, j] @ vectors[:, -1 - j]) - 1) < 1e-8
    assert principal_directions(None, None, 4, WIDTH).shape == (WIDTH, 0)


def sink_stats(seed: int = 0, sequences: int = 24, length: int = 32, sink_norm: float = 300.0, capacity: int = 256):
    """Statistics of synthetic MLP outputs with a massive-activation token at position 0 of every sequence,
    and held-out rows drawn the same way.

    Ordinary tokens: Δ = m A + noise. The sink's MLP output is huge and along one direction u,
    and the dense model leaves it nearly alone (Δ small): a T ≠ I on u breaks it.
    """
    rng = np.random.default_rng(seed)
    true_update = 0.4 * rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)
    u = rng.normal(size=WIDTH)
    u /= np.linalg.norm(u)
    options = CalibrationOptions(sink_rule="position", sink_positions=1, sink_capacity=capacity)
    acc = BoundaryAccumulator(Boundary(3, 5), options, StatNeeds(branch=True), sequences)

    def draw(n: int):
        m = rng.normal(size=(n, length, WIDTH))
        m[:, 0] = sink_norm * u + rng.normal(size=(n, WIDTH))
        delta = m @ true_update + 0.3 * rng.normal(size=m.shape)
        delta[:, 0] = 0.5 * rng.normal(size=(n, WIDTH))
        return rng.normal(size=m.shape), delta, m

    x_pre, delta, m = draw(sequences)
    acc.add(*(torch.from_numpy(a) for a in (x_pre, x_pre + delta, m)), torch.ones(sequences, length, dtype=torch.bool))
    _x, held_delta, held_m = draw(sequences // 2)
    return acc.freeze(), {"m": held_m.reshape(-1, WIDTH), "delta": held_delta.reshape(-1, WIDTH), "length": length}, u


def measured(fit, held: dict) -> BoundaryErrors:
    """Held-out errors of a fit measured directly on the rows, as `heldout.measure_errors` does."""
    m, d = (torch.from_numpy(held[k]) for k in ("m", "delta"))
    error = BoundaryMap.of(fit).error_rows(torch.zeros_like(m), m, d)  # (T, C)
    per_token, plain = (error**2).sum(-1), (d**2).sum(-1)
    ordinary = torch.arange(m.shape[0]) % held["length"] != 0
    return BoundaryErrors(m.shape[0], int((~ordinary).sum()), float(per_token.sum()), float(per_token[ordinary].sum()),
                          float(plain.sum()), float(plain[ordinary].sum()))


def heldout_error(update: torch.Tensor | None, held: dict) -> float:
    """‖m T − (m + Δ)‖ / ‖Δ‖ on the held-out rows, computed from the rows themselves."""
    a = np.zeros((WIDTH, WIDTH)) if update is None else update.numpy()
    return float(np.linalg.norm(held["m"] @ a - held["delta"]) / np.linalg.norm(held["delta"]))


def test_keepsink_picks_the_count_with_the_lowest_heldout_error_and_preserves_the_sink():
    stats, held, u = sink_stats()
    provisional = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    assert [c.sink_directions for c in provisional.candidates] == [0, 1, 2, 3, 4]
    fit = choose_by_heldout(provisional, [measured(c, held) for c in provisional.candidates])
    assert fit.candidates == () and fit.sink_directions >= 1
    assert f"kept {fit.sink_directions} sink direction(s) as identity (boundary error on held-out" in fit.notes[-1]
    errors = {}
    for k in FitOptions().sink_directions:  # every count on its own, measured on the raw held-out rows
        one = get_operator("replaceme_keepsink").fit(stats, FitOptions(sink_directions=(k,)))
        assert one.sink_directions == k and one.candidates == ()
        errors[k] = heldout_error(one.update, held)
    assert min(errors, key=errors.get) == fit.sink_directions
    assert heldout_error(fit.update, held) == pytest.approx(errors[fit.sink_directions], rel=1e-9)
    kept = sink_directions(stats, fit.sink_directions).numpy()  # (C, k) estimated sink directions
    assert np.abs(kept.T @ fit.update.numpy()).max() < 1e-12  # T = I on them exactly
    assert np.linalg.norm(u @ fit.update.numpy()) < 1e-3 * np.linalg.norm(fit.update.numpy())  # ≈ on the true one
    # k = 0 is ReplaceMe on ordinary tokens: it maps the huge sink output and loses to plain pruning
    assert errors[0] > 1.0 > errors[fit.sink_directions]
    # the paper's ReplaceMe spends itself on the sinks; keepsink beats it on held-out text
    assert heldout_error(get_operator("replaceme").fit(stats, FitOptions()).update, held) > errors[fit.sink_directions]


def test_keepsink_reads_spilled_sinks_too():
    """Sinks beyond the kept rows spill into C×C moments; the directions then come from both."""
    kept, _held, _u = sink_stats(capacity=256)
    spilled, _held, _u = sink_stats(capacity=5)
    assert spilled.sinks.kept == 5 and spilled.sinks.spill is not None
    torch.testing.assert_close(sink_directions(spilled, 2).abs(), sink_directions(kept, 2).abs(), rtol=0, atol=1e-9)
    a = get_operator("replaceme_keepsink").fit(kept, FitOptions(sink_directions=(2,)))
    b = get_operator("replaceme_keepsink").fit(spilled, FitOptions(sink_directions=(2,)))
    torch.testing.assert_close(a.update, b.update, rtol=1e-8, atol=1e-10)


def test_keepsink_without_sinks_is_replaceme_on_ordinary_tokens():
    acc = BoundaryAccumulator(Boundary(3, 5), CalibrationOptions(sink_rule="none"), StatNeeds(branch=True), 8)
    rng = np.random.default_rng(5)
    m = rng.normal(size=(8, 32, WIDTH))
    delta = 0.2 * m + 0.1 * rng.normal(size=m.shape)
    acc.add(torch.zeros(8, 32, WIDTH, dtype=torch.float64), torch.from_numpy(delta), torch.from_numpy(m),
            torch.ones(8, 32, dtype=torch.bool))
    stats = acc.freeze()
    fit = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    reference = get_operator("replaceme").fit(stats, FitOptions())
    assert fit.sink_directions == 0 and fit.candidates == ()  # no sink rows: nothing to choose
    torch.testing.assert_close(fit.update, reference.update, rtol=1e-10, atol=1e-12)
    assert choose_by_heldout(fit, []).update is fit.update


def test_keepsink_in_the_pipeline_keeps_the_candidate_best_on_heldout_activations(tiny_llama):
    """Through `pipeline.choose_fit` (a real held-out pass): the kept count has the lowest error recomputed
    from activations captured on the held-out sequences."""
    from ghosted_core.calibration.collect import collect_stats
    from ghosted_core.run.options import RunOptions
    from ghosted_core.run.fitting import choose_fit

    boundary = Boundary(2, 4)
    ids = random_tokens(6, 16, seed=11)
    batches = make_batches(ids[:4], ids[4:], 2)
    options = RunOptions(calibrate=CalibrationOptions(sink_rule="position", sink_positions=1, quiet=True))
    (stats,) = collect_stats(tiny_llama, [boundary], batches, options.calibrate, StatNeeds(branch=True))
    provisional = get_operator("replaceme_keepsink").fit(stats, FitOptions())
    assert len(provisional.candidates) > 1
    fit = choose_fit(tiny_llama, provisional, batches, options)
    with capture(tiny_llama, {2, 4}, {1}) as seen:
        run_forward(tiny_llama, ids[4:])
    width = tiny_llama.config.hidden_size
    m = seen[("branch", 1)].reshape(-1, width).double().numpy()
    delta = (seen[("residual", 4)] - seen[("residual", 2)]).reshape(-1, width).double().numpy()
    direct = {c.sink_directions: float(np.linalg.norm(m @ c.update.numpy() - delta)) for c in provisional.candidates}
    assert fit.sink_directions == min(direct, key=direct.get)
    assert "held-out" in fit.notes[-1]


def test_sink_direction_counts_are_checked():
    with pytest.raises(GhostedError, match="≥ 0"):
        FitOptions(sink_directions=(-1, 2))
    with pytest.raises(GhostedError):
        FitOptions(sink_directions=())
