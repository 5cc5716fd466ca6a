"""A depth sweep on the page: perplexity against removed blocks, damage recovered against depth, a depth × operator table.

Everything here reads the sweep's JSON snapshot (`ghosted_core.sweep.SweepResult.to_json()`),
which grows depth by depth while the sweep runs, so the charts fill in as depths finish.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from ghosted_core.files import write_text
from ghosted_core.report.charts import base_figure, empty_figure
from ghosted_core.report.tables import DENSE_COLOR, SIZE_COLUMN, SPEED_COLUMN, blocks_text, corpus_tag, esc, fmt, \
    gain_caption, gain_cells, ppl_columns, tokens_text, variant_colors, worse_boundaries
from ghosted_core.report.tradeoff import tradeoff_figure

CORPUS_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def _depth_results(report: dict) -> list[dict]:
    return report.get("sweep", {}).get("results", [])


def _corpora(report: dict) -> list[str]:
    return list(report.get("sweep", {}).get("dense", {}).get("ppl", {}))


def _subtitle(report: dict) -> list[str]:
    sweep = report.get("sweep", {})
    cal = report.get("calibration", {})
    depths = sweep.get("depths", [])
    return [report.get("model", ""), f"{report.get('criterion', '')}, n = {', '.join(map(str, depths))} "
            f"of {report.get('num_layers', '?')} blocks",
            f"calibration {cal.get('label', '').split(' (')[0]}, {cal.get('sequences', '?')} × {cal.get('seqlen', '?')} tokens"
            if cal.get("label") else "", "one scoring and one calibration pass for every depth"]


def _corpus_legend(report: dict, corpus: str) -> str:
    """'ptb (exact), 1,020 tokens': the corpus and how many predicted tokens its perplexities rest on."""
    return f"{corpus_tag(report, corpus)}, {tokens_text(report, corpus)}"


def _legend_for_corpora(fig: go.Figure, report: dict) -> None:
    """One legend entry per corpus (its line style), so each operator needs one entry, not one per corpus;
    the figure grows by a legend line per entry (one entry a line on a phone)."""
    corpora = _corpora(report)
    for k, corpus in enumerate(corpora):
        fig.add_scatter(x=[None], y=[None], mode="lines", name=_corpus_legend(report, corpus), legendgroup=f"corpus {k}",
                        line=dict(color="#64748b", dash=CORPUS_DASHES[k % len(CORPUS_DASHES)], width=2))
    entries = sum(1 for trace in fig.data if trace.showlegend is not False)
    fig.update_layout(height=fig.layout.height + 20 * entries)


def curve_figure(report: dict) -> go.Figure:
    """Perplexity (log axis) against removed blocks: one line per operator and corpus, dense as a reference per corpus."""
    results = _depth_results(report)
    if not results:
        return empty_figure("the curve appears as the depths finish")
    fig = base_figure("Perplexity against removed blocks", _subtitle(report))
    depths = [r["n"] for r in results]
    operators = report.get("sweep", {}).get("variants", [])
    colors = variant_colors(operators)
    for k, corpus in enumerate(_corpora(report)):
        dash = CORPUS_DASHES[k % len(CORPUS_DASHES)]
        dense = report["sweep"]["dense"]["ppl"][corpus]
        fig.add_scatter(x=[min(depths), max(depths)], y=[dense, dense], mode="lines", name="dense", legendgroup="dense",
                        line=dict(color=DENSE_COLOR, dash=dash, width=1.5), showlegend=k == 0,
                        hovertemplate=f"dense · {corpus}: %{{y:.4g}}<extra></extra>")
        _add_depth_lines(fig, results, operators, corpus, "ppl", dash, colors, "%{x} blocks removed: %{y:.4g}", k == 0)
    _legend_for_corpora(fig, report)
    fig.update_yaxes(type="log", title_text="perplexity (log)")
    fig.update_xaxes(title_text="blocks removed", tickvals=depths)
    return fig


def _add_depth_lines(fig: go.Figure, results: list[dict], operators: list[str], corpus: str, key: str, dash: str,
                     colors: dict[str, str], hover: str, legend: bool) -> None:
    """One line per operator through the depths: the `key` entry ("ppl" or "recovered") on `corpus`."""
    depths = [r["n"] for r in results]
    for name in operators:
        ys = [r["variants"].get(name, {}).get(key, {}).get(corpus) for r in results]
        fig.add_scatter(x=depths, y=ys, mode="lines+markers", name=name, legendgroup=name, showlegend=legend,
                        line=dict(color=colors[name], dash=dash, width=2), marker=dict(size=6),
                        hovertemplate=f"{name} · {corpus}<br>{hover}<extra></extra>")


def recovered_figure(report: dict) -> go.Figure:
    """Share of the pruning damage each operator recovers, (ppl_none − ppl_op) / (ppl_none − ppl_dense), per depth."""
    results = _depth_results(report)
    operators = [name for name in report.get("sweep", {}).get("variants", []) if name != "none"]
    if not results or not operators or "none" not in report.get("sweep", {}).get("variants", []):
        return empty_figure("damage recovered appears as the depths finish (it needs the `none` operator)")
    fig = base_figure("Pruning damage recovered against depth", [*_subtitle(report)[:2], "100% = dense, 0% = plain pruning"])
    depths = [r["n"] for r in results]
    colors = variant_colors(operators)
    for k, corpus in enumerate(_corpora(report)):
        dash = CORPUS_DASHES[k % len(CORPUS_DASHES)]
        _add_depth_lines(fig, results, operators, corpus, "recovered", dash, colors, "%{x} blocks: %{y:.0%}", k == 0)
    _legend_for_corpora(fig, report)
    fig.add_hline(y=0.0, line_dash="dot", line_color="#94a3b8")
    fig.update_yaxes(tickformat=".0%", title_text="damage recovered")
    fig.update_xaxes(title_text="blocks removed", tickvals=depths)
    return fig


def sweep_table(report: dict) -> pd.DataFrame:
    """One row per depth and operator: removed blocks, perplexity and damage recovered per corpus, held-out boundary error."""
    corpora = _corpora(report)
    columns = ["blocks removed", "which", "operator", *ppl_columns(report, corpora), "held-out boundary error",
               SIZE_COLUMN, SPEED_COLUMN]
    rows = []
    for result in _depth_results(report):
        which = blocks_text(result["removed_layers"])
        for name, entry in result["variants"].items():
            row = [result["n"], which, name]
            for corpus in corpora:
                share = entry.get("recovered", {}).get(corpus)
                row += [fmt(entry.get("ppl", {}).get(corpus)), "–" if share is None or name == "none" else f"{share:.0%}"]
            errors = ", ".join(fmt(e.get("heldout"), 3) for e in entry.get("boundary_error", [])) or "–"
            row.append(f"{errors} ⚠" if worse_boundaries(entry) else errors)
            rows.append(row + gain_cells(entry))
    return pd.DataFrame(rows, columns=columns)


def sweep_caption(report: dict) -> str:
    """What the sweep charts and table rest on: corpora with their token counts, the formula, what is stand-in."""
    sweep = report.get("sweep", {})
    done = [r["n"] for r in sweep.get("results", [])]
    pending = [n for n in sweep.get("depths", []) if n not in done]
    corpora = " · ".join(f"{esc(c)} = {esc(report['corpora'].get(c, {}).get('label', c))} ({tokens_text(report, c)})"
                         for c in _corpora(report))
    state = f"depths done: {', '.join(map(str, done)) or 'none yet'}" + (
        f"; still to come: {', '.join(map(str, pending))}" if pending else "")
    return (f"**{esc(report.get('model', ''))}** ({report.get('num_layers', '?')} blocks) · {report.get('criterion', '')} "
            f"sweep · {state}  \n{corpora}  \nrecovered = (ppl_none − ppl_op) / (ppl_none − ppl_dense); ⚠ held-out "
            "boundary error above 1 (worse than plain pruning on held-out calibration text)"
            + (f"  \n{gain}" if (gain := gain_caption(next((r.get("gain") for r in sweep.get("results", [])), None)))
               else ""))


def write_sweep_html(report: dict, path: str | Path) -> Path:
    """The curve and damage-recovered charts, caption and table in one self-contained HTML page
    (plotly.js inlined, so it opens offline): what the CLI leaves beside results.json."""
    caption = sweep_caption(report).replace("  \n", "<br>").replace("**", "")  # its model and labels come escaped
    charts = [figure.to_html(full_html=False, include_plotlyjs=k == 0)
              for k, figure in enumerate((curve_figure(report), recovered_figure(report), tradeoff_figure(report)))]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Depth sweep · {html.escape(report.get('model', ''))}"
            f"</title></head><body style='font-family:sans-serif;max-width:1100px;margin:auto'><h1>Depth sweep</h1>"
            f"<p>{caption}</p>{''.join(charts)}{sweep_table(report).to_html(index=False, border=0)}</body></html>")
    return write_text(path, page, "sweep.html")
