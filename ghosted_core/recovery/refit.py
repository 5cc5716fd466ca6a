"""The down_proj refit: a stock fold on the intermediate activations of the block before a cut.

ReplaceMe's map T acts on block s−1's MLP output m (C features). That MLP's down_proj reads the
intermediate activation a (I features, I ≈ 3–4·C) with m = a W_downᵀ, and any change B (I×C) of
it stays a stock checkpoint: W_down' = W_down + Bᵀ. The refit fits x_pre + aB ≈ x_post, i.e.
aB ≈ Δ, on ordinary tokens, held to zero on the span U of the sink tokens' rows of a (the
sink-preserving idea of `replaceme_keepsink`: any change of the sink token's massive output breaks
the sink for every block after), with a relative ridge ε = λ·tr(aᵀa)/I:

    (P aᵀa P + c·UUᵀ + εI) B = P aᵀΔ,   P = I − UUᵀ   (`linalg.projected_normal_equations`)

With the magnitude compensation upstream (`magcomp_refit`), the stream entering the cut is
s·(x_pre + aB), so the target becomes X_post/s − X_pre, whose cross moment is
aᵀΔ/s − (1 − 1/s)·aᵀX_pre. One solution per (λ, k) pair; the pipeline keeps the one with the
lowest held-out boundary error. Memory: the statistics (I² + I·C)·8 B (+ I·C·8 B with a scale);
at fit time two I×I float64 matrices (the working normal equations, built in place, and their
Cholesky factor; nothing else of size I² is alive), three I×C float64 at most and one float32
I×C update per candidate (`memory_parts.refit_solve_bytes`); time O(I³/3) (one Cholesky
factorization) per candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ghosted_core.errors import GhostedError
from ghosted_core.recovery.linalg import factor_solve, principal_directions, projected_normal_equations
from ghosted_core.statistics import BoundaryStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitSolution:
    """One candidate: the change B of down_proj (as W_down' = W_down + Bᵀ) for one ridge and sink count."""

    update: torch.Tensor  # (I, C) float32 B
    ridge_lambda: float  # λ of the relative ridge
    epsilon: float  # ε = λ·tr(aᵀa)/I actually added
    sink_directions: int  # k: sink directions of a on which B is zero


def refit_cross(stats: BoundaryStats, scale: float | None) -> torch.Tensor:
    """(I, C) aᵀ(target) over ordinary tokens: aᵀΔ, or aᵀ(X_post/s − X_pre) with an upstream scale s."""
    ordinary = stats.ordinary
    if scale is None or scale == 1.0:
        return ordinary.atd
    if ordinary.atx is None:
        raise GhostedError(f"boundary {stats.boundary}: a scaled refit needs aᵀX_pre, which was not collected "
                           f"(statistics asked for: {stats.needs.describe()})")
    cross = ordinary.atd / scale  # (I, C): the one new matrix
    return cross.add_(ordinary.atx, alpha=-(1.0 - 1.0 / scale))


def sink_inner_directions(stats: BoundaryStats, count: int) -> torch.Tensor:
    """(I, k) top directions of the sink tokens' rows of a (kept rows, plus the spilled ones' Gram)."""
    sinks = stats.sinks
    return principal_directions(sinks.inner, sinks.inner_spill, count, stats.ordinary.ata.shape[0])


def _solve(work: torch.Tensor, rhs: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(work + εI)⁻¹ rhs by a Cholesky factorization (a general solve if it is not positive definite).

    `work` is the caller's own copy: its diagonal is shifted by ε in place and restored exactly
    afterwards, so a solve needs only the factor beside it (one more I×I), never a regularized clone.
    """
    diagonal = work.diagonal()
    original = diagonal.clone()  # (I,)
    diagonal.add_(epsilon)
    try:
        factor, info = torch.linalg.cholesky_ex(work)  # (I, I)
        if int(info) == 0:
            return factor_solve(factor, rhs)  # no copy of the factor
        del factor
        return torch.linalg.solve(work, rhs)
    finally:
        diagonal.copy_(original)


def refit_solutions(stats: BoundaryStats, scale: float | None, lambdas: Sequence[float],
                    counts: Sequence[int]) -> list[RefitSolution]:
    """Every (λ, k) candidate of the refit at one boundary (the statistics must hold the refit's moments).

    Memory beside the statistics (`memory_parts.refit_solve_bytes` counts it): the working normal
    equations and their Cholesky factor (two I×I float64), the right-hand side, a scaled target's cross
    moment and one float64 solution (three I×C float64 at most), and the float32 candidates so far.
    """
    ordinary = stats.ordinary
    gram, cross = ordinary.ata, refit_cross(stats, scale)  # (I, I), (I, C)
    width = gram.shape[0]
    trace = float(torch.trace(gram))
    if trace <= 0:
        raise GhostedError(f"boundary {stats.boundary}: no ordinary calibration token reached the refit")
    directions = sink_inner_directions(stats, max(counts))
    solutions = []
    for k in sorted({min(k, directions.shape[1]) for k in counts}):
        keep = directions[:, :k]  # (I, k)
        # our own I×I copy either way: the projected equations, or the Gram matrix to shift in place
        work, rhs = projected_normal_equations(gram, cross, keep) if k else (gram.clone(), cross)
        for lam in lambdas:
            epsilon = lam * trace / width
            update = _solve(work, rhs, epsilon)  # (I, C) float64
            if k:
                update.addmm_(keep, keep.T @ update, alpha=-1.0)  # exactly 0 on the sink directions, in place
            if not torch.isfinite(update).all():
                raise GhostedError("the refit produced non-finite values; use more calibration text")
            solutions.append(RefitSolution(update.to(torch.float32), lam, epsilon, k))
            del update
        del work, rhs
    return solutions


def refit_squared_errors(stats: BoundaryStats, update: torch.Tensor, scale: float | None) -> tuple[float, float] | None:
    """(Σ‖s(x + aB) − y‖² over all calibration tokens, … over ordinary tokens) from the statistics.

    Ordinary tokens from the moments (with a scale also aᵀX_pre and the channel sums ‖x‖², ⟨x, Δ⟩);
    sinks from their rows. None when a statistic is missing or sinks spilled past the kept rows.
    Time O(I²·C).
    """
    ordinary, sinks = stats.ordinary, stats.sinks
    s = 1.0 if scale is None else scale
    b = update.to(ordinary.ata.device, torch.float64)  # (I, C)
    product = ordinary.ata @ b  # (I, C): with b, the two I×C float64 matrices this needs
    value = s * s * float(product.mul_(b).sum()) - 2 * s * float(torch.vdot(b.flatten(), ordinary.atd.flatten()))
    value += ordinary.dd
    del product
    if s != 1.0:
        if ordinary.atx is None or stats.channel is None:
            return None
        sq_x = float(stats.channel.sq_x[0].sum())  # Σ‖x‖² over ordinary tokens
        x_delta = float(stats.channel.xy[0].sum()) - sq_x  # Σ⟨x, Δ⟩
        value += 2 * s * (s - 1) * float(torch.vdot(b.flatten(), ordinary.atx.flatten())) - 2 * (s - 1) * x_delta + (s - 1) ** 2 * sq_x
    value = max(value, 0.0)
    if sinks.inner_spill is not None or (sinks.kept and sinks.inner is None):
        return None
    sink = 0.0
    if sinks.kept:
        error = s * (sinks.x_pre + sinks.inner @ b) - (sinks.x_pre + sinks.delta)  # (k, C)
        sink = float((error * error).sum())
    return value + sink, value
