"""The Gradio app: formatting helpers on a hand-made report (fast), and the served API on the real SmolLM2 (slow).

The slow tests launch the app in-process on a free port and drive it with gradio_client, as a
remote user would: the default configuration at small sizes, bad input, cancelling a run.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

import app
from ghosted_core.errors import GhostedError
from studio import cache, callbacks, charts, layout, runner, settings, tables

SMALL = dict(samples=8, seqlen=128, eval_tokens=256, new_tokens=8)  # the defaults otherwise


# ---------------------------------------------------------------- fast: helpers on a synthetic report


def synthetic_report() -> dict:
    """A results.json-shaped report with two corpora, one boundary and three variants."""
    fit = {"boundary": "12-18", "antisym_fraction": 0.5, "singular_values": [3.0, 1.0, 0.1]}
    errors = [{"boundary": "12-18", "fit": 0.5, "fit_ordinary": 0.6, "heldout": 0.7, "heldout_ordinary": 0.8}]
    drift = {"blocks": [19, 20, 30], "error": [0.1, 0.2, 0.3], "error_ordinary": [0.2, 0.3, 0.4]}
    return {
        "model": "smollm2-135m", "num_layers": 30, "criterion": "streamline", "removed_layers": list(range(12, 19)),
        "boundaries": [[12, 19]], "scores": [0.5 + 0.01 * s for s in range(24)],
        "score_label": "mean cos(h_s, h_s+7) over tokens, per run start s",
        "calibration": {"label": "mix (…; stand-in for C4)", "sequences": 8, "seqlen": 128, "seed": 0,
                        "heldout_sequences": 1},
        "corpora": {"ptb": {"label": "PTB (valid split, exact)", "real": True, "windows": 2, "tokens": 256},
                    "wiki": {"label": "wiki (BoolQ passages; stand-in for WikiText-2)", "real": False, "windows": 2,
                             "tokens": 256}},
        "prompt": "Once upon a <time>", "notes": ["ghost, boundary 12-18: a note"], "timings": {"load model": 1.0},
        "app": {"drift_corpus": "ptb", "drift_windows": 1, "max_new_tokens": 8, "generation_seed": 0},
        "variants": {
            "dense": {"ppl": {"ptb": 10.0, "wiki": 20.0}, "generation": "dense text"},
            "none": {"ppl": {"ptb": 30.0, "wiki": 40.0}, "generation": "none text", "boundary_error": errors,
                     "fits": [fit | {"singular_values": []}], "drift": drift},
            "ghost": {"ppl": {"ptb": 15.0, "wiki": 45.0}, "generation": "ghost & text", "boundary_error": errors,
                      "fits": [fit], "drift": drift},
        },
    }


def test_recovered_share_is_the_fraction_of_pruning_damage_undone():
    assert tables.recovered_share(15.0, 30.0, 10.0) == pytest.approx(0.75)
    assert tables.recovered_share(40.0, 30.0, 10.0) == pytest.approx(-0.5)
    assert tables.recovered_share(15.0, None, 10.0) is None
    assert tables.recovered_share(15.0, 10.0, 10.0) is None  # no damage to recover


def test_perplexity_table_has_every_variant_corpus_label_and_share():
    table = tables.perplexity_table(synthetic_report())
    assert list(table["variant"]) == ["dense", "none", "ghost"]
    assert list(table.columns) == ["variant", "ptb (exact) ppl", "ptb (exact) recovered", "wiki (stand-in) ppl",
                                   "wiki (stand-in) recovered"]
    ghost = table.set_index("variant").loc["ghost"]
    assert ghost["ptb (exact) recovered"] == "75%" and ghost["wiki (stand-in) recovered"] == "-25%"
    caption = tables.perplexity_caption(synthetic_report())
    for text in ("smollm2-135m", "12–18", "PTB (valid split, exact)", "stand-in for WikiText-2", "stand-in for C4"):
        assert text in caption


def test_generations_are_escaped_cards_side_by_side():
    page = tables.generations_html(synthetic_report())
    assert re.findall(r"data-variant='([^']+)'", page) == ["dense", "none", "ghost"]
    assert "ghost &amp; text" in page and "&lt;time&gt;" in page and "<time>" not in page


def test_every_figure_has_data_and_the_context_in_its_title():
    report = synthetic_report()
    for build in (charts.scores_figure, charts.boundary_error_figure, charts.drift_figure, charts.structure_figure):
        fig = build(report)
        assert fig.data and all(len(trace.y) for trace in fig.data), build.__name__
        assert "smollm2-135m" in fig.layout.title.text and "12–18" in fig.layout.title.text, build.__name__
    assert "PTB (valid split, exact)" in charts.drift_figure(report).layout.title.text
    structure = charts.structure_figure(report)
    assert {t.legendgroup for t in structure.data} == {"ghost"}  # identity (none) has no structure to show


def test_manual_plans_show_the_removed_blocks_without_scores():
    report = synthetic_report() | {"criterion": "manual", "scores": [], "score_label": ""}
    fig = charts.scores_figure(report)
    assert len(fig.data[0].x) == 30 and "manual" in fig.layout.xaxis.title.text


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


def test_messages_name_the_widgets_not_the_cli_flags():
    message = callbacks.page_message(GhostedError("removing 30 of 30 blocks leaves none; use --total_num_prune at most 29"))
    assert "--" not in message and "'Blocks to remove'" in message


def test_widget_choices_come_from_the_registries():
    from ghosted_core import data
    from ghosted_core.operators import OPERATORS

    assert set(OPERATORS) <= set(settings.OPERATOR_CHOICES)
    assert set(settings.DEFAULTS.operators) >= {"none", "diag", "rotate", "ghost", "ghost_capped", "replaceme"}
    assert [name for _, name in layout.corpus_choices("evaluation")] == data.corpus_names()


def test_model_cache_is_bounded_and_keyed_by_name(monkeypatch):
    loads = []
    monkeypatch.setattr(cache, "load_model", lambda name: loads.append(name) or f"model {name}")
    models = cache.ModelCache(capacity=2)
    assert models.get("a") == "model a" and models.get("a") == "model a"
    models.get("b"), models.get("c")
    assert loads == ["a", "b", "c"] and models.peek("a") is None and models.peek("c") == "model c"


# ---------------------------------------------------------------- slow: the served app on SmolLM2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def client(smollm2):
    """The app served in-process on a free port, with the session's SmolLM2 in its model cache."""
    from gradio_client import Client

    cache.MODELS.put(smollm2)
    port = free_port()
    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                    **layout.launch_options())
    try:
        # Stop returns once the stage computing at the time has finished (tens of seconds on a
        # busy 2-core machine): wait for it rather than time out at httpx's default 5 s.
        yield Client(f"http://127.0.0.1:{port}/", verbose=False, httpx_kwargs={"timeout": 300})
    finally:
        app.demo.close()


def run_kwargs(**changes) -> dict:
    """The page's defaults at small sizes, as keyword arguments of the /run endpoint."""
    return SMALL | changes


def plot_traces(output: dict) -> list[dict]:
    assert output["type"] == "plotly"
    return json.loads(output["plot"])["data"]


def plot_title(output: dict) -> str:
    return json.loads(output["plot"])["layout"]["title"]["text"]


@pytest.mark.slow
def test_default_run_streams_and_fills_every_output(client, all_threads):
    job = client.submit(api_name="/run", **run_kwargs())
    outputs = dict(zip(callbacks.OUTPUT_NAMES, job.result(timeout=900)))
    streamed = job.outputs()
    variants = ["dense", *settings.DEFAULTS.operators]

    # streaming: one update per stage; perplexity shows up before the generations do
    assert len(streamed) >= 8
    partial = dict(zip(callbacks.OUTPUT_NAMES, streamed[5]))
    assert partial["ppl_table"]["data"] and "data-variant" not in partial["generations"]

    assert "Run complete" in outputs["status"] and "smollm2-135m" in outputs["status"]

    cards = dict(re.findall(r"data-variant='([^']+)'.*?<div class='gen-text'>(.*?)</div>", outputs["generations"]))
    assert list(cards) == variants and all(text.strip() and "(empty)" not in text for text in cards.values())

    table = outputs["ppl_table"]
    assert [row[0] for row in table["data"]] == variants
    assert table["headers"][1:] == ["ptb (exact) ppl", "ptb (exact) recovered", "wiki (stand-in) ppl",
                                    "wiki (stand-in) recovered"]
    assert all(float(row[1]) > 1 and float(row[3]) > 1 for row in table["data"])
    for text in ("PTB (valid split, exact)", "stand-in for WikiText-2", "smollm2-135m", "removed"):
        assert text in outputs["ppl_caption"]

    for name in ("scores", "errors", "drift", "structure"):
        traces = plot_traces(outputs[name])
        assert traces and all(trace.get("y") for trace in traces), name
        assert "smollm2-135m" in plot_title(outputs[name]) and "removed" in plot_title(outputs[name]), name
    error_variants = {t["name"] for t in plot_traces(outputs["errors"])}
    assert error_variants == set(settings.DEFAULTS.operators)

    report = json.loads(Path(outputs["results_file"]).read_text())
    assert len(report["removed_layers"]) == settings.DEFAULTS.depth
    assert list(report["variants"]) == variants
    for name, entry in report["variants"].items():
        assert set(entry["ppl"]) == {"ptb", "wiki"} and entry["generation"].strip(), name
    assert report["corpora"]["wiki"]["real"] is False and report["corpora"]["ptb"]["real"] is True


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    (dict(depth=30), "leaves none"),
    (dict(model="no-such-model"), "unknown model"),
    (dict(criterion="manual", manual_blocks="27-31"), "out of range"),
])
def test_bad_input_gives_a_clear_message(client, changes, message):
    from gradio_client.exceptions import AppError

    start = time.perf_counter()
    with pytest.raises(AppError, match=message) as caught:
        client.predict(api_name="/run", **run_kwargs(**changes))
    assert "--" not in str(caught.value)
    assert time.perf_counter() - start < 60  # refused before any model work


@pytest.mark.slow
def test_a_cancelled_run_and_errors_leave_the_app_serving(client, all_threads):
    job = client.submit(api_name="/run", **run_kwargs())
    deadline = time.time() + 300
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert len(job.outputs()) >= 2
    job.cancel()
    deadline = time.time() + 120
    while not job.done() and time.time() < deadline:
        time.sleep(0.5)
    assert job.done()

    outputs = dict(zip(callbacks.OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(operators=["none", "ghost_capped"], eval_corpora=["ptb"], prompt="",
                                      save_variant="ghost_capped"))))
    assert [row[0] for row in outputs["ppl_table"]["data"]] == ["dense", "none", "ghost_capped"]
    assert "generation skipped" in outputs["generations"]
    assert_saved_model_loads(Path(outputs["model_file"]), removed=settings.DEFAULTS.depth, operator="ghost_capped")


def assert_saved_model_loads(archive: Path, removed: int, operator: str) -> None:
    """The downloaded zip unpacks to a model that `load_recovered` reads and that predicts text."""
    import tempfile
    import zipfile

    import torch

    from ghosted_core.export import load_recovered

    assert archive.name == f"smollm2-135m-{operator}.zip"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(archive) as zipped:
        zipped.extractall(tmp)
        model, tokenizer = load_recovered(Path(tmp) / archive.stem)
        assert model.config.num_hidden_layers == 30 - removed
        assert model.config.ghosted["operator"] == operator
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_quick_tasks_fill_the_table_and_chart(client, all_threads):
    outputs = dict(zip(callbacks.OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(operators=["none", "ghost"], eval_corpora=["ptb"], prompt="", tasks_on=True,
                                      task_names=["copa", "arc_easy"], task_examples=5))))
    table = outputs["tasks_table"]
    assert [row[0] for row in table["data"]] == ["dense", "none", "ghost"]
    assert any("copa" in h for h in table["headers"]) and any("mean" in h for h in table["headers"])
    bars = {t["name"]: t["y"] for t in plot_traces(outputs["tasks_plot"]) if t["type"] == "bar"}
    assert set(bars) == {"dense", "none", "ghost"} and all(0 <= y <= 1 for ys in bars.values() for y in ys)
    report = json.loads(Path(outputs["results_file"]).read_text())
    assert report["variants"]["ghost"]["tasks"]["scores"][0]["n"] == 5
    assert "5 examples per task" in outputs["tasks_caption"]


@pytest.mark.slow
def test_model_change_bounds_the_depth_and_explains_unknown_models(client):
    note, depth, blocks = client.predict("no-such-model", 7, api_name="/model_info")
    assert "unknown model" in note
    note, depth, blocks = client.predict("smollm2-135m", 7, api_name="/model_info")
    assert "30 decoder blocks" in note
