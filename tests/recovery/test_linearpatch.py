"""diag and rotate as the LinearPatch authors compute them, against their own code's output.

`linearpatch_reference.npz` holds what LinearPatch's `get_scale_params` and
`generate_symmetric_matrix` gave on the seeded windows of `linearpatch_reference.py` (see there
how it was made): the per-window mean of mean|X_post| / mean|X_pre|, in the channel basis and in
their Hadamard basis, and W = H diag(r) Hᵀ applied to two probe vectors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import linearpatch_reference as ref
from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions
from ghosted_core.hadamard import hadamard, linearpatch_equal
from ghosted_core.plan import Boundary
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.statistics import StatNeeds

REFERENCE = np.load(Path(__file__).with_name("linearpatch_reference.npz"))
BATCH = 16  # windows per calibration batch: the per-window rule must not depend on how windows are batched


@pytest.fixture(scope="module", params=ref.WIDTHS)
def stats(request):
    width = request.param
    x_pre, x_post = ref.windows(width)
    acc = BoundaryAccumulator(Boundary(3, 2), CalibrationOptions(), StatNeeds(channel=True, rotated=True))
    for lo in range(0, ref.WINDOWS, BATCH):
        acc.add(torch.from_numpy(x_pre[lo:lo + BATCH]), torch.from_numpy(x_post[lo:lo + BATCH]), None,
                torch.ones(min(BATCH, ref.WINDOWS - lo), ref.TOKENS, dtype=torch.bool))
    return width, acc.freeze(), x_pre, x_post


def test_diag_is_the_authors_per_window_scale(stats):
    width, boundary_stats, *_ = stats
    fit = get_operator("diag").fit(boundary_stats, FitOptions())
    np.testing.assert_allclose(fit.scale.numpy(), REFERENCE[f"diag_{width}"], rtol=1e-10)


def test_rotate_is_the_authors_rotation(stats):
    width, boundary_stats, *_ = stats
    assert linearpatch_equal(width)
    fit = get_operator("rotate").fit(boundary_stats, FitOptions())
    np.testing.assert_allclose(fit.scale.numpy(), REFERENCE[f"rotate_{width}"], rtol=1e-8)  # their √C is float32
    weight = np.eye(width) + fit.update.numpy()
    np.testing.assert_allclose(ref.probes(width) @ weight, REFERENCE[f"rotate_probes_{width}"], rtol=1e-7, atol=1e-7)


def test_pooled_variants_pool_every_token(stats):
    """diag_pooled and rotate_pooled: Σ|x_post| / Σ|x_pre| over all tokens, which differs from the per-window mean."""
    width, boundary_stats, x_pre, x_post = stats
    x, y = x_pre.reshape(-1, width), x_post.reshape(-1, width)
    pooled = np.abs(y).sum(0) / np.abs(x).sum(0)
    np.testing.assert_allclose(get_operator("diag_pooled").fit(boundary_stats, FitOptions()).scale.numpy(), pooled,
                               rtol=1e-10)
    h = hadamard(width)
    rotated = np.abs(y @ h).sum(0) / np.abs(x @ h).sum(0)
    fit = get_operator("rotate_pooled").fit(boundary_stats, FitOptions())
    np.testing.assert_allclose(np.eye(width) + fit.update.numpy(), h @ np.diag(rotated) @ h.T, atol=1e-10)
    assert np.abs(pooled / REFERENCE[f"diag_{width}"] - 1).max() > 0.05  # the two rules really differ here
