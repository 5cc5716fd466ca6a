"""Where bench scripts write their JSON, so that a quick try never overwrites the results the README quotes,
and the stamp a partial rerun leaves on what it writes into an existing report.

A full run writes `bench/results/<name>.json` (committed and quoted); `--quick` writes
`bench/results/<name>_quick.json` beside it; `--out PATH` writes exactly there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(name: str, quick: bool = False, out: str | None = None) -> Path:
    """`out` if given, else the full or quick results file of bench `name`."""
    if out:
        return Path(out)
    return RESULTS / (f"{name}_quick.json" if quick else f"{name}.json")


def out_help(name: str) -> str:
    return f"results file (default: bench/results/{name}.json, or {name}_quick.json with --quick)"


def rerun_stamp(script: str) -> dict:
    """The command line, commit and load average of this run of bench/`script`: a rerun that writes one entry
    into an existing report stamps it, as the report's own command and commit stand for the rest."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parents[1], capture_output=True,
                            text=True).stdout.strip()
    return {"command": f"python bench/{script} " + " ".join(sys.argv[1:]), "commit": commit,
            "load_average": os.getloadavg()}
