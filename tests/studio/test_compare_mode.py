"""The app's "Compare criteria" mode: the request (fast), and the served API streaming a comparison on SmolLM2 (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ghosted_core.errors import GhostedError
from studio import outputs, runner, settings
from test_served_app import client, plot_traces, run_kwargs  # noqa: F401  (the served app, shared with test_served_app)

CRITERIA = ["streamline", "shortgpt", "kl", "weights"]  # the page's quick defaults (sleb: tests/selection/test_sleb.py)


def test_a_compare_request_checks_its_criteria_and_plans_a_stage_per_criterion():
    options = runner.build_options("smollm2-135m", "streamline", 7, "", ["none", "ghost"], "mix", 12, 256, 0, ["ptb"],
                                   1024, "Once upon a time", 8)
    request = runner.build_request(options, runner.QuickTasks(), "ghost", "auto", settings.COMPARE, "", CRITERIA)
    assert request.compare and request.criteria == tuple(CRITERIA) and request.options.prompt is None
    assert any("saves no model" in note for note in request.notes)
    assert request.stages()[-1 - len(CRITERIA):] == ["perplexity dense", *(f"evaluate {c}" for c in CRITERIA)]
    with pytest.raises(GhostedError, match="at least two criteria"):
        runner.build_request(options, runner.QuickTasks(), settings.NO_SAVE, "auto", settings.COMPARE, "", ["kl"])


@pytest.mark.slow
def test_compare_mode_streams_criterion_by_criterion_and_fills_the_map_scores_and_table(client, all_threads):  # noqa: F811
    job = client.submit(api_name="/run", **run_kwargs(mode=settings.COMPARE, compare_criteria=CRITERIA,
                                                      eval_corpora=["ptb"], eval_tokens=256))
    final = dict(zip(outputs.OUTPUT_NAMES, job.result(timeout=1800)))
    assert "Run complete" in final["status"]
    heat = plot_traces(final["similarity_map"])
    assert heat[0]["type"] == "heatmap" and len(heat[0]["z"]) == 31
    assert [t["name"].split(":")[0] for t in heat[1:]] == CRITERIA
    scores = plot_traces(final["criterion_scores"])
    assert [t["name"] for t in scores] == CRITERIA and all(t["y"] for t in scores)
    table = final["compare_table"].get("value", final["compare_table"])  # sent as an update with its column widths
    rows = table["data"]
    assert [row[0] for row in rows] == CRITERIA  # criteria × operators: a row per criterion
    assert table["headers"][2:-1] == list(settings.DEFAULTS.operators)
    assert sum("★" in str(cell) for row in rows for cell in row) == 1 and "Best: " in final["status"]
    assert "mix" in final["compare_caption"] and "rerun on yours" in final["compare_caption"]
    # streamed criterion by criterion: the score chart grew one panel at a time
    index = outputs.OUTPUT_NAMES.index("criterion_scores")
    stages = [u for u in job.outputs() if "⏳" not in u[0]]  # leave out the progress updates inside a stage
    panels = [len(json.loads(u[index]["plot"])["data"]) for u in stages
              if isinstance(u[index], dict) and u[index].get("plot") and json.loads(u[index]["plot"])["data"]
              and json.loads(u[index]["plot"])["data"][0].get("type") == "bar"]
    assert panels[: len(CRITERIA)] == list(range(1, len(CRITERIA) + 1))
    report = json.loads(Path(final["results_file"]).read_text())
    assert report["compare"]["statistics"]["calibration_passes"] == 1
    assert set(report["compare"]["selections"]) == set(CRITERIA)


@pytest.mark.slow
def test_rerun_on_your_text_lets_your_text_choose_the_blocks(client, all_threads):  # noqa: F811
    small = run_kwargs(mode=settings.COMPARE, compare_criteria=["streamline", "weights"], eval_corpora=["ptb"],
                       eval_tokens=256)
    refused = client.submit(api_name="/rerun_on_your_text", **small)
    with pytest.raises(Exception, match="paste or upload your text"):
        refused.result(timeout=120)
    text = "\n\n".join(f"Chapter {i}. The tide turns when the moon says so, and the harbour waits. " * 12
                       for i in range(80))
    final = dict(zip(outputs.OUTPUT_NAMES, client.submit(api_name="/rerun_on_your_text", your_text=text,
                                                         **small).result(timeout=1800)))
    assert "Run complete" in final["status"]
    report = json.loads(Path(final["results_file"]).read_text())
    assert report["calibration"]["corpus"] == "your text" and "on your text" in report["compare"]["calibration_note"]
