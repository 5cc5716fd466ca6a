"""Runs side by side: the runs done in this browser session, as a table, a CSV, and settings to restore.

The history lives in the session's `gr.State` (one list per browser tab, gone with it): each
entry holds the widget values the run was started with (so one click restores them) and one
row per variant with its perplexity per corpus and the run's timings. Nothing of it is written
to disk except the CSV offered for download, written in the run's temporary folder.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ghosted_core.report.tables import blocks_text, corpus_tag

HISTORY_LIMIT = 50  # runs kept per session (the oldest go first)


def history_entry(number: int, settings: dict, report: dict, state: str) -> dict:
    """One finished (or stopped) run: its settings and a row per variant."""
    removed = report.get("removed_layers", [])

    def row(blocks: str, name: str, entry: dict) -> dict:
        return {"blocks": blocks, "operator": name, **{corpus_tag(report, c): ppl for c, ppl in entry.get("ppl", {}).items()}}

    if "compare" in report:
        rows = [row(f"{r['criterion']}: {blocks_text(r['removed_layers'])}", r["operator"], r)
                for r in report["compare"].get("table", [])]
    elif "sweep" in report:
        rows = [row(f"{depth['n']}: {blocks_text(depth['removed_layers'])}", name, entry)
                for depth in report["sweep"].get("results", []) for name, entry in depth["variants"].items()]
    else:
        rows = [row(f"{len(removed)}: {blocks_text(removed)}" if name != "dense" else "none", name, entry)
                for name, entry in report.get("variants", {}).items()]
    timings = report.get("timings", {})
    return {"run": number, "model": report.get("model", settings.get("model")), "criterion": report.get("criterion", ""),
            "state": state, "seconds": round(sum(timings.values()), 1), "settings": dict(settings), "rows": rows}


def add_run(history: Sequence[dict] | None, settings: dict, report: dict, state: str) -> list[dict]:
    """The history with this run appended (a new list: gr.State values are replaced, not mutated)."""
    past = list(history or [])
    number = (past[-1]["run"] + 1) if past else 1
    return (past + [history_entry(number, settings, report, state)])[-HISTORY_LIMIT:]


def history_table(history: Sequence[dict] | None) -> pd.DataFrame:
    """Every run × variant of the session: model, criterion, blocks, operator, perplexity per corpus, time."""
    records = []
    for entry in history or []:
        for row in entry["rows"]:
            records.append({"run": entry["run"], "model": entry["model"], "criterion": entry["criterion"],
                            "state": entry["state"], **row, "run time (s)": entry["seconds"]})
    if not records:
        return pd.DataFrame(columns=["run", "model", "criterion", "blocks", "operator", "run time (s)"])
    table = pd.DataFrame.from_records(records)
    return table.map(lambda v: round(v, 3) if isinstance(v, float) else v)


def history_csv(history: Sequence[dict] | None, folder: str | Path) -> str | None:
    """The history table as a CSV file in `folder` (the run's own temporary folder: Gradio copies it when shown)."""
    table = history_table(history)
    if table.empty:
        return None
    path = Path(folder) / "ghosted-runs.csv"
    table.to_csv(path, index=False, quoting=csv.QUOTE_MINIMAL)
    return str(path)


def settings_of(history: Sequence[dict] | None, row: int) -> dict | None:
    """The settings of the run shown in table row `row` (None when the row is out of range)."""
    table_runs = [entry for entry in history or [] for _ in entry["rows"]]
    if not 0 <= row < len(table_runs):
        return None
    return table_runs[row]["settings"]
