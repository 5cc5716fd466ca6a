"""End to end on the real embedded SmolLM2-135M (slow: minutes on 2 cores)."""

from __future__ import annotations

import pytest

from ghosted_core.pipeline import RunOptions, parse_variants, run

pytestmark = pytest.mark.slow


def test_smollm2_streamline_ghost_beats_plain_pruning_and_diag(smollm2, all_threads):
    options = RunOptions(model="smollm2-135m", criterion="streamline", num_prune=7,
                         variants=parse_variants("none,diag,ghost,ghost_capped"), calibration="ptb", train_size=16,
                         seqlen=256, eval_corpora=("ptb",), eval_max_tokens=4096, quiet=True)
    result = run(options, smollm2)
    ppl = result.perplexity["ptb"]
    assert ppl["dense"] < ppl["ghost"] < ppl["none"]
    assert ppl["ghost"] < ppl["diag"]
    assert ppl["ghost_capped"] < ppl["none"]
    assert len(result.plan.removed) == 7 and len(result.plan.boundaries) == 1
    reports = {name: result.fits[name][0] for name in ("none", "diag", "ghost")}
    assert reports["ghost"].fit_error < reports["diag"].fit_error < 10 and reports["none"].fit_error == pytest.approx(1)
    assert 0.3 < reports["ghost"].antisym_fraction < 0.9
