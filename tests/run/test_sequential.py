"""The sequential fit (`+seq`) with several boundaries, against a hand-built upstream model and numpy.

Boundary k of `ghost+seq` is fitted on X_pre from the model already pruned and recovered upstream
of it (blocks removed, operators of boundaries 0…k−1 applied) and X_post from the dense model.
Here that upstream model is written out block by block, its operators fitted with numpy from
numpy-accumulated float64 moments, and the library's operators must match.
"""

from __future__ import annotations

import numpy as np
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens, run_blocks
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.recovery.operators import FitOptions
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.fitting import build_recovered, fit_variant
from ghosted_core.plan import PruningPlan

EPSILON = 1e-6  # the paper's absolute ridge, as FitOptions() uses


def numpy_ghost(x_pre: np.ndarray, x_post: np.ndarray) -> np.ndarray:
    """M with (XᵀX + εI) M = XᵀΔ from (N, C) float64 rows."""
    delta = x_post - x_pre
    return np.linalg.solve(x_pre.T @ x_pre + EPSILON * np.eye(x_pre.shape[1]), x_pre.T @ delta)


def rows(h: torch.Tensor) -> np.ndarray:
    return h.reshape(-1, h.shape[-1]).double().numpy()  # (B·T, C) float64


def test_ghost_seq_with_three_boundaries_matches_a_hand_built_upstream_model():
    model = make_tiny_model("llama", seed=3)
    blocks = list(model.model.layers)
    plan = PruningPlan(TINY_LAYERS, (1, 3, 5), "manual")  # boundaries 1, 3 and 5 (the last one feeds the final norm)
    assert [(b.start, b.end) for b in plan.boundaries] == [(1, 2), (3, 4), (5, 6)]
    ids = random_tokens(12, 16, seed=11)  # 192 tokens for C = 36
    with torch.no_grad():
        h0 = model.model.embed_tokens(ids)  # (B, T, C) entering block 0
    dense = [h0]  # dense[j] = h_j, the residual stream entering block j
    for block in blocks:
        dense.append(run_blocks(model, dense[-1], [block]))
    with torch.no_grad():  # the hand-written runner reproduces the model itself
        torch.testing.assert_close(model.lm_head(model.model.norm(dense[-1])), model(ids).logits, rtol=1e-5, atol=1e-5)

    # the upstream recovered model, by hand: u is the pruned model's stream where dense block b.start would run
    expected, u = [], dense[1]
    for k, boundary in enumerate(plan.boundaries):
        if k > 0:
            previous = plan.boundaries[k - 1]
            w = torch.from_numpy(np.eye(u.shape[-1]) + expected[-1]).float()  # (C, C) W = I + M, applied in fp32
            u = run_blocks(model, u @ w, blocks[previous.end:boundary.start])  # kept blocks between the runs
        expected.append(numpy_ghost(rows(u), rows(dense[boundary.end])))

    batches = make_batches(ids, None, 4)
    options = RunOptions(calibrate=CalibrationOptions(sink_rule="none", quiet=True), fit=FitOptions(epsilon=EPSILON))
    stats = collect_stats(model, plan.boundaries, batches, options.calibrate)
    (spec,) = parse_variants("ghost+seq")
    fits, _reports = fit_variant(model, plan, spec, stats, batches, options)
    for k, (fit, want) in enumerate(zip(fits, expected)):
        got = fit.update.numpy()
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6, f"boundary {k}"  # measured: 2e-15
    independent, _ = fit_variant(model, plan, parse_variants("ghost")[0], stats, batches, options)
    later = [np.linalg.norm(a.update.numpy() - b.update.numpy()) / np.linalg.norm(b.update.numpy())
             for a, b in zip(fits[1:], independent[1:])]
    assert min(later) > 1e-3  # measured 0.07 and 0.13: the later boundaries really were fitted on the recovered upstream, not the dense model

    recovered = build_recovered(model, plan, spec, fits)  # u is now the stream entering the last run (5)
    w_last = torch.from_numpy(np.eye(u.shape[-1]) + expected[-1]).float()
    with torch.no_grad():
        torch.testing.assert_close(recovered(ids).logits, model.lm_head(model.model.norm(u @ w_last)),
                                   rtol=1e-4, atol=1e-4)
