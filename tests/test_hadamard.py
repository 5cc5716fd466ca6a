"""Hadamard matrices for every hidden size we support."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard, hadamard_factors, hadamard_transform, linearpatch_equal

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


@pytest.mark.parametrize("size, factors", [(576, (36, 16)), (640, (40, 16)), (896, (28, 32)), (960, (60, 16)),
                                           (1536, (12, 128)), (2560, (40, 64)), (3072, (12, 256)),
                                           (3584, (28, 128)), (5120, (40, 128)), (8192, (1, 8192))])
def test_factorisation_is_linearpatchs_choice(size, factors):
    """LinearPatch's get_hadK order: 40 before 20 (640 = 40·16), each core order with a power-of-two quotient."""
    assert hadamard_factors(size) == factors
    assert linearpatch_equal(size)


@pytest.mark.parametrize("size, factors", [(704, (44, 16)), (832, (104, 8)), (20, (20, 1)), (12, (12, 1))])
def test_widths_linearpatch_cannot_build_fall_back_to_the_smallest_paley_core(size, factors):
    """44·16: no LinearPatch table; 52·16: theirs is a Williamson matrix we do not build, so Paley I of 104."""
    assert hadamard_factors(size) == factors
    assert linearpatch_equal(size) == (size in (12, 20))


def test_paley_two_is_in_blocks_and_symmetric():
    """Order 2(q+1) as [[C+I, C−I], [C−I, −C−I]]: symmetric, its first row all +1 but at position q+1."""
    h = np.sign(hadamard(36)).astype(int)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_array_equal(h[0], np.where(np.arange(36) == 18, -1, 1))


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
