"""A criteria comparison on the page: the layer-similarity map, each criterion's scores, the criterion × operator table.

Everything here reads the comparison's JSON snapshot (`run.compare.CompareResult.to_json()`), which
grows criterion by criterion, so the charts and the table fill in as the run goes. `compare_text`
and `write_compare_html` give the CLI the same table and charts.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ghosted_core.report.charts import base_figure, empty_figure, finite_range, wrap_parts
from ghosted_core.report.summary import best_cell, compare_headline
from ghosted_core.report.tables import PALETTE, blocks_text, corpus_tag, fmt, tokens_text
from ghosted_core.selection.criteria import CRITERIA, criterion_title

SCORE_PANEL = 170  # px per criterion in the score chart


def _compare(report: dict) -> dict:
    return report.get("compare", {})


def criterion_colors(names: list[str]) -> dict[str, str]:
    """A stable colour per criterion, in the registry's order."""
    order = list(CRITERIA)
    return {name: PALETTE[(order.index(name) if name in order else len(order)) % len(PALETTE)] for name in names}


def _corpora(report: dict) -> list[str]:
    return list(_compare(report).get("dense", {}).get("ppl", {}))


def _subtitle(report: dict) -> list[str]:
    compare = _compare(report)
    return [report.get("model", ""), f"n = {compare.get('n', '?')} of {report.get('num_layers', '?')} blocks",
            compare.get("calibration_note", "")]


def similarity_map_figure(report: dict) -> go.Figure:
    """The (L+1)×(L+1) mean per-token cosine map; each criterion's removed runs outlined in its colour."""
    found = _compare(report).get("similarity_map")
    if not found:
        return empty_figure("the layer-similarity map appears once the blocks are scored")
    matrix = found["matrix"]
    size = len(matrix)
    fig = base_figure("Layer-similarity map", [*_subtitle(report)[:2], "mean per-token cos(h_i, h_j)",
                                               f"{found['tokens']:,} calibration tokens",
                                               "h_0 = embeddings, h_L = final-norm input",
                                               "a square from h_s to h_e = blocks s…e−1 removed"])
    fig.add_heatmap(z=matrix, x=list(range(size)), y=list(range(size)), colorscale="Viridis", zmin=min(map(min, matrix)),
                    zmax=1.0, colorbar=dict(title="cos", thickness=12),
                    hovertemplate="cos(h_%{y}, h_%{x}) = %{z:.3f}<extra></extra>")
    selections = _compare(report).get("selections", {})
    colors = criterion_colors(list(selections))
    for k, (name, selection) in enumerate(selections.items()):
        pad = 0.5 - 0.08 * (k % 5)  # nested outlines where criteria agree
        for start, end in selection.get("boundaries", []):
            fig.add_shape(type="rect", x0=start - pad, x1=end + pad, y0=start - pad, y1=end + pad,
                          line=dict(color=colors[name], width=2), layer="above")
        fig.add_scatter(x=[None], y=[None], mode="lines", name=f"{name}: {blocks_text(selection['removed_layers'])}",
                        line=dict(color=colors[name], width=2))
    fig.update_xaxes(title_text="residual stream h_j", dtick=max(1, size // 10))
    fig.update_yaxes(title_text="h_i", autorange="reversed", dtick=max(1, size // 10), scaleanchor="x")
    fig.update_layout(height=fig.layout.height + 140 + 18 * len(selections))
    return fig


def criterion_scores_figure(report: dict) -> go.Figure:
    """One panel per criterion: its score per block (or per run start), its choice highlighted."""
    selections = _compare(report).get("selections", {})
    if not selections:
        return empty_figure("each criterion's scores appear as it finishes")
    names = list(selections)
    titles = [f"{criterion_title(n)}: {blocks_text(selections[n]['removed_layers'])}"[:70] for n in names]
    lines = wrap_parts(["Criterion scores, each choice highlighted", *_subtitle(report)[:2]])
    fig = make_subplots(rows=len(names), cols=1, subplot_titles=titles, vertical_spacing=0.32 / len(names) + 0.02)
    colors = criterion_colors(names)
    for row, name in enumerate(names, start=1):
        selection = selections[name]
        scores, label = selection.get("scores", []), selection.get("score_label", "")
        removed = set(selection["removed_layers"])
        per_run = "per run start" in label
        chosen = {min(removed)} if per_run and removed else removed
        xs = list(range(len(scores) if scores else report.get("num_layers", 0)))
        ys = scores or [1.0] * len(xs)
        fig.add_bar(x=xs, y=ys, row=row, col=1, showlegend=False, name=name,
                    marker_color=[colors[name] if i in chosen else "#cbd5e1" for i in xs],
                    hovertemplate=f"{name}<br>{'run start' if per_run else 'block'} %{{x}}: %{{y:.4g}}<br>"
                                  f"{html.escape(label)}<extra></extra>")
        if scores:
            low, high = finite_range(scores)
            pad = 0.1 * (high - low or abs(high) or 1)
            fig.update_yaxes(range=[low - pad, high + pad], row=row, col=1)
        else:
            fig.update_yaxes(visible=False, row=row, col=1)
    top = 40 + 15 * len(lines)
    text = f"<b>{lines[0]}</b>" + "".join(f"<br><span style='font-size:11px;color:#64748b'>{x}</span>" for x in lines[1:])
    fig.update_layout(template="plotly_white", height=top + SCORE_PANEL * len(names) + 60,
                      margin=dict(l=56, r=12, t=top + 20, b=50), title=dict(text=text, x=0.01, xanchor="left"),
                      font=dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12))
    for annotation in fig.layout.annotations:
        annotation.font.size = 11
    fig.update_xaxes(title_text="block (run start for run criteria)", row=len(names), col=1)
    return fig


BEST_MARK = "★"  # the table's lowest mean perplexity (report.summary.best_cell)


def compare_table(report: dict) -> pd.DataFrame:
    """Criteria × operators: one row per criterion (its blocks and scoring cost beside it), one column per operator,
    each cell the perplexity on every corpus ("330.1 · 70.2"), the best cell marked with BEST_MARK."""
    compare = _compare(report)
    corpora, operators = _corpora(report), list(compare.get("variants", []))
    best = best_cell(report)
    rows = []
    for row in compare.get("table", []):
        if not rows or rows[-1][0] != row["criterion"]:
            same = f" (= {row['same_plan_as']})" if row.get("same_plan_as") else ""
            rows.append([row["criterion"], blocks_text(row["removed_layers"]) + same,
                         *[""] * len(operators), short_cost(row["cost"])])
        cell = " · ".join(fmt(row["ppl"].get(c), 1) for c in corpora)
        mark = f"{BEST_MARK} " if best == (row["criterion"], row["operator"]) else ""
        rows[-1][2 + operators.index(row["operator"])] = mark + cell
    return pd.DataFrame(rows, columns=["criterion", "blocks removed", *operators, "scoring cost"])


def short_cost(cost: dict) -> str:
    """'4.2 s, 12.3 passes' (a cell of the table; `cost_text` gives the whole cost)."""
    if not cost:
        return "–"
    passes = cost.get("full_pass_equivalents", cost.get("passes", 0))
    shared = " (shared)" if cost.get("shared") else ""
    return f"{cost.get('seconds', 0):.1f} s, {passes:.2g} passes{shared}"


def cost_text(cost: dict) -> str:
    """'3 passes, 812 block runs/window, 4.2 s' (and what it shares)."""
    if not cost:
        return "–"
    parts = []
    if "full_pass_equivalents" in cost:
        parts.append(f"{cost['full_pass_equivalents']:.1f} full-pass equivalents")
    parts.append(f"{cost.get('passes', 0)} pass{'es' if cost.get('passes', 0) != 1 else ''} from the tokens")
    parts.append(f"{cost.get('seconds', 0):.1f} s")
    return ", ".join(parts) + (f" [{cost['shared']}]" if cost.get("shared") else "")


def table_legend(report: dict) -> str:
    """What a cell of the table holds, and the dense model's perplexity to read it against."""
    corpora = _corpora(report)
    dense = _compare(report).get("dense", {}).get("ppl", {})
    if not corpora:
        return ""
    return (f"cells: {' · '.join(corpus_tag(report, c) for c in corpora)} perplexity (dense: "
            f"{' · '.join(fmt(dense.get(c), 1) for c in corpora)}); {BEST_MARK} lowest geometric mean over the corpora")


def compare_caption(report: dict) -> str:
    """Which text chose the blocks, the corpora with their token counts, which plans coincide, what is a stand-in."""
    compare = _compare(report)
    criteria = compare.get("criteria", [])
    done = [c for c in criteria if any(r["criterion"] == c for r in compare.get("table", []))]
    corpora = " · ".join(f"{c} = {report['corpora'].get(c, {}).get('label', c)} ({tokens_text(report, c)})"
                         for c in _corpora(report))
    stats = compare.get("statistics", {})
    shared = (f"{stats['distinct_plans']} distinct plans for {stats['criteria']} criteria, one calibration pass over "
              f"{stats['distinct_boundaries']} boundaries") if stats else "calibrating after every criterion has chosen"
    return (f"**{report.get('model', '')}** ({report.get('num_layers', '?')} blocks), n = {compare.get('n', '?')} · "
            f"**{compare.get('calibration_note', '')}** (another calibration text may choose other blocks: rerun on "
            f"yours) · evaluated: {', '.join(done) or 'none yet'} of {', '.join(criteria)}  \n{shared}  \n{corpora}  \n"
            f"{table_legend(report)}")


def compare_text(report: dict) -> str:
    """The comparison as plain text (the CLI's summary): each criterion's blocks and cost, then the table."""
    compare = _compare(report)
    lines = [f"compare: {report.get('model', '')} ({report.get('num_layers', '?')} blocks), n = {compare.get('n')}",
             *[line.replace("**", "") for line in compare_headline(report)], compare.get("calibration_note", "")]
    for name, selection in compare.get("selections", {}).items():
        lines.append(f"  {criterion_title(name)}: blocks {blocks_text(selection['removed_layers'])} | {cost_text(selection['cost'])}")
    lines += [table_legend(report), compare_table(report).to_string(index=False)]
    lines += [f"note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def write_compare_html(report: dict, path: str | Path) -> Path:
    """The map, the score chart, caption and table in one self-contained HTML page (plotly.js inlined)."""
    caption = html.escape(compare_caption(report)).replace("  \n", "<br>").replace("**", "")
    charts = [figure.to_html(full_html=False, include_plotlyjs=k == 0)
              for k, figure in enumerate((similarity_map_figure(report), criterion_scores_figure(report)))]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Criteria compared · "
            f"{html.escape(report.get('model', ''))}</title></head><body style='font-family:sans-serif;max-width:1100px;"
            f"margin:auto'><h1>Which blocks? Criteria compared</h1><p>{caption}</p>{''.join(charts)}"
            f"{compare_table(report).to_html(index=False, border=0)}</body></html>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
