"""Tests for ghosted_core.recovery.assessment: what a fit report computes by default and on request."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ghosted_core.cli import main
from ghosted_core.recovery.assessment import SHOWN, Diagnostics, antisymmetric_fraction, assess
from ghosted_core.recovery.operators import FitOptions, get_operator
from test_operators import synthetic_stats


def test_a_report_computes_only_the_parts_asked_for():
    stats, *_ = synthetic_stats()
    fit = get_operator("ghost").fit(stats, FitOptions())
    full, lean = assess(fit, stats), assess(fit, stats, detail=SHOWN)
    assert full.fit_error is not None and len(full.singular_values) == stats.width
    assert lean.fit_error is None and lean.fit_error_ordinary is None and lean.singular_values == ()
    assert lean.antisym_fraction == full.antisym_fraction  # what the summary shows is always there
    only_values = assess(fit, stats, detail=Diagnostics(fit_errors=False))
    assert only_values.singular_values == full.singular_values and only_values.fit_error is None
    scale = get_operator("diag").fit(stats, FitOptions())  # per-channel fits: O(C), always reported
    assert assess(scale, stats, detail=SHOWN).fit_error == assess(scale, stats).fit_error


@pytest.mark.parametrize("flags, computed", [([], False), (["--diagnostics"], True)])
def test_the_cli_computes_diagnostics_only_when_asked(tiny_model_folder, tmp_path, flags, computed):
    args = ["--model", str(tiny_model_folder), "--total_num_prune", "2", "--insert_type", "none,ghost",
            "--calibration_data", "ptb", "--train_size", "8", "--seqlen", "32", "--eval_ppl", "ptb",
            "--eval_max_tokens", "64", "--quiet", "--outdir", str(tmp_path), *flags]
    assert main(args) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    (fit,) = report["variants"]["ghost"]["fits"]
    assert fit["heldout_error"] is not None and fit["antisym_fraction"] > 0  # the summary's numbers, always
    assert (fit["fit_error"] is not None) == computed
    assert bool(fit["singular_values"]) == computed
    assert (fit["condition_number"] is not None) == computed


@pytest.mark.parametrize("width", [7, 1100])  # 1100: blocks of 512 and a ragged last one
def test_antisymmetric_fraction_equals_numpy(width):
    m = np.random.default_rng(width).standard_normal((width, width))
    expected = np.linalg.norm((m - m.T) / 2) / np.linalg.norm(m)
    assert antisymmetric_fraction(torch.from_numpy(m)) == pytest.approx(expected, rel=1e-12)
    symmetric = torch.from_numpy(m + m.T)
    assert antisymmetric_fraction(symmetric) == 0.0
