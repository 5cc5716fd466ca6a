"""The command line: a whole run on a tiny local model, and one-line errors with exit code 2 (the bad-input table
is tests/test_cli_bad_input.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from ghosted_core.cli import main


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ghosted_core", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused run (exit code 2, no traceback, nothing else logged)."""
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


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


# Runs the CLI as if huggingface.co answered: `hub_reachable` says yes, and the Hub's replies come
# from `setup` (a patched download that raises what huggingface_hub raises, or a prepared cache).
HUB_CLI = """
import sys
import ghosted_core.model.loading
ghosted_core.model.loading.hub_reachable = lambda timeout=3.0: True
{setup}
from ghosted_core.cli import main
sys.exit(main(sys.argv[1:]))
"""

HUB_REPLY = """
import huggingface_hub.errors, transformers.utils.hub
http = __import__(huggingface_hub.errors.HfHubHTTPError.__mro__[1].__module__.split(".")[0])  # huggingface_hub's httpx

def reply(repo_id, filename, **kwargs):
    url = f"https://huggingface.co/{{repo_id}}/resolve/main/{{filename}}"
    raise huggingface_hub.errors.{error}("{status} Client Error", response=http.Response({status}, request=http.Request("GET", url)))

transformers.utils.hub.hf_hub_download = reply
"""


def run_hub_cli(model: str, setup: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(HUB_CLI).format(setup=setup)
    return subprocess.run([sys.executable, "-c", code, "--model", model, "--eval_ppl", "none"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("error, status, message", [
    ("RepositoryNotFoundError", 404, "is not a model on the Hugging Face Hub"),
    ("GatedRepoError", 403, "is a gated model on the Hugging Face Hub: request access at https://huggingface.co/"),
])
def test_hub_model_missing_or_gated_is_one_line(error, status, message):
    done = run_hub_cli("some-org/some-model", HUB_REPLY.format(error=error, status=status))
    line = one_error_line(done)
    assert "some-org/some-model" in line and message in line


def test_hub_model_needing_remote_code_is_one_line_and_never_runs_it(tmp_path):
    """A cached Hub repository whose config asks for its own code: refused before anything from it runs."""
    snapshot = tmp_path / "hub" / "models--some-org--custom-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text(json.dumps({
        "model_type": "custom_lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (snapshot / "configuration_custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    done = run_hub_cli("some-org/custom-model", "", env={"HF_HOME": str(tmp_path)})
    assert "needs its own modelling code (trust_remote_code)" in one_error_line(done)
    assert not (tmp_path / "ran").exists()


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


def test_sweep_prints_a_depth_by_operator_table_with_corpus_labels(tiny_model_folder, tmp_path, capsys):
    code = main(["--model", str(tiny_model_folder), "--total_num_prune", "1:3:2", "--insert_type", "none,ghost",
                 "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32", "--eval_ppl", "ptb,wiki",
                 "--eval_max_tokens", "64", "--outdir", str(tmp_path), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sweep"]["depths"] == [1, 3]
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("n "))
    assert "ppl ptb (exact)" in header and "ppl wiki (stand-in)" in header and "recovered ptb" in header
    assert "PTB (valid split, exact)" in out and "stand-in for WikiText-2" in out
    rows = [line.split() for line in lines[lines.index(header) + 1:] if line[:1].isdigit()]
    assert [(r[0], r[2]) for r in rows] == [("0", "dense"), ("1", "none"), ("1", "ghost"), ("3", "none"), ("3", "ghost")]
    for row, depth in zip(rows[1:], [1, 1, 3, 3]):
        entry = results["sweep"]["results"][0 if depth == 1 else 1]
        assert float(row[3]) == pytest.approx(entry["variants"][row[2]]["ppl"]["ptb"], rel=2e-3, abs=0.006)
    # the charts beside results.json: one self-contained page whose curve has a line per operator and corpus
    page = (tmp_path / "sweep.html").read_text()
    assert f"charts: {tmp_path / 'sweep.html'}" in out and "Perplexity against removed blocks" in page
    assert "Pruning damage recovered against depth" in page and "stand-in for WikiText-2" in page
    traces = [json.loads(m) for m in re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', page, re.S)]
    curve = [t for t in traces[0] if t.get("legendgroup") in ("none", "ghost")]
    assert len(curve) == 4 and all(list(t["x"]) == [1, 3] for t in curve)  # 2 operators × 2 corpora, both depths


def test_your_text_from_a_file_calibrates_and_evaluates(tiny_model_folder, tmp_path, capsys):
    text = "\n\n".join(f"Paragraph {i}. " + "The river keeps its own counsel when the water rises. " * 8
                       for i in range(80))
    path = tmp_path / "mine.txt"
    path.write_text(text)
    code = main(["--model", str(tiny_model_folder), "--total_num_prune", "2", "--insert_type", "none,ghost",
                 "--calibration_data", "yours", "--user_text", str(path), "--train_size", "4", "--seqlen", "32",
                 "--eval_ppl", "yours,ptb", "--eval_max_tokens", "64", "--outdir", str(tmp_path / "out"), "--quiet"])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["calibration"]["corpus"] == "your text" and "mine.txt" in results["calibration"]["label"]
    assert set(results["variants"]["ghost"]["ppl"]) == {"your text", "ptb"}
    assert "your text (mine.txt" in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_of_smollm2_from_the_command_line(tmp_path):
    """Acceptance: n = 2, 4, 6, 8, 10 on the embedded SmolLM2, default operators, the app's default calibration
    (mix, 12 × 256 tokens), perplexity capped at one 256-token window per corpus to keep it short."""
    done = run_cli("--total_num_prune", "2:10:2", "--train_size", "12", "--seqlen", "256", "--eval_max_tokens", "256",
                   "--outdir", str(tmp_path), "--quiet")
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    sweep = results["sweep"]
    assert sweep["depths"] == [2, 4, 6, 8, 10] and sweep["statistics"]["calibration_passes"] == 1
    assert [len(entry["removed_layers"]) for entry in sweep["results"]] == [2, 4, 6, 8, 10]
    assert sweep["variants"] == ["none", "diag", "rotate", "ghost", "ghost_capped", "magcomp_refit"]
    rows = [line.split() for line in done.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 1 + 5 * 6  # dense, then depth × operator
    for entry in sweep["results"]:
        none = entry["variants"]["none"]["ppl"]
        assert all(none[c] > sweep["dense"]["ppl"][c] for c in none)  # pruning hurts at every depth
    assert "stand-in for C4" in done.stdout and "ppl wiki (stand-in)" in done.stdout
    assert "Perplexity against removed blocks" in (tmp_path / "sweep.html").read_text()  # the curve chart


def test_too_little_calibration_warns_and_records_the_ridge_fallback(tiny_model_folder, tmp_path, capsys, caplog):
    """16 fit tokens < C = 36: a stderr warning, a ridge_fallback entry per fit, and a flag for any
    operator that does worse than plain pruning on the held-out sequences (marked `!`)."""
    import logging

    with caplog.at_level(logging.WARNING):
        code = main(["--model", str(tiny_model_folder), "--pruning_method", "manual", "--layers", "2-3",
                     "--insert_type", "none,ghost", "--calibration_data", "ptb", "--train_size", "1", "--seqlen", "16",
                     "--heldout_size", "2", "--eval_ppl", "none", "--outdir", str(tmp_path), "--quiet"])
    assert code == 0
    assert any("rank-deficient fit (16 tokens < 36 channels)" in r.message for r in caplog.records)
    assert any("fewer than 4·C = 144" in r.message for r in caplog.records)
    results = json.loads((tmp_path / "results.json").read_text())
    fit = results["variants"]["ghost"]["fits"][0]
    assert fit["ridge_fallback"].startswith("rank-deficient fit (16 tokens < 36 channels)")
    assert results["variants"]["ghost"]["boundary_error"][0]["ridge_fallback"] == fit["ridge_fallback"]
    assert results["variants"]["none"]["fits"][0]["ridge_fallback"] is None
    out = capsys.readouterr().out
    assert fit["heldout_error"] > 1  # 16 tokens for 36 channels: this seeded fit does worse than pruning on new text
    assert fit["heldout_worse_than_pruning"] and "worse than plain pruning on held-out calibration text" in fit["flags"]
    assert " !" in out and "! = worse than plain pruning on held-out calibration text" in out
    assert not results["variants"]["none"]["fits"][0]["heldout_worse_than_pruning"]
    assert results["memory_plan"]["fits"] and results["calibration"]["tokens"] == 16


def test_a_comma_list_compares_every_criterion_in_one_process_with_one_calibration_pass(tiny_model_folder, tmp_path,
                                                                                          monkeypatch, capsys):
    from ghosted_core.run import plans
    from ghosted_core.selection import choose
    from ghosted_core.selection.criteria import CRITERIA

    criteria = [name for name in CRITERIA if name not in ("none", "manual")]
    calibrations, similarity = [], []
    real_collect, real_similarity = plans.collect_stats, choose.measure_similarity_depths
    monkeypatch.setattr(plans, "collect_stats", lambda *a, **k: calibrations.append(a[1]) or real_collect(*a, **k))
    monkeypatch.setattr(choose, "measure_similarity_depths",
                        lambda *a, **k: similarity.append(a[1]) or real_similarity(*a, **k))
    code = main(["--model", str(tiny_model_folder), "--pruning_method", ",".join(criteria), "--total_num_prune", "2",
                 "--insert_type", "none,ghost_capped,replaceme_keepsink", "--calibration_data", "ptb", "--train_size",
                 "4", "--seqlen", "32", "--eval_ppl", "ptb,wiki", "--eval_max_tokens", "96", "--outdir", str(tmp_path),
                 "--quiet"])
    assert code == 0
    assert len(calibrations) == 1 and len(similarity) == 1  # ONE calibration pass, ONE similarity pass, in one process
    results = json.loads((tmp_path / "results.json").read_text())
    compare = results["compare"]
    assert compare["criteria"] == criteria and set(compare["selections"]) == set(criteria)
    for name in criteria:
        blocks = compare["selections"][name]["removed_layers"]
        assert len(blocks) == 2 and all(0 <= b < 6 for b in blocks)
        rows = [r for r in compare["table"] if r["criterion"] == name]
        assert [r["operator"] for r in rows] == ["none", "ghost_capped", "replaceme_keepsink"]
        assert all(r["removed_layers"] == blocks and set(r["ppl"]) == {"ptb", "wiki"} for r in rows)
    distinct = {tuple(s["removed_layers"]) for s in compare["selections"].values()}
    assert len(compare["plans"]) == len(distinct) and len(calibrations[0]) == compare["statistics"]["distinct_boundaries"]
    assert "PTB" in compare["calibration_note"]
    assert (tmp_path / "compare.html").exists()
    out = capsys.readouterr().out
    assert "sleb" in out and "ghost_capped" in out and "inspired by WRP" in out


@pytest.mark.parametrize("quiet", [False, True])
def test_a_comparison_reports_each_long_criterion_on_stderr_with_a_count_and_an_estimate(tiny_model_folder, tmp_path,
                                                                                       monkeypatch, capsys, quiet):
    from ghosted_core import cli, progress

    monkeypatch.setattr(progress, "MIN_INTERVAL", 0.0)  # the tiny model's loops take milliseconds: every step
    monkeypatch.setattr(cli, "StderrSink", lambda: progress.StderrSink(interval=0.0, min_seconds=0.0))
    code = main(["--model", str(tiny_model_folder), "--pruning_method", "swap_kl,kl", "--total_num_prune", "2",
                 "--insert_type", "none,ghost_capped", "--calibration_data", "ptb", "--train_size", "4", "--seqlen",
                 "32", "--eval_ppl", "ptb", "--eval_max_tokens", "64", "--outdir", str(tmp_path)]
                + (["--quiet"] if quiet else []))
    assert code == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("score swap_kl (both probes): ")]
    if quiet:
        assert lines == [] and "elapsed" not in captured.err
        return
    assert lines[-1].startswith("score swap_kl (both probes): 36 of 36 variants (100%)")  # 3 × 12 pairs, 1 batch
    assert "elapsed" in lines[-1]  # the estimate while it runs: tests/test_progress.py (here one group runs all 36)
    for what in ("score kl: ", "calibrate: ", "fit operators: ", "perplexity ptb"):
        assert what in captured.err, what
    assert captured.out.splitlines()[1].startswith("Best: ")  # stdout: the answer first, no progress


@pytest.mark.parametrize("args, message", [
    (["--pruning_method", "streamline,random"], "invalid choice: 'random'"),
    (["--pruning_method", "streamline,sleb", "--total_num_prune", "2:4"], "one depth"),
    (["--pruning_method", "streamline,none"], "'none' removes nothing"),
])
def test_bad_comparisons_are_one_line_errors(tiny_model_folder, args, message):
    done = run_cli("--model", str(tiny_model_folder), "--quiet", *args)
    assert message in one_error_line(done)
