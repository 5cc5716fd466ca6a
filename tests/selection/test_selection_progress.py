"""The long criteria report their progress while they score: a count that reaches its total, and an estimate."""

from __future__ import annotations

import pytest

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import make_batches
from ghosted_core.progress import reporting
from ghosted_core.selection.criteria import CRITERIA, Scoring, SelectionRequest
from ghosted_core.selection.swap import pairs

# criterion → (what it reports, its total on the tiny model with 2 fit batches, removing 2 blocks)
EXPECTED = {
    "swap_kl": ("score swap_kl (both probes)", 2 * 3 * len(pairs(TINY_LAYERS))),
    "kl": ("score kl", 2 * (TINY_LAYERS - 2 + 1)),
    "sleb": ("score sleb", 2),
    "prunecomp": ("score prunecomp", 2 * 2),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_long_criterion_reports_each_step_of_its_loop(name, monkeypatch):
    monkeypatch.setattr("ghosted_core.progress.MIN_INTERVAL", 0.0)  # every step, not one per half second
    model = make_tiny_model("llama")
    batches = make_batches(random_tokens(4, 12, seed=3), None, 2)
    events = []
    with reporting(events.append):
        CRITERIA[name].select(SelectionRequest(TINY_LAYERS, 2), Scoring(model, batches, quiet=False))
    what, total = EXPECTED[name]
    mine = [e for e in events if e.what == what]
    assert mine, {e.what for e in events}
    assert [e.total for e in mine] == [total] * len(mine)
    assert mine[0].done == 0 and mine[-1].done == total and mine[-1].finished
    assert [e.done for e in mine] == sorted(e.done for e in mine) and len(mine) >= 3  # reported during the loop
    assert all(e.eta is not None for e in mine[1:])


def test_a_quiet_scoring_reports_nothing():
    events = []
    with reporting(events.append):
        CRITERIA["kl"].select(SelectionRequest(TINY_LAYERS, 2),
                              Scoring(make_tiny_model("llama"), make_batches(random_tokens(2, 12), None, 2)))
    assert events == []
