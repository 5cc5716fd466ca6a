"""The comparison's charts and table from a real comparison on the tiny model: every panel filled, every choice marked."""

from __future__ import annotations

import pytest

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.report import compare as report
from ghosted_core.report import summary, tables
from ghosted_core.run.compare import run_compare
from ghosted_core.run.options import RunOptions, parse_variants

CRITERIA = ["streamline", "shortgpt", "kl", "sleb", "weights"]


@pytest.fixture(scope="module")
def compared(tiny_model_folder):
    loaded = load_model(str(tiny_model_folder), LoadOptions(device="cpu"))
    options = RunOptions(model=str(tiny_model_folder), num_prune=2, variants=parse_variants("none,ghost_capped"),
                         calibration="ptb", train_size=4, seqlen=32, heldout_size=1, eval_corpora=("ptb", "wiki"),
                         eval_max_tokens=64, drift_windows=0, quiet=True, calibrate=CalibrationOptions(quiet=True))
    return run_compare(options, CRITERIA, loaded).to_json()


def test_the_map_is_drawn_with_every_criterions_runs_outlined(compared):
    fig = report.similarity_map_figure(compared)
    heat = fig.data[0]
    assert heat.type == "heatmap" and len(heat.z) == 7 and len(heat.z[0]) == 7
    legend = [t.name for t in fig.data[1:]]
    assert [name.split(":")[0] for name in legend] == CRITERIA
    boundaries = sum(len(s["boundaries"]) for s in compared["compare"]["selections"].values())
    assert len(fig.layout.shapes) == boundaries
    first = compared["compare"]["selections"]["streamline"]["boundaries"][0]
    assert any(abs(shape.x0 - (first[0] - 0.5)) < 1e-9 and abs(shape.x1 - (first[1] + 0.5)) < 1e-9
               for shape in fig.layout.shapes)


def test_each_criterion_has_a_score_panel_with_its_choice_highlighted(compared):
    fig = report.criterion_scores_figure(compared)
    assert [t.name for t in fig.data] == CRITERIA
    for trace in fig.data:
        selection = compared["compare"]["selections"][trace.name]
        gray = {i for i, c in enumerate(trace.marker.color) if c == "#cbd5e1"}
        chosen = set(range(len(trace.y))) - gray
        if "per run start" in selection["score_label"]:
            assert chosen == {min(selection["removed_layers"])}
        else:
            assert chosen == set(selection["removed_layers"])
    assert "weights (ours, inspired by WRP" in " ".join(a.text for a in fig.layout.annotations)


def test_the_table_is_criteria_by_operators_with_the_best_cell_marked(compared):
    table = report.compare_table(compared)
    assert list(table["criterion"]) == CRITERIA  # one row per criterion, its name once
    assert list(table.columns) == ["criterion", "blocks removed", "none", "ghost_capped", "scoring cost"]
    rows = {row["criterion"]: row for row in compared["compare"]["table"]}  # any row of each criterion
    marked = [(c, op) for c in CRITERIA for op in ("none", "ghost_capped")
              if table.set_index("criterion").loc[c, op].startswith(report.BEST_MARK)]
    assert marked == [summary.best_cell(compared)]  # exactly one cell marked, the lowest mean perplexity
    cells = [r for r in compared["compare"]["table"]]
    means = {(r["criterion"], r["operator"]): summary.mean_ppl(r["ppl"], ["ptb", "wiki"]) for r in cells}
    assert means[marked[0]] == min(means.values())
    first = next(r for r in cells if r["criterion"] == "sleb" and r["operator"] == "none")
    assert table.set_index("criterion").loc["sleb", "none"].lstrip(report.BEST_MARK + " ") == \
        f"{tables.fmt(first['ppl']['ptb'], 1)} · {tables.fmt(first['ppl']['wiki'], 1)}"  # one cell: every corpus
    assert all(" s, " in cost for cost in table["scoring cost"]) and rows["sleb"]["cost"]["seconds"] > 0
    html = report.compare_table(compared).to_html(index=False)
    assert html.count("</tr>") == 1 + len(CRITERIA) and report.BEST_MARK in html
    caption = report.compare_caption(compared)
    assert "blocks chosen (and operators fitted) on PTB" in caption and "rerun on yours" in caption
    assert "cells: ptb (exact) · wiki (stand-in) perplexity (dense: " in caption
    text = report.compare_text(compared)
    assert "sleb" in text and "full-pass equivalents" in text
    assert text.splitlines()[1].startswith(f"Best: {marked[0][0]} + {marked[0][1]} (blocks ")  # the answer leads


def test_the_answer_names_the_winner_its_margins_and_what_it_buys(compared):
    lines = summary.compare_headline(compared)
    criterion, operator = summary.best_cell(compared)
    assert lines[0].startswith(f"**Best: {criterion} + {operator}**") and "dense" in lines[0]
    assert lines[1].startswith("**By how much:**") and "lower than the best on other blocks" in lines[1]
    assert lines[-1].startswith("**What it buys:** 2 of 6 blocks removed (33% of the decoder) at ")
    assert summary.headline(compared) == lines and summary.headline({"sweep": {}}) == []
