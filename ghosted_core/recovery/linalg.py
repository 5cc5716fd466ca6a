"""Linear algebra shared by the fits that hold a map to the identity on the sink tokens' directions.

Both ReplaceMe's sink-preserving fit (C×C, on the MLP output m) and the down_proj refit (I×C, on
the MLP's intermediate a) solve a ridge least squares whose solution must vanish on the span U of
the sink tokens' rows: `principal_directions` finds U, `projected_normal_equations` builds the
normal equations restricted to the complement of U. Also the ridge solve every least-squares fit
uses (`solve_ridge`, with its Cholesky conditioning test and relative-ridge fallback).
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch

from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)


class RidgeSettings(Protocol):
    """What `solve_ridge` reads of the fit options (`recovery.operators.FitOptions` has them all)."""

    epsilon: float
    ridge: str  # "absolute" (ε, with the fallback) or "relative"
    ridge_lambda: float
    max_condition: float
    condition_number: bool


def principal_directions(rows: torch.Tensor | None, extra_gram: torch.Tensor | None, count: int,
                         width: int) -> torch.Tensor:
    """(W, k) orthonormal top eigenvectors of rowsᵀrows (+ extra_gram), k ≤ count, only those with weight.

    From the rows alone: an SVD of the (n, W) rows, O(n²·W) time, O(n·W) memory. With a W×W
    extra Gram matrix (sinks that spilled past the kept rows): one eigendecomposition, O(W³).
    """
    if extra_gram is None:
        if rows is None or rows.shape[0] == 0:
            return torch.zeros(width, 0, dtype=torch.float64)
        _, values, vh = torch.linalg.svd(rows, full_matrices=False)  # descending
        weights, vectors = values * values, vh.T  # (n,), (W, n)
    else:
        gram = extra_gram if rows is None else extra_gram + rows.T @ rows  # (W, W)
        weights, vectors = torch.linalg.eigh(gram)  # ascending
        weights, vectors = weights.flip(0), vectors.flip(1)
    top = float(weights[0]) if weights.numel() else 0.0
    useful = int((weights > top * 1e-9).sum()) if top > 0 else 0
    return vectors[:, : min(count, useful)]


def projected_normal_equations(gram: torch.Tensor, cross: torch.Tensor,
                               keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(PGP + c·UUᵀ, PR) with P = I − UUᵀ, U = `keep` (W, k) orthonormal, c = tr(G)/W.

    Solving (PGP + c·UUᵀ + εI) A = PR gives the A = P·Ã minimizing ‖u P Ã − target‖² + ε‖Ã‖²:
    in the basis [Q U], Q spanning range(P), the U block is invertible (c > 0) and its right-hand
    side is 0, so UᵀA = 0. Built in place by rank-k updates, so that no W×W temporary exists beside
    the result. Memory: one W×W and one W×C float64 matrix (plus (W, k) ones); time O(W²·k).
    """
    gu = gram @ keep  # (W, k) G U
    pgp = gram.clone()  # (W, W): the one W×W allocation
    pgp.addmm_(keep, gu.T, alpha=-1.0)  # − U Uᵀ G
    pgp.addmm_(gu, keep.T, alpha=-1.0)  # − G U Uᵀ
    pgp.addmm_(keep @ (keep.T @ gu), keep.T)  # + U (Uᵀ G U) Uᵀ
    pgp.addmm_(keep, keep.T, alpha=float(torch.trace(gram)) / gram.shape[0])  # c·UUᵀ: U block invertible
    rhs = cross.clone()  # (W, C) P R
    rhs.addmm_(keep, keep.T @ cross, alpha=-1.0)
    return pgp, rhs


def factor_solve(factor: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(L Lᵀ)⁻¹ rhs from a lower Cholesky factor L by two triangular solves.

    The same numbers as `torch.cholesky_solve`, which copies the W×W factor first (+W²·8 B measured
    at W = 2500); these read it in place. Memory: two W×C matrices (the intermediate and the result).
    """
    half = torch.linalg.solve_triangular(factor, rhs, upper=False)  # (W, C) L⁻¹ rhs
    return torch.linalg.solve_triangular(factor.mT, half, upper=True)  # (W, C) L⁻ᵀ L⁻¹ rhs


def condition_number(gram: torch.Tensor) -> float:
    """λ_max / λ_min of a symmetric PSD matrix (inf when singular)."""
    eig = torch.linalg.eigvalsh(gram)
    low, high = float(eig[0]), float(eig[-1])
    return math.inf if low <= high * 1e-18 else high / low


def largest_eigenvalue(gram: torch.Tensor, iterations: int = 30, tolerance: float = 1e-3) -> float:
    """λ_max of a symmetric PSD matrix by power iteration, to about `tolerance` (O(C²) per step, each a pass over
    the matrix: 30 steps take ~0.4 s at C = 4096; a sink-dominated Gram converges in a few). Enough for the
    conditioning test, whose verdict moves by that share of the limit."""
    v = torch.ones(gram.shape[0], dtype=gram.dtype, device=gram.device)
    value = 0.0
    for _ in range(iterations):
        w = gram @ v  # (C,)
        norm = float(w.norm())
        if norm == 0.0:
            return 0.0
        v, previous, value = w / norm, value, norm
        if abs(value - previous) <= tolerance * value:
            break
    return value


def ill_conditioned(gram: torch.Tensor, limit: float) -> bool:
    """cond(gram) > limit, without its eigenvalues: gram − (λ_max / limit)·I is not positive definite
    (one Cholesky, O(C³/3); the same verdict as λ_max/λ_min up to rounding near the limit)."""
    shifted = gram.clone()  # (C, C)
    shifted.diagonal().sub_(largest_eigenvalue(gram) / limit)
    _, info = torch.linalg.cholesky_ex(shifted)
    return int(info) != 0


RIDGE_FALLBACK = "rank-deficient fit"  # how a ridge-fallback note starts (FitReport.ridge_fallback finds it)


def solve_ridge(gram: torch.Tensor, cross: torch.Tensor, tokens: int, opts: RidgeSettings) -> tuple[torch.Tensor, float, float, tuple[str, ...]]:
    """(A, ε, cond, notes) with (gram + εI) A = cross; falls back to a relative ridge when the
    fit is rank-deficient (fewer tokens than channels) or ill-conditioned, never NaN.

    cond is NaN unless `opts.condition_number` asks for it. Time: a Cholesky test and a Cholesky
    solve, O(C³); memory: three C×C float64 matrices beyond gram and cross at once (the regularized copy and
    its factor; then the factor, the triangular solve's intermediate and A).
    """
    width = gram.shape[0]
    cond = condition_number(gram) if opts.condition_number else math.nan
    relative = opts.ridge_lambda * float(torch.trace(gram)) / width
    notes: tuple[str, ...] = ()
    if opts.ridge == "relative":
        eps = relative
    elif tokens < width or (cond > opts.max_condition if opts.condition_number
                            else ill_conditioned(gram, opts.max_condition)):
        eps = relative
        reason = f"{tokens} tokens < {width} channels" if tokens < width else \
            f"cond(XᵀX) = {cond:.2g}" if opts.condition_number else f"cond(XᵀX) > {opts.max_condition:.0e}"
        notes = (f"{RIDGE_FALLBACK} ({reason}): used a relative ridge ε = {opts.ridge_lambda:g}·tr(XᵀX)/C "
                 f"= {eps:.3g} instead of ε = {opts.epsilon:g}",)
        log.warning(notes[0])
    else:
        eps = opts.epsilon
    if not math.isfinite(eps) or eps <= 0:
        eps = opts.epsilon
    regularized = gram.clone()  # (C, C): one copy, the statistics stay as they are
    regularized.diagonal().add_(eps)
    factor, info = torch.linalg.cholesky_ex(regularized)  # (C, C)
    if int(info) == 0:
        del regularized  # the factor is all the solve needs
        update = factor_solve(factor, cross)  # (C, C), read from the factor in place
    else:
        update = torch.linalg.solve(regularized, cross)
        del regularized
    del factor
    if not torch.isfinite(update).all():
        raise GhostedError("the least-squares fit produced non-finite values; use more calibration text or --ridge relative")
    return update, eps, cond, notes
