"""Load exported folders in a fresh Python process that cannot import ghosted_core, and compare them."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

# Runs in a fresh interpreter whose cwd is a temporary folder and whose PYTHONPATH is unset:
# ghosted_core cannot be imported there, and the script checks that it never was.
FRESH_JOB = r"""
import importlib.util, json, sys
import torch
import transformers
assert importlib.util.find_spec("ghosted_core") is None, "ghosted_core is importable"


def run_job(job):
    ids = torch.load(job["ids"])
    out = {}
    for name, folder in job["folders"].items():
        auto = getattr(transformers, job["auto"])
        model = auto.from_pretrained(folder, trust_remote_code=job["trust_remote_code"], dtype=torch.float32)
        with torch.no_grad():
            logits = model(ids).logits
        tokens = model.generate(ids[:1, :6], max_new_tokens=8, do_sample=False, pad_token_id=0)
        out[name] = {"logits": logits, "tokens": tokens, "class": type(model).__name__}
    assert "ghosted_core" not in sys.modules
    torch.save(out, job["out"])
"""
FRESH_PROCESS = FRESH_JOB + "\nrun_job(json.loads(sys.argv[1]))\n"
# The same, kept running: one job per line of stdin, one answer line per job (transformers imported once).
FRESH_LOOP = FRESH_JOB + r"""
import traceback
for line in sys.stdin:
    try:
        run_job(json.loads(line))
        answer = {"ok": True}
    except Exception:
        answer = {"ok": False, "error": traceback.format_exc()[-4000:]}
    print("@@fresh " + json.dumps(answer), flush=True)
"""


def fresh_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_MODULES_CACHE": str(work / "modules")}


class FreshWorker:
    """One fresh process (as FRESH_PROCESS's) that loads stock folders job after job: the interpreter and
    transformers start once per test process, not once per job. Stock folders only: a remote-code folder's module
    is cached by name in the process, so each of those gets a process of its own."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.work: Path | None = None
        atexit.register(self.close)

    def run(self, job: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            work = self.work = Path(tempfile.mkdtemp(prefix="fresh-worker-"))
            self.proc = subprocess.Popen([sys.executable, "-c", FRESH_LOOP], cwd=work, env=fresh_env(work), text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@fresh "):
                answer = json.loads(line[len("@@fresh "):])
                assert answer["ok"], answer.get("error")
                return
        raise AssertionError("the fresh process ended before answering")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None


FRESH_WORKER = FreshWorker()


def load_in_fresh_process(work: Path, folders: dict[str, Path], ids: torch.Tensor, trust_remote_code: bool,
                          auto: str = "AutoModelForCausalLM") -> dict:
    """Logits and greedy tokens of each folder, loaded by plain transformers (its `auto` class) in a process
    without ghosted_core (stock folders: the test process's one FreshWorker)."""
    work.mkdir(parents=True, exist_ok=True)
    torch.save(ids, work / "ids.pt")
    job = {"ids": str(work / "ids.pt"), "out": str(work / "out.pt"), "trust_remote_code": trust_remote_code, "auto": auto,
           "folders": {name: str(folder) for name, folder in folders.items()}}
    if not trust_remote_code:
        FRESH_WORKER.run(job)
        return torch.load(work / "out.pt")
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, json.dumps(job)], cwd=work, env=fresh_env(work),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(work / "out.pt")


def assert_same_model(loaded: dict, variant, ids: torch.Tensor, rtol: float = 1e-5) -> None:
    """Logits within `rtol` of the in-memory variant (relative to their largest value) and the same greedy tokens."""
    with torch.no_grad():
        expected = variant(ids).logits
    gap = float((loaded["logits"] - expected).abs().max() / expected.abs().max())
    assert gap <= rtol, gap
    tokens = variant.generate(ids[:1, :6], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded["tokens"], tokens)


def weight_keys(folder: Path) -> set[str]:
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys
