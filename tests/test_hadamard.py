"""Hadamard matrices for every hidden size we support."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard, hadamard_factors, hadamard_transform

SIZES = [576, 640, 896, 960, 1536, 2048, 3072, 3584, 4096, 5120, 8192]


@pytest.mark.parametrize("size", SIZES + [12, 20, 28, 36, 44, 60])
def test_orthonormal_with_plus_minus_entries(size):
    h = hadamard(size)
    assert h.shape == (size, size)
    np.testing.assert_allclose(np.abs(h) * np.sqrt(size), 1.0, rtol=1e-12)
    signs = np.sign(h)
    if size <= 2048:  # ±1: S Sᵀ sums integers below 2²⁴, exact in float32 (half float64's time)
        signs = signs.astype(np.float32)
        np.testing.assert_array_equal(signs @ signs.T, size * np.eye(size, dtype=np.float32))
    else:  # Freivalds: S (Sᵀ V) = n V for 64 random 0/1 columns V, exact integers in float64; a wrong S Sᵀ passes
        # with probability at most 2⁻⁶⁴, at n²·64 multiply-adds instead of n³ (8192: 19 s of the suite's time)
        probes = np.random.default_rng(size).integers(0, 2, (size, 64)).astype(np.float64)
        np.testing.assert_array_equal(signs @ (signs.T @ probes), size * probes)


@pytest.mark.parametrize("size, factors", [(576, (36, 16)), (640, (20, 32)), (896, (28, 32)), (960, (60, 16)),
                                           (1536, (12, 128)), (3072, (12, 256)), (3584, (28, 128)),
                                           (5120, (20, 256)), (8192, (1, 8192))])
def test_factorisation_prefers_the_largest_power_of_two(size, factors):
    assert hadamard_factors(size) == factors


def test_impossible_order_is_a_clear_error():
    assert hadamard_factors(100) is None
    with pytest.raises(GhostedError, match="rotate operator is unavailable"):
        hadamard(100)


@pytest.mark.parametrize("size", [12, 36, 576, 640, 896, 2048, 3584, 8192])
def test_fast_transform_equals_the_matrix_product(size):
    """hadamard_transform(x) = x H without building H (Kronecker factors of order ≤ 64)."""
    x = torch.randn(3, size, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
    expected = x.numpy() @ hadamard(size)
    np.testing.assert_allclose(hadamard_transform(x).numpy(), expected, atol=1e-12)
