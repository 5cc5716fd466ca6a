"""Orthonormal Hadamard matrices for hidden sizes that are not powers of two, built as LinearPatch builds them.

H_C = H_K ⊗ H_{2^m} / √C with C = K·2^m, where H_{2^m} is Sylvester's construction and the
core H_K comes from Paley's constructions: order q+1 for a prime q ≡ 3 (mod 4) (Paley I,
I + S with S the bordered Jacobsthal matrix) and order 2(q+1) for a prime q ≡ 1 (mod 4)
(Paley II, [[C+I, C−I], [C−I, −C−I]] with C the symmetric conference matrix).

Another valid Hadamard matrix is another rotation, so LinearPatch-R is only reproduced with
the authors' own H. Their code (rotate_utils/hadamard_utils.py, after QuaRot and QuIP#) keeps
core tables from Sloane's library and picks the first of the orders in `LINEARPATCH_CORES`
that divides C with a power-of-two quotient. Every one of those tables we can build is the
construction above at that order (40 = H_2 ⊗ the Paley I of 20), checked entry by entry against
their matrices at 576, 640, 896, 960, 1536, 1728, 2560, 3584, 4480 and 5120. Their 52, 156 and
172 are Williamson matrices we do not build: a width whose odd part is 13, 39 or 43 falls back to
a Paley core of another order (`linearpatch_equal` says False there), as does any width their
list does not cover (44·2^m, 68·2^m, …).
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
    """Order 2(q+1) for a prime q ≡ 1 (mod 4): [[C+I, C−I], [C−I, −C−I]], C the symmetric conference
    matrix of order q+1 (C Cᵀ = q I, zero diagonal), in blocks as Sloane's had.2(q+1).pal2 tables are."""
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    eye = np.eye(q + 1, dtype=np.int64)
    return np.block([[c + eye, c - eye], [c - eye, -c - eye]])


SYLVESTER_2 = np.array([[1, 1], [1, -1]], dtype=np.int64)

# LinearPatch's core orders in the order its get_hadK tries them (first that divides C with a power-of-two quotient)
LINEARPATCH_CORES = (172, 156, 140, 108, 60, 52, 36, 28, 40, 20, 12)


@functools.lru_cache(maxsize=None)
def _base_matrix(k: int) -> np.ndarray | None:
    """A ±1 Hadamard matrix of order k (1, 2, 40 = H_2 ⊗ H_20, or a Paley order), or None if we cannot build one."""
    if k == 1:
        return np.ones((1, 1), dtype=np.int64)
    if k == 2:
        return SYLVESTER_2
    if k % 4:
        return None
    if _is_prime(k - 1) and (k - 1) % 4 == 3:
        return _paley_one(k - 1)
    q = k // 2 - 1
    if _is_prime(q) and q % 4 == 1:
        return _paley_two(q)
    if k == 40:  # LinearPatch's had40: H_2 ⊗ its had20, itself the Paley I of order 20
        return np.kron(SYLVESTER_2, _paley_one(19))
    return None


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _linearpatch_order(size: int) -> int | None:
    """The core order LinearPatch's code picks for `size` (1 for a power of two; None where its list has none)."""
    if _is_power_of_two(size):
        return 1
    return next((k for k in LINEARPATCH_CORES if size % k == 0 and _is_power_of_two(size // k)), None)


def linearpatch_equal(size: int) -> bool:
    """Whether `hadamard(size)` is the matrix LinearPatch's code builds at this width (see the module docstring)."""
    k = _linearpatch_order(size)
    return k is not None and _base_matrix(k) is not None


def hadamard_factors(size: int) -> tuple[int, int] | None:
    """(K, 2^m) with K·2^m = size: LinearPatch's choice where we can build its core, else the constructible
    H_K with the smallest K; None if none exists."""
    if linearpatch_equal(size):
        k = _linearpatch_order(size)
        return k, size // k
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
