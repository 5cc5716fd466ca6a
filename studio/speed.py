"""How long a default run takes here: measured by bench/app_speed.py, or estimated from its measurement.

The bench writes `bench/results/app_speed.json` with the machine it ran on (`machine()`). On
the same machine the page quotes that measurement; elsewhere it scales it by the number of
CPU cores (the stages are matrix products that use every core) and says it is an estimate;
on a GPU it says the CPU figure is an upper bound.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from ghosted_core.export.gain import cpu_name
from studio.settings import DEFAULTS

log = logging.getLogger(__name__)

MEASUREMENT = Path(__file__).resolve().parents[1] / "bench" / "results" / "app_speed.json"
# The defaults a default run's time depends on (a measurement with other values is said to be of earlier defaults).
TIMED_SETTINGS = ("model", "criterion", "depth", "operators", "calibration", "samples", "seqlen", "eval_corpora",
                  "eval_tokens", "drift_windows", "new_tokens")


def machine() -> dict:
    """What identifies this machine's speed: CPU cores and model, and the GPU if any."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu": cpu_name(), "gpu": gpu}


def default_run_note(path: Path = MEASUREMENT) -> str:
    """One sentence for the page: what a default run takes on this machine, and where that figure comes from."""
    try:
        measured = json.loads(path.read_text())
        walls = [run["wall_s"] for run in measured["runs"]]
    except (OSError, ValueError, KeyError) as err:
        log.info("no app speed measurement at %s: %s", path, err)
        return "A default run's time has not been measured here (bench/app_speed.py measures it)."
    typical = statistics.median(walls)
    where = measured.get("machine") or {"cores": measured.get("cores")}
    here = machine()
    now = json.loads(json.dumps(asdict(DEFAULTS)))
    then = measured.get("defaults", {})
    same_defaults = all(then.get(name) == now[name] for name in TIMED_SETTINGS)
    caveat = "" if same_defaults else " (measured with earlier defaults)"
    if here["gpu"]:
        return (f"A default run took about {typical:.0f} s on a {where.get('cores')}-core CPU{caveat}; on this "
                f"machine's GPU ({here['gpu']}) expect less (not measured).")
    if where.get("cpu") == here["cpu"] and where.get("cores") == here["cores"]:
        return (f"A default run takes about {typical:.0f} s on this machine ({here['cores']} CPU cores; "
                f"bench/app_speed.py measured {', '.join(f'{w:.0f}' for w in walls)} s){caveat}.")
    cores = where.get("cores") or here["cores"]
    estimate = typical * cores / max(1, here["cores"])
    return (f"A default run should take about {estimate:.0f} s on this machine's {here['cores']} CPU cores: an "
            f"estimate scaled from {typical:.0f} s measured on {cores} cores by bench/app_speed.py{caveat}.")
