"""The comparison's charts and table from a real comparison on the tiny model: every panel filled, every choice marked."""

from __future__ import annotations

import pytest

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.report import compare as report
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


def test_the_table_has_a_row_per_criterion_and_operator_and_names_the_calibration_text(compared):
    table = report.compare_table(compared)
    assert len(table) == 1 + len(CRITERIA) * 2 and list(table["operator"])[:3] == ["–", "none", "ghost_capped"]
    assert {"ptb (exact) ppl", "wiki (stand-in) ppl", "criterion cost"} <= set(table.columns)
    assert all("s" in cost for cost in table["criterion cost"][1:])
    caption = report.compare_caption(compared)
    assert "blocks chosen (and operators fitted) on PTB" in caption and "rerun on yours" in caption
    text = report.compare_text(compared)
    assert "sleb" in text and "full-pass equivalents" in text
