"""Calibration products: a Gram summed as its upper block triangle and mirrored equals numpy's XᵀX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ghosted_core.products import add_gram, add_product, gram_blocks, symmetrize


@pytest.mark.parametrize("width, block", [(7, 2), (10, 3), (12, 4), (5, 8)])
def test_gram_blocks_cover_the_width_once(width: int, block: int) -> None:
    spans = gram_blocks(width, block)
    assert spans[0][0] == 0 and spans[-1][1] == width
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(spans) == (1 if width < 2 * block else -(-width // block))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: products in fp32, summed in float64
def test_gram_in_blocks_over_batches_equals_numpy(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((n, 11)) for n in (5, 9, 3)]
    total = torch.zeros(11, 11, dtype=torch.float64)
    for rows in batches:
        add_gram(total, torch.from_numpy(rows).to(dtype), block=3)
    below = np.tril_indices(11, -3)  # strictly inside the blocks below the diagonal blocks: not summed yet
    assert np.all(total.numpy()[below] == 0)
    symmetrize(total, block=3)
    stacked = np.concatenate(batches)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(total.numpy(), stacked.T @ stacked, rtol=tolerance, atol=tolerance)
    again = total.clone()
    symmetrize(again, block=3)
    assert torch.equal(again, total)  # idempotent: reading twice changes nothing


def test_product_equals_numpy() -> None:
    rng = np.random.default_rng(1)
    left, right = rng.standard_normal((8, 6)), rng.standard_normal((8, 4))
    total = torch.ones(6, 4, dtype=torch.float64)
    add_product(total, torch.from_numpy(left), torch.from_numpy(right))
    add_product(total, torch.from_numpy(left).float(), torch.from_numpy(right).float())
    np.testing.assert_allclose(total.numpy(), 1 + 2 * left.T @ right, rtol=1e-5)


def test_gram_at_c_4096_in_the_default_blocks_equals_numpy() -> None:
    """The width a Llama-3-8B boundary has: 4 blocks of 1,024, the path the C = 4096 bench takes."""
    assert len(gram_blocks(4096)) == 4
    rows = np.random.default_rng(2).standard_normal((24, 4096))
    total = torch.zeros(4096, 4096, dtype=torch.float64)
    add_gram(total, torch.from_numpy(rows))
    np.testing.assert_allclose(symmetrize(total).numpy(), rows.T @ rows, rtol=1e-12, atol=1e-12)
