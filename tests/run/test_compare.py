"""Criteria compared in one run: every criterion scored, one calibration pass, coinciding plans computed once,
and each criterion's numbers equal to its own single run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.run import plans as plans_module
from ghosted_core.run.compare import check_compare, compare_stages, parse_criteria, planned_stages, run_compare
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.selection.criteria import CRITERIA
from test_sweep import ForwardCounter  # counts the embedding's calls: passes that start from the tokens

EVERY = [name for name in CRITERIA if name not in ("none", "manual")]


@pytest.fixture(scope="module")
def loaded(tiny_model_folder):
    return load_model(str(tiny_model_folder), LoadOptions(device="cpu"))


def options_for(folder, variants: str = "none,ghost_capped,replaceme,magcomp", n: int = 2) -> RunOptions:
    return RunOptions(model=str(folder), num_prune=n, variants=parse_variants(variants), calibration="ptb",
                      train_size=4, seqlen=32, heldout_size=2, eval_corpora=("ptb", "wiki"), eval_max_tokens=96,
                      eval_batch_size=2, drift_windows=0, quiet=True, calibrate=CalibrationOptions(quiet=True, batch_size=2))


def test_parse_and_check_refuse_what_a_comparison_cannot_do(tiny_model_folder):
    assert parse_criteria(" streamline, shortgpt,streamline") == ("streamline", "shortgpt")
    with pytest.raises(GhostedError, match="known: streamline"):
        parse_criteria("streamline,bogus")
    with pytest.raises(GhostedError, match="'none' removes nothing"):
        parse_criteria("streamline,none")
    options = options_for(tiny_model_folder)
    with pytest.raises(GhostedError, match="at least two criteria"):
        check_compare(options, ["sleb"])
    with pytest.raises(GhostedError, match="leaves none"):
        check_compare(replace(options, num_prune=6), ["sleb", "kl"], num_layers=6)
    with pytest.raises(GhostedError, match="single criterion"):
        check_compare(replace(options, prompt="hi"), ["sleb", "kl"])


def test_every_criterion_in_one_process_with_one_calibration_pass(loaded, tiny_model_folder, monkeypatch):
    calls = []
    real = plans_module.collect_stats
    monkeypatch.setattr(plans_module, "collect_stats", lambda *a, **k: calls.append(list(a[1])) or real(*a, **k))
    counter = ForwardCounter(loaded.model)
    try:
        passes = {}
        for stage, result in compare_stages(options_for(tiny_model_folder), EVERY, loaded):
            passes[stage] = counter.take()
    finally:
        counter.handle.remove()
    assert list(passes) == planned_stages(EVERY)
    fit_batches = 2
    assert len(calls) == 1  # ONE calibration pass for every plan
    assert passes["calibrate"] == fit_batches
    assert passes[f"score {EVERY[0]}"] == fit_batches  # streamline: the similarity pass (map included), shared ...
    assert passes["score shortgpt"] == passes["score angular"] == 0  # ... by the other similarity criteria
    assert passes["score weights"] == 0  # no forward pass at all
    assert passes["score sleb"] == fit_batches  # the embedding once per batch for all rounds
    distinct = {tuple(result.selections[c].plan.removed) for c in EVERY}
    assert len(result.plans) == len(distinct) == result.statistics["distinct_plans"]
    assert sorted(calls[0], key=lambda b: (b.start, b.end)) == sorted({b for p in result.plans for b in p.plan.boundaries},
                                                                   key=lambda b: (b.start, b.end))
    report = result.to_json()["compare"]
    assert set(report["selections"]) == set(EVERY)
    assert len(report["table"]) == len(EVERY) * 4 and report["similarity_map"]["tokens"] == 4 * 32
    for name in EVERY:
        assert report["selections"][name]["removed_layers"] == list(result.selections[name].plan.removed)
        assert report["selections"][name]["cost"]["seconds"] >= 0
    assert "PTB" in report["calibration_note"] and "4 × 32 tokens" in report["calibration_note"]


def test_each_criterion_equals_its_own_run_and_coinciding_plans_are_computed_once(loaded, tiny_model_folder):
    options = options_for(tiny_model_folder)
    single = run(replace(options, criterion="streamline"), loaded)
    manual = ",".join(map(str, single.plan.removed))
    result = run_compare(replace(options, layers=single.plan.removed), ["streamline", "manual", "sleb"], loaded)
    assert result.selections["manual"].plan.removed == single.plan.removed
    assert result.evaluated["streamline"] == result.evaluated["manual"] and len(result.plans) <= 2, manual
    rows = {(r["criterion"], r["operator"]): r for r in result.table()}
    assert rows["manual", "none"]["same_plan_as"] == "streamline"
    for corpus in ("ptb", "wiki"):
        assert result.dense[corpus] == pytest.approx(single.perplexity[corpus]["dense"], rel=1e-6)
        for variant in ("none", "ghost_capped", "replaceme", "magcomp"):  # magcomp: from block 0, the rest cached
            assert rows["streamline", variant]["ppl"][corpus] == pytest.approx(single.perplexity[corpus][variant],
                                                                              rel=1e-6)
    sleb = run(replace(options, criterion="sleb"), loaded)
    assert result.selections["sleb"].plan.removed == sleb.plan.removed
    assert rows["sleb", "ghost_capped"]["ppl"]["ptb"] == pytest.approx(sleb.perplexity["ptb"]["ghost_capped"], rel=1e-6)


def test_depths_sharing_one_table_reuse_the_deeper_rounds_and_probes(loaded, tiny_model_folder):
    options = options_for(tiny_model_folder, variants="none", n=2)
    criteria = ["sleb", "prunecomp", "swap_kl", "swap_kl_repl"]
    shared: dict = {}
    deep = run_compare(options, criteria, loaded, shared)
    shallow = run_compare(replace(options, num_prune=1), criteria, loaded, shared)
    alone = run_compare(replace(options, num_prune=1), criteria, loaded)
    for name in criteria:
        assert shallow.selections[name].plan.removed == alone.selections[name].plan.removed
        assert "shared" in shallow.selections[name].cost and "shared" not in alone.selections["sleb"].cost
    assert list(shallow.selections["sleb"].details["order"]) == list(deep.selections["sleb"].details["order"][:1])
    assert shallow.selections["sleb"].cost["seconds"] == deep.selections["sleb"].cost["seconds"] > 0
