"""The command line: a whole run on a tiny local model, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ghosted_core.cli import main
from ghosted_core.hub import hub_reachable


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ghosted_core", *args], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_whole_run_writes_results(tiny_model_folder, tmp_path, capsys):
    code = main(["--model", str(tiny_model_folder), "--pruning_method", "streamline", "--total_num_prune", "2",
                 "--insert_type", "none,diag,rotate,ghost,ghost_capped,replaceme,ghost+seq", "--calibration_data", "ptb",
                 "--train_size", "4", "--seqlen", "32", "--eval_ppl", "ptb,wiki", "--eval_max_tokens", "128",
                 "--outdir", str(tmp_path), "--prompt", "The market", "--max_new_tokens", "4", "--quiet",
                 "--save_model", str(tmp_path / "saved")])
    assert code == 0
    assert (tmp_path / "saved" / "ghost+seq" / "model.safetensors").exists()
    assert not (tmp_path / "saved" / "dense").exists()
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["num_layers"] == 6 and len(results["removed_layers"]) == 2
    assert results["boundaries"] == [[results["removed_layers"][0], results["removed_layers"][0] + 2]]
    assert len(results["scores"]) == 5
    assert results["corpora"]["ptb"]["real"] is True and "stand-in" in results["corpora"]["wiki"]["label"]
    assert set(results["variants"]) == {"dense", "none", "diag", "rotate", "ghost", "ghost_capped", "replaceme",
                                        "ghost+seq"}
    for name, entry in results["variants"].items():
        assert set(entry["ppl"]) == {"ptb", "wiki"} and all(v > 1 for v in entry["ppl"].values())
        assert isinstance(entry["generation"], str)
        if name != "dense":
            assert len(entry["boundary_error"]) == 1 and len(entry["antisym_fraction"]) == 1
    assert results["variants"]["none"]["boundary_error"][0]["fit"] == pytest.approx(1.0)
    assert {"load model", "score blocks", "calibrate", "fit operators", "perplexity"} <= set(results["timings"])
    out = capsys.readouterr().out
    assert "PTB (valid split, exact)" in out and "stand-in" in out


@pytest.mark.parametrize("args, message", [
    (["--total_num_prune", "30"], "leaves none"),
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "meta-llama/Llama-3.1-8B"], "Hub is not reachable"),
    (["--insert_type", "ghost,magic"], "unknown operator 'magic'"),
    (["--calibration_data", "nowhere"], "unknown corpus"),
    (["--pruning_method", "manual", "--layers", "3,99"], "out of range"),
    (["--pruning_method", "random"], "invalid choice"),
])
def test_bad_input_gives_one_line_and_exit_code_2(args, message):
    hub_reachable.cache_clear()
    done = run_cli(*args, "--eval_ppl", "none")  # not --quiet: the default log level must not add lines
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert lines[0].startswith("error: ")


def test_unknown_task_is_one_line_and_exit_code_2():
    done = run_cli("--eval_tasks", "arc_easy,hellaswagg", "--quiet", "--eval_ppl", "none")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown task(s): hellaswagg" in lines[0]


def test_tasks_stage_runs_lm_eval_for_every_variant(tiny_model_folder, tmp_path):
    code = main(["--model", str(tiny_model_folder), "--pruning_method", "manual", "--layers", "3,4",
                 "--insert_type", "none,ghost", "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
                 "--eval_ppl", "none", "--eval_tasks", "copa,race", "--task_limit", "6", "--outdir", str(tmp_path),
                 "--quiet"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("dense", "none", "ghost"):
        tasks = results["variants"][name]["tasks"]
        copa = tasks["scores"][0]
        assert copa["task"] == "copa" and copa["n"] == 6 and 0 <= copa["acc"] <= 1
        assert tasks["unavailable"][0]["task"] == "race"
        assert copa["example_ids"] == results["variants"]["dense"]["tasks"]["scores"][0]["example_ids"]
