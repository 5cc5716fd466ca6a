"""Linear algebra shared by the fits that hold a map to the identity on the sink tokens' directions.

Both ReplaceMe's sink-preserving fit (C×C, on the MLP output m) and the down_proj refit (I×C, on
the MLP's intermediate a) solve a ridge least squares whose solution must vanish on the span U of
the sink tokens' rows: `principal_directions` finds U, `projected_normal_equations` builds the
normal equations restricted to the complement of U.
"""

from __future__ import annotations

import torch


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
    side is 0, so UᵀA = 0. Memory: two W×W (and one W×C) float64 matrices; time O(W²·k).
    """
    gu = gram @ keep  # (W, k) G U
    pgp = gram - keep @ gu.T - gu @ keep.T + keep @ (keep.T @ gu) @ keep.T  # (W, W) P G P
    pgp += (float(torch.trace(gram)) / gram.shape[0]) * (keep @ keep.T)  # c·UUᵀ: U block invertible
    rhs = cross - keep @ (keep.T @ cross)  # (W, C) P R
    return pgp, rhs
