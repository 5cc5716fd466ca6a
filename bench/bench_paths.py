"""Where bench scripts write their JSON, so that a quick try never overwrites the results the README quotes.

A full run writes `bench/results/<name>.json` (committed and quoted); `--quick` writes
`bench/results/<name>_quick.json` beside it; `--out PATH` writes exactly there.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(name: str, quick: bool = False, out: str | None = None) -> Path:
    """`out` if given, else the full or quick results file of bench `name`."""
    if out:
        return Path(out)
    return RESULTS / (f"{name}_quick.json" if quick else f"{name}.json")


def out_help(name: str) -> str:
    return f"results file (default: bench/results/{name}.json, or {name}_quick.json with --quick)"
