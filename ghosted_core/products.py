"""Products of token rows summed into float64 totals, batch after batch: the cost of calibration.

A Gram matrix XᵀX is symmetric, so `add_gram` computes only the blocks on and above its block
diagonal (at C = 4096 in blocks of 1024: 10 of 16 blocks, 0.64× the time of the full product on
2 cores) and `symmetrize` copies them below once, when the total is read. `add_product` is the
general XᵀY. Both add in place when the rows already have the total's dtype (no C×C temporary
beyond a block), else through one product in the rows' dtype (fp32 products on GPUs).
"""

from __future__ import annotations

import torch

GRAM_BLOCK = 1024  # block width of a Gram's upper triangle: large enough for BLAS to run at full speed


def add_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """total (P, Q) += leftᵀ right, left (T, P), right (T, Q). Time O(T·P·Q)."""
    if left.dtype == total.dtype:
        total.addmm_(left.T, right)
    else:
        total += left.T @ right


def gram_blocks(width: int, block: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of each block of rows of a width×width Gram (blocks of `GRAM_BLOCK` unless told); one
    block below two blocks' width (a split of a small matrix costs more in small products than it saves)."""
    block = block or GRAM_BLOCK
    if width < 2 * block:
        return [(0, width)]
    edges = list(range(0, width, block)) + [width]
    return list(zip(edges[:-1], edges[1:]))


def add_gram(total: torch.Tensor, rows: torch.Tensor, block: int | None = None) -> None:
    """The upper block triangle of total (W, W) += rowsᵀ rows, rows (T, W); blocks below the diagonal are
    left as they are (`symmetrize` fills them). Time O(T·W²/2 + T·W·block/2)."""
    for start, end in gram_blocks(total.shape[0], block):
        add_product(total[start:end, start:], rows[:, start:end], rows[:, start:])


def symmetrize(total: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Copy the upper block triangle that `add_gram` summed below the diagonal, in place; returns total.
    Idempotent, O(W²) time, no W×W temporary."""
    spans = gram_blocks(total.shape[0], block)
    for i, (row_start, row_end) in enumerate(spans):
        for col_start, col_end in spans[:i]:
            total[row_start:row_end, col_start:col_end] = total[col_start:col_end, row_start:row_end].T
    return total
