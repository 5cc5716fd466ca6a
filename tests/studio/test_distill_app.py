"""Distillation in the app: the widgets through the public /run endpoint, a live curve, the status, the save list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ghosted_core.errors import GhostedError
from ghosted_core.run.options import DISTILL_CHOICES
from studio import outputs
from studio.runner import build_options, distill_variants, planned_stages, QuickTasks


def test_the_switch_adds_distilled_variants_beside_the_chosen_operators():
    assert distill_variants(["none", "ghost_capped", "magcomp_refit"], False, "operator") == []
    assert distill_variants(["none", "ghost_capped", "magcomp_refit"], True, "operator") == \
        ["none+kd_mlp", "ghost_capped+kd", "magcomp_refit+kd"]
    assert distill_variants(["none", "ghost"], True, "both") == ["none+kd_mlp", "ghost+kd", "ghost+kd_mlp"]
    with pytest.raises(GhostedError, match="'What trains' must be one of"):
        distill_variants(["ghost"], True, "everything")
    with pytest.raises(GhostedError, match="'Distill after the fit' must be true or false"):
        distill_variants(["ghost"], "yes", "operator")
    options = build_options("smollm2-135m", "streamline", 7, "", ["none", "ghost"], "mix", 12, 256, 0, ["ptb"], 256,
                            "", 4, True, 5, "stock")
    assert [v.name for v in options.variants] == ["none", "ghost", "none+kd_mlp", "ghost+kd_mlp"]
    assert options.distill.steps == 5
    assert "distill" in planned_stages(options, QuickTasks())
    with pytest.raises(GhostedError, match="'Distillation steps'"):
        build_options("smollm2-135m", "streamline", 7, "", ["ghost"], "mix", 12, 256, 0, ["ptb"], 256, "", 4, True,
                      10**6, "operator")
    assert {"ghost_capped+kd", "none+kd_mlp", "magcomp_refit+kd_mlp"} <= set(DISTILL_CHOICES)
    assert "none+kd" not in DISTILL_CHOICES and "magcomp+kd" not in DISTILL_CHOICES


def test_a_distilling_run_through_the_public_api_draws_its_curve_and_reports_it(tiny_server):
    from gradio_client import Client

    client = Client(tiny_server.url, verbose=False)
    job = client.submit(api_name="/run", **tiny_server.run_kwargs(distill_on=True, distill_steps=3,
                                                                  distill_train="operator"))
    result = job.result(timeout=600)
    assert "Run complete" in result[outputs.OUTPUT_NAMES.index("status")]
    live = [update for update in job.outputs()
            if "Run complete" not in update[0] and (update[outputs.OUTPUT_NAMES.index("distill_plot")] or {}).get("plot")
            and "validation" in update[outputs.OUTPUT_NAMES.index("distill_plot")]["plot"]]
    assert len(live) >= 2  # the curve was drawn while the students trained, not only at the end
    figure = result[outputs.OUTPUT_NAMES.index("distill_plot")]
    plot = json.loads(figure["plot"])
    names = {trace["name"] for trace in plot["data"]}
    assert {"ghost+kd train", "ghost+kd validation", "none+kd_mlp validation"} <= names
    report = json.loads(Path(result[outputs.OUTPUT_NAMES.index("results_file")]).read_text())
    assert report["variants"]["ghost+kd"]["distill"]["steps"] == 3
    assert report["variants"]["none+kd_mlp"]["ppl"]["ptb"] > 1
