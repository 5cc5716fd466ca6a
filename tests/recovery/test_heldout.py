"""Tests for ghosted_core.recovery.heldout: held-out errors from rows kept by the calibration pass equal a pass of their own."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, HeldoutRows, collect_stats, make_batches
from ghosted_core.plan import Boundary, PruningPlan
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
from ghosted_core.run.fitting import fit_variants
from ghosted_core.run.options import RunOptions, parse_variants

OPERATORS = ["none", "diag", "ghost_capped", "replaceme", "replaceme_keepsink"]


@pytest.mark.parametrize("pipeline", ["full", "blocks"])
def test_kept_rows_give_the_errors_of_a_second_pass(tiny_model, pipeline):
    options = CalibrationOptions(quiet=True, pipeline=pipeline)
    batches = make_batches(random_tokens(6, 16), random_tokens(3, 16, seed=5), 2)
    boundaries = [Boundary(1, 3), Boundary(4, 5)]
    kept = HeldoutRows()
    stats = collect_stats(tiny_model, boundaries, batches, options, needs_of(OPERATORS), heldout=kept)
    streamed = collect_stats(tiny_model, boundaries, batches, options, needs_of(OPERATORS))
    for a, b in zip(stats, streamed):  # the held-out batches never reach the statistics
        assert a.tokens == b.tokens == 6 * 16 and torch.equal(a.ordinary.mtd, b.ordinary.mtd)
    assert kept.covers(boundaries, branch=True) and [len(kept.rows[b]) for b in boundaries] == [2, 2]
    fits = [get_operator(name).fit(s, FitOptions()) for s in stats for name in ("ghost_capped", "replaceme")]
    calls = []
    handle = tiny_model.model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    try:
        from_rows = measure_errors(tiny_model, fits, batches, options, kept=kept)
        assert not calls  # no forward at all
        again = measure_errors(tiny_model, fits, batches, options)
        assert calls
    finally:
        handle.remove()
    assert [(e.error, e.error_ordinary, e.dd, e.tokens) for e in from_rows] == \
        [(e.error, e.error_ordinary, e.dd, e.tokens) for e in again]


def test_a_run_with_kept_rows_reports_what_it_reports_without(tiny_llama):
    """fit_variants with the kept rows (keepsink's choice included) gives the same reports, bit for bit."""
    plan = PruningPlan(6, (1, 2, 4), "manual")
    options = RunOptions(variants=parse_variants(",".join(OPERATORS)), calibrate=CalibrationOptions(quiet=True))
    batches = make_batches(random_tokens(6, 16), random_tokens(2, 16, seed=7), 2)
    needs = needs_of(OPERATORS)
    kept = HeldoutRows()
    with_rows, _ = fit_variants(tiny_llama, plan, options.variants,
                                collect_stats(tiny_llama, plan.boundaries, batches, options.calibrate, needs, heldout=kept),
                                batches, options, kept)
    without, _ = fit_variants(tiny_llama, plan, options.variants,
                              collect_stats(tiny_llama, plan.boundaries, batches, options.calibrate, needs),
                              batches, options)
    for name in OPERATORS:
        assert [r.to_json() for r in with_rows[name]] == [r.to_json() for r in without[name]], name
        assert all(r.heldout_error is not None for r in with_rows[name])


def test_the_plan_keeps_the_rows_only_when_they_are_small(tiny_llama):
    from ghosted_core.run.options import memory_plan

    small = RunOptions(train_size=8, seqlen=16, heldout_size=1, variants=parse_variants("ghost"))
    plan = memory_plan(small, tiny_llama.config, "cpu", torch.float32, boundaries=2, host_available=1 << 40)
    assert plan.heldout_rows_bytes == 2 * 1 * 16 * tiny_llama.config.hidden_size * 4 * 2
    big = RunOptions(train_size=8, seqlen=64, heldout_size=200, variants=parse_variants("ghost"))
    assert memory_plan(big, tiny_llama.config, "cpu", torch.float32, boundaries=2,
                       host_available=1 << 40).heldout_rows_bytes == 0  # more than a boundary's statistics: streamed
