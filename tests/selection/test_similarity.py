"""The layer-similarity map: symmetric, ones on the diagonal, its neighbours equal to shortgpt's cosines, every entry
equal to numpy's mean per-token cosine."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import make_batches
from ghosted_core.selection.choose import select_blocks
from ghosted_core.selection.criteria import SelectionRequest
from ghosted_core.selection.similarity import measure_similarity
from test_selection import per_token_cos, residuals


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_map_is_symmetric_unit_diagonal_and_its_neighbours_are_shortgpts_cosines(family):
    model = make_tiny_model(family)
    ids = random_tokens(5, 12, seed=6).clamp_min(1)  # token 0 is Gemma's pad: a zero embedding (see below)
    batches = make_batches(ids, None, 2)
    sim = measure_similarity(model, 2, batches, with_map=True)
    matrix = np.array(sim.map.matrix)
    assert matrix.shape == (TINY_LAYERS + 1, TINY_LAYERS + 1) and sim.map.tokens == 60
    assert sim.map.zero_norm_tokens == 0
    np.testing.assert_array_equal(matrix, matrix.T)
    np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-6)
    shortgpt, _ = select_blocks(model, "shortgpt", SelectionRequest(TINY_LAYERS, 2), batches)
    np.testing.assert_allclose([matrix[i, i + 1] for i in range(TINY_LAYERS)], [1 - s for s in shortgpt.scores],
                               rtol=1e-5)
    h = residuals(model, ids)
    expected = [[per_token_cos(a, b).mean() for b in h] for a in h]
    np.testing.assert_allclose(matrix, expected, rtol=1e-5, atol=1e-6)
    assert measure_similarity(model, 2, batches).map is None  # only when asked for


def test_zero_norm_states_count_as_cosine_zero_and_are_counted():
    model = make_tiny_model("gemma3")  # its pad token 0 embeds to zero
    ids = random_tokens(2, 10, seed=7).clamp_min(1)
    ids[0, 3] = 0
    sim = measure_similarity(model, 1, make_batches(ids, None, 2), with_map=True)
    assert sim.map.zero_norm_tokens == 1  # h_0 of that token only: block 0 makes it nonzero
    assert sim.map.matrix[0][0] == pytest.approx(19 / 20) and sim.map.matrix[1][1] == pytest.approx(1.0)
