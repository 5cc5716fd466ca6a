"""The 1.5B model through the command line, as a user runs it (`make test-real`: fetches the model first).

Qwen2.5-Coder-1.5B-Instruct (embedded as qwen2.5-coder-1.5b, bf16) with 2 of its 28 blocks removed, two
operators, one task at 50 examples: the model is above chance where the small ones are not, every variant
answers the same examples, and the summary states the paired differences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ghosted_core.model.embedded import needs_conversion

# The CLI on the 1.5B on 2 cores takes ~10 min: an hour is the subprocess's own limit, above pytest.ini's 15 min.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(3900)]


def test_the_cli_on_the_real_model(tmp_path):
    assert not needs_conversion("qwen2.5-coder-1.5b"), "run `make model-qwen` (make test-real does)"
    cmd = [sys.executable, "-m", "ghosted_core", "--model", "qwen2.5-coder-1.5b", "--dtype", "bfloat16",
           "--total_num_prune", "2", "--insert_type", "none,ghost_capped", "--train_size", "16", "--seqlen", "512",
           "--eval_ppl", "ptb", "--eval_max_tokens", "2048", "--eval_tasks", "arc_easy", "--task_limit", "50",
           "--no_speed", "--quiet", "--outdir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["removed_layers"]) == 2 and results["num_layers"] == 28 and results["hidden_size"] == 1536
    tasks = {name: v["tasks"]["scores"][0] for name, v in results["variants"].items()}
    assert set(tasks) == {"dense", "none", "ghost_capped"}
    assert len({tuple(t["example_ids"]) for t in tasks.values()}) == 1 and tasks["dense"]["n"] == 50
    assert tasks["dense"]["acc"] > tasks["dense"]["chance"] + 0.25  # far above chance (0.25), unlike the small models
    ppl = {name: v["ppl"]["ptb"] for name, v in results["variants"].items()}
    assert ppl["dense"] < ppl["none"] < 10 * ppl["dense"]
    comparison = results["task_comparisons"]["ghost_capped"]["vs_none"]["arc_easy"]
    assert comparison["n"] == 50 and comparison["low"] <= comparison["diff"] <= comparison["high"]
    assert "paired accuracy difference to none" in done.stdout and "Qwen2.5-Coder-1.5B" in done.stdout
