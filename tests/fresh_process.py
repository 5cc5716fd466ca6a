"""Load exported folders in a fresh Python process that cannot import ghosted_core, and compare them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

# Runs in a fresh interpreter whose cwd is a temporary folder and whose PYTHONPATH is unset:
# ghosted_core cannot be imported there, and the script checks that it never was.
FRESH_PROCESS = r"""
import importlib.util, json, sys
import torch
import transformers
assert importlib.util.find_spec("ghosted_core") is None, "ghosted_core is importable"
job = json.loads(sys.argv[1])
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


def fresh_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_MODULES_CACHE": str(work / "modules")}


def load_in_fresh_process(work: Path, folders: dict[str, Path], ids: torch.Tensor, trust_remote_code: bool,
                          auto: str = "AutoModelForCausalLM") -> dict:
    """Logits and greedy tokens of each folder, loaded by plain transformers (its `auto` class) in a process
    without ghosted_core."""
    work.mkdir(parents=True, exist_ok=True)
    torch.save(ids, work / "ids.pt")
    job = {"ids": str(work / "ids.pt"), "out": str(work / "out.pt"), "trust_remote_code": trust_remote_code, "auto": auto,
           "folders": {name: str(folder) for name, folder in folders.items()}}
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
