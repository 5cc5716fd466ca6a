"""Depth sweep: one scoring pass, one calibration pass, and every depth equal to its own single-depth run."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest

from ghosted_core.run import plans as plans_module
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.recovery.assessment import Diagnostics
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.run.sweep import SweepOptions, check_sweep, parse_depths, planned_stages, run_sweep, sweep_stages

ALL_VARIANTS = "none,diag,rotate,ghost,ghost_capped,replaceme,ghost+seq"


@pytest.fixture(scope="module")
def loaded(tiny_model_folder):
    return load_model(str(tiny_model_folder), LoadOptions(device="cpu"))


def options_for(folder, criterion: str = "shortgpt", variants: str = ALL_VARIANTS) -> RunOptions:
    return RunOptions(model=str(folder), criterion=criterion, variants=parse_variants(variants), calibration="ptb",
                      train_size=4, seqlen=32, heldout_size=2, eval_corpora=("ptb", "wiki"), eval_max_tokens=96,
                      eval_batch_size=2, drift_windows=0, quiet=True, diagnostics=Diagnostics(),
                      calibrate=CalibrationOptions(quiet=True, batch_size=2))


@pytest.mark.parametrize("text, depths", [
    ("2:10:2", (2, 4, 6, 8, 10)), ("3", (3,)), ("2:5", (2, 3, 4, 5)), ("2:9:3", (2, 5, 8)), (" 4:4:1 ", (4,)),
])
def test_parse_depths_includes_stop(text, depths):
    assert parse_depths(text) == depths


@pytest.mark.parametrize("text, message", [
    ("2:10:0", "step must be at least 1"), ("2:10:-2", "step must be at least 1"), ("10:2:2", "starts above its stop"),
    ("0:4:2", "remove at least 1 block"), ("a:b", "cannot read"), ("1:2:3:4", "cannot read"), ("", "cannot read"),
])
def test_parse_depths_refuses_bad_ranges(text, message):
    with pytest.raises(GhostedError, match=message):
        parse_depths(text)


def test_check_sweep_refuses_what_a_sweep_cannot_do(tiny_model_folder):
    options = options_for(tiny_model_folder)
    with pytest.raises(GhostedError, match="leaves none"):
        check_sweep(options, (2, 6), num_layers=6)
    with pytest.raises(GhostedError, match="streamline, shortgpt or angular"):
        check_sweep(replace(options, criterion="manual", layers=(1, 2)), (1, 2))
    with pytest.raises(GhostedError, match="single depth"):
        check_sweep(replace(options, tasks=("copa",)), (1, 2))
    assert check_sweep(options, (3, 1, 3), num_layers=6) == (1, 3)


class ForwardCounter:
    """Counts forward passes of a model by the calls of its embedding (one per pass that starts from tokens)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def test_sweep_scores_once_and_calibrates_in_one_pass(loaded, tiny_model_folder, monkeypatch):
    options = options_for(tiny_model_folder, variants="none,diag,ghost,ghost_capped,replaceme")
    calls = []
    real_collect = plans_module.collect_stats
    monkeypatch.setattr(plans_module, "collect_stats", lambda *a, **k: calls.append(a[1]) or real_collect(*a, **k))
    counter = ForwardCounter(loaded.model)
    fit_batches, heldout_batches = 2, 1  # 4 fit sequences and 2 held-out, 2 per forward pass
    eval_batches = 2 * 2  # 96 tokens of 32 = 3 windows per corpus → 2 batches of 2, two corpora
    try:
        passes = {stage: counter.take() for stage, _ in sweep_stages(options, (1, 2, 3, 4), loaded)}
    finally:
        counter.handle.remove()
    assert list(passes) == planned_stages((1, 2, 3, 4))
    assert passes["score blocks"] == fit_batches  # one similarity pass for four depths
    assert passes["calibrate"] == fit_batches  # ONE calibration pass for four depths
    assert len(calls) == 1
    assert passes["perplexity dense"] == eval_batches  # the dense model runs once per corpus
    # a depth runs its variants' suffixes only (no pass from the tokens) and, once its fits exist, the
    # held-out sequences once for the boundary errors of all its variants, as a single run does
    assert [passes[f"depth {n}"] for n in (1, 2, 3, 4)] == [heldout_batches] * 4
    single = ForwardCounter(loaded.model)
    try:
        run(replace(options, num_prune=2), loaded)
    finally:
        single.handle.remove()
    assert single.count == 2 * fit_batches + heldout_batches + eval_batches  # what each depth would cost alone


def test_every_depth_equals_a_single_depth_run(loaded, tiny_model_folder):
    options = options_for(tiny_model_folder)
    result = run_sweep(options, (1, 2, 3), loaded)
    assert [d.n for d in result.results] == [1, 2, 3]
    for depth in result.results:
        single = run(replace(options, num_prune=depth.n), loaded)
        assert depth.plan.removed == single.plan.removed
        for corpus in ("ptb", "wiki"):
            assert result.dense[corpus] == pytest.approx(single.perplexity[corpus]["dense"], rel=1e-6)
            for name, value in depth.perplexity[corpus].items():
                assert value == pytest.approx(single.perplexity[corpus][name], rel=1e-6), (depth.n, corpus, name)
        for name, reports in depth.fits.items():
            for mine, theirs in zip(reports, single.fits[name], strict=True):
                assert mine.boundary == theirs.boundary
                assert mine.fit_error == pytest.approx(theirs.fit_error, rel=1e-9, abs=1e-12)
                assert mine.heldout_error == pytest.approx(theirs.heldout_error, rel=1e-9, abs=1e-12)
        boundaries = len(depth.plan.boundaries)
        assert depth.extra_passes == boundaries - 1  # ghost+seq: one extra pass per boundary after the first


def test_boundaries_shared_by_depths_are_accumulated_once_and_freed_after_their_last_depth(
        loaded, tiny_model_folder, monkeypatch):
    options = options_for(tiny_model_folder, variants="none,ghost")
    alive = {}
    real_collect = plans_module.collect_stats

    def tracking(*args, **kwargs):
        stats = real_collect(*args, **kwargs)
        alive.update({s.boundary: weakref.ref(s) for s in stats})
        return stats

    monkeypatch.setattr(plans_module, "collect_stats", tracking)
    stages = sweep_stages(options, (1, 2, 3, 4), loaded)
    for stage, result in stages:
        if stage == "calibrate":
            wanted = {b for plan in result.plans.values() for b in plan.boundaries}
            assert set(alive) == wanted
            assert result.statistics["distinct_boundaries"] == len(wanted)
            assert sum(len(p.boundaries) for p in result.plans.values()) > len(wanted)  # shortgpt shares some
            last_use = {b: max(n for n, p in result.plans.items() if b in p.boundaries) for b in wanted}
        if stage.startswith("depth "):
            gc.collect()
            n = int(stage.split()[1])
            for boundary, ref in alive.items():
                assert (ref() is None) == (last_use[boundary] <= n), (n, boundary)


def test_recomputed_prefixes_give_the_same_numbers(loaded, tiny_model_folder):
    options = options_for(tiny_model_folder, criterion="streamline", variants="none,ghost,replaceme")
    cached = run_sweep(options, (1, 3), loaded)
    recomputed = run_sweep(options, (1, 3), loaded, SweepOptions(prefix_cache_bytes=0))
    assert any("recomputes" in note for note in recomputed.notes)
    for a, b in zip(cached.results, recomputed.results, strict=True):
        for corpus, table in a.perplexity.items():
            assert table == pytest.approx(b.perplexity[corpus], rel=1e-6)


def test_results_json_has_a_sweep_entry(loaded, tiny_model_folder):
    options = options_for(tiny_model_folder, criterion="streamline", variants="none,diag,ghost")
    report = run_sweep(options, (1, 2), loaded).to_json()
    sweep = report["sweep"]
    assert sweep["depths"] == [1, 2] and sweep["variants"] == ["none", "diag", "ghost"]
    assert sweep["statistics"]["calibration_passes"] == 1
    assert sweep["statistics"]["bytes"] == sweep["statistics"]["estimated_bytes"] > 0
    assert report["corpora"]["ptb"]["real"] is True and "stand-in" in report["corpora"]["wiki"]["label"]
    assert report["corpora"]["ptb"]["tokens"] == 96 and report["corpora"]["ptb"]["predicted_tokens"] == 3 * 31
    dense = sweep["dense"]["ppl"]
    for entry in sweep["results"]:
        assert len(entry["removed_layers"]) == entry["n"] and len(entry["boundaries"]) == 1
        assert set(entry["timings"]) == {"fit operators", "perplexity", "size and speed"}
        variants = entry["variants"]
        for corpus in ("ptb", "wiki"):
            none, ghost = variants["none"]["ppl"][corpus], variants["ghost"]["ppl"][corpus]
            assert variants["ghost"]["recovered"][corpus] == pytest.approx((none - ghost) / (none - dense[corpus]))
            assert variants["none"]["recovered"][corpus] == pytest.approx(0.0)
        assert variants["none"]["boundary_error"][0]["fit"] == pytest.approx(1.0)
        assert len(variants["ghost"]["antisym_fraction"]) == 1


def test_sweep_on_your_text_labels_it_everywhere(loaded, tiny_model_folder):
    from ghosted_core.data.user_text import USER_CORPUS, from_text

    text = from_text("\n\n".join(f"Part {i}. " + "The tide turns when the moon says so. " * 12 for i in range(60)))
    options = replace(options_for(tiny_model_folder, criterion="streamline", variants="none,ghost"),
                      calibration=USER_CORPUS, eval_corpora=(USER_CORPUS, "ptb"), user_text=text)
    report = run_sweep(options, (1, 2), loaded).to_json()
    assert report["calibration"]["corpus"] == USER_CORPUS and report["calibration"]["label"].startswith(USER_CORPUS)
    entry = report["corpora"][USER_CORPUS]
    assert entry["user"] and entry["label"].startswith(USER_CORPUS) and "disjoint" in entry["label"]
    assert set(report["sweep"]["dense"]["ppl"]) == {USER_CORPUS, "ptb"}
    for depth in report["sweep"]["results"]:
        assert set(depth["variants"]["ghost"]["ppl"]) == {USER_CORPUS, "ptb"}
