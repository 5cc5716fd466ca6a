"""Orthonormal Hadamard matrices for hidden sizes that are not powers of two.

H_C = H_K ⊗ H_{2^m} / √C with C = K·2^m, where H_{2^m} is Sylvester's construction and
H_K comes from Paley's constructions: order q+1 for a prime q ≡ 3 (mod 4) (Paley I) and
order 2(q+1) for a prime q ≡ 1 (mod 4) (Paley II). That covers 12, 20, 28, 36, 44, 60, …,
hence 576 = 36·16, 640 = 20·32, 896 = 28·32, 960 = 60·16, 1536 = 12·128, 3072, 3584, 5120.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ghosted_core.errors import GhostedError

if TYPE_CHECKING:  # torch is imported where the transform runs
    import torch


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = χ(j − i), χ the quadratic character modulo the prime q."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=np.int64)
    i, j = np.meshgrid(np.arange(q), np.arange(q), indexing="ij")
    return chi[(j - i) % q]


def _paley_one(q: int) -> np.ndarray:
    """Order q+1 for a prime q ≡ 3 (mod 4): H = I + S with S skew-symmetric and S Sᵀ = q I."""
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return np.eye(q + 1, dtype=np.int64) + s


def _paley_two(q: int) -> np.ndarray:
    """Order 2(q+1) for a prime q ≡ 1 (mod 4), from the symmetric conference matrix of order q+1."""
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    zero = np.array([[1, -1], [-1, -1]], dtype=np.int64)
    one = np.array([[1, 1], [1, -1]], dtype=np.int64)
    return np.block([[zero if v == 0 else v * one for v in row] for row in c])


@functools.lru_cache(maxsize=None)
def _base_matrix(k: int) -> np.ndarray | None:
    """A ±1 Hadamard matrix of order k (1, 2, or a Paley order), or None if we cannot build one."""
    if k == 1:
        return np.ones((1, 1), dtype=np.int64)
    if k == 2:
        return np.array([[1, 1], [1, -1]], dtype=np.int64)
    if k % 4:
        return None
    if _is_prime(k - 1) and (k - 1) % 4 == 3:
        return _paley_one(k - 1)
    q = k // 2 - 1
    if _is_prime(q) and q % 4 == 1:
        return _paley_two(q)
    return None


def hadamard_factors(size: int) -> tuple[int, int] | None:
    """(K, 2^m) with K·2^m = size and a constructible H_K, smallest K first; None if none exists."""
    power = size & -size  # the largest power of two dividing size
    while power >= 1:
        if _base_matrix(size // power) is not None:
            return size // power, power
        power //= 2
    return None


@functools.lru_cache(maxsize=8)
def hadamard(size: int) -> np.ndarray:
    """Orthonormal Hadamard matrix of order `size` (float64, H Hᵀ = I)."""
    factors = hadamard_factors(size)
    if factors is None:
        raise GhostedError(
            f"no Hadamard matrix of order {size} can be built (need K·2^m with K = 1, 2 or a Paley order); "
            "the rotate operator is unavailable for this hidden size"
        )
    k, power = factors
    matrix = np.kron(_base_matrix(k), _sylvester(power)).astype(np.float64) / np.sqrt(size)
    matrix.setflags(write=False)
    return matrix



def _sylvester(order: int) -> np.ndarray:
    matrix = np.ones((1, 1), dtype=np.int64)
    while matrix.shape[0] < order:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last axis without building H (C×C).

    H = H_K ⊗ H_{2^m} / √C, and Sylvester's H_{2^m} is itself a Kronecker product of smaller
    Sylvester matrices (order ≤ 64), so x is reshaped to one axis per factor and multiplied by
    each small factor in turn. Time O(T·C·(K + 64·log_64 C)) and memory O(T·C) for x of shape
    (T, C), instead of O(T·C²) and a C×C matrix (134 MB at C = 4096 in float64).
    """
    import torch

    size = x.shape[-1]
    factors = hadamard_factors(size)
    if factors is None:
        hadamard(size)  # raises the user-facing explanation
    k, power = factors
    orders = [k] if k > 1 else []
    while power > 1:
        orders.append(min(power, 64))
        power //= orders[-1]
    rows = x.reshape(-1, *orders)  # (T, K, 64, 64, …): channel index in row-major order
    for axis, order in enumerate(orders, start=1):
        small = _base_matrix(order) if axis == 1 and k > 1 else _sylvester(order)
        factor = torch.from_numpy(small.astype(np.float64)).to(x.device, x.dtype)  # (n, n)
        rows = torch.movedim(torch.movedim(rows, axis, -1) @ factor, -1, axis)
    return rows.reshape(x.shape) / float(np.sqrt(size))
