"""Plotly figures from a run's JSON snapshot; each names the model, the removed blocks and its corpora."""

from __future__ import annotations

import math

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ghosted_core.report.tables import DENSE_COLOR, SIGNIFICANT_MARK, blocks_text, comparison, esc, held_out_error, \
    paired_cell, plural, variant_colors


TITLE_CHARS = 46  # characters per subtitle line: fits a 390 px phone screen at 11 px
PANEL_HEIGHT = 300  # px per stacked panel


def wrap_parts(parts: Sequence[str], width: int = TITLE_CHARS) -> list[str]:
    """Join short phrases with ' · ' into lines of at most `width` characters (a longer phrase gets its own line)."""
    lines: list[str] = []
    for part in filter(None, parts):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += f" · {part}"
        else:
            lines.append(part)
    return lines


def base_figure(title: str, subtitle: Sequence[str], panels: Sequence[str] = ()) -> go.Figure:
    """A figure with the app's layout, readable from a phone to a desktop.

    `subtitle`: phrases (model, removed blocks, corpus labels, formula) wrapped into short lines.
    `panels`: titles of panels stacked one above the other (never side by side, where their
    titles would overlap on a narrow screen).
    """
    rows = max(1, len(panels))
    lines = [esc(line) for line in wrap_parts(subtitle)]  # model names and labels are shown as text, never markup
    top = 44 + 15 * len(lines)  # px for the title and its subtitle lines
    fig = make_subplots(rows=rows, cols=1, subplot_titles=list(panels) or None, vertical_spacing=0.16 if rows > 1 else 0)
    text = f"<b>{title}</b>" + "".join(f"<br><span style='font-size:11px;color:#64748b'>{line}</span>" for line in lines)
    fig.update_layout(
        template="plotly_white", height=top + PANEL_HEIGHT * rows + 70 * (rows - 1) + 90,
        margin=dict(l=56, r=12, t=top, b=90),
        title=dict(text=text, x=0.01, xanchor="left", y=1 - 8 / (top + PANEL_HEIGHT * rows), yanchor="top",
                   font=dict(size=14)),
        # the legend starts 64 px below the plot area, clear of the x-axis title (plotly grows the margin to fit it)
        legend=dict(orientation="h", yanchor="top", y=-64 / (PANEL_HEIGHT * rows + 70 * (rows - 1)), x=0,
                    font=dict(size=11)),
        font=dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12),
    )
    for annotation in fig.layout.annotations:
        annotation.font.size = 12
    return fig


def short_context(report: dict) -> list[str]:
    """Plot subtitle phrases: model, removed blocks, calibration corpus."""
    removed = report.get("removed_layers", [])
    cal = report.get("calibration", {}).get("label", "")
    return [report.get("model", ""), f"removed {blocks_text(removed)} ({len(removed)} of {report.get('num_layers', '?')})",
            f"calibration {cal.split(' (')[0]} ({'exact' if 'exact' in cal else 'stand-in'})" if cal else ""]


def finite_range(scores) -> tuple[float, float]:
    """(min, max) of the finite scores ((0, 1) where none is): a block a criterion could not score has None (no
    bar), and a score axis is never stretched to infinity."""
    finite = [s for s in scores if isinstance(s, (int, float)) and math.isfinite(s)]
    return (min(finite), max(finite)) if finite else (0.0, 1.0)


def scores_figure(report: dict) -> go.Figure:
    """The criterion's score per block (or per run start) with the removed blocks highlighted."""
    scores, label = report.get("scores", []), report.get("score_label", "")
    removed = set(report.get("removed_layers", []))
    fig = base_figure(f"Criterion: {report.get('criterion', '')}", short_context(report))
    if scores:
        per_run = "per run start" in label
        chosen = {min(removed)} if per_run and removed else removed
        colors = ["#4f46e5" if i in chosen else "#cbd5e1" for i in range(len(scores))]
        hover = "run start %{x}: %{y:.4f}" if per_run else "block %{x}: %{y:.4f}"
        fig.add_bar(x=list(range(len(scores))), y=scores, marker_color=colors, name=label, hovertemplate=hover,
                    showlegend=False)
        fig.update_xaxes(title_text="run start s (the run removes s … s+n−1)" if per_run else "block i")
        fig.update_yaxes(title_text=label.rsplit(", per", 1)[0][:60])
        low, high = finite_range(scores)
        pad = 0.1 * (high - low or abs(high) or 1)
        fig.update_yaxes(range=[low - pad, high + pad])
        if per_run and removed:
            fig.add_annotation(x=min(removed), y=scores[min(removed)], text=f"chosen: blocks {blocks_text(removed)}",
                               showarrow=True, arrowhead=2, ay=-30, font=dict(size=11, color="#3730a3"))
    else:  # manual or none: no scores, show which blocks go
        blocks = list(range(report.get("num_layers", 0)))
        fig.add_bar(x=blocks, y=[1] * len(blocks), showlegend=False, hovertemplate="block %{x}",
                    marker_color=["#4f46e5" if b in removed else "#e2e8f0" for b in blocks])
        fig.update_yaxes(visible=False)
        fig.update_xaxes(title_text=f"block i ({report.get('criterion', '')}: no scores; highlighted = removed)")
    return fig


def boundary_error_figure(report: dict) -> go.Figure:
    """Relative boundary error per boundary and operator, over all tokens and over ordinary ones."""
    held = report.get("calibration", {}).get("heldout_sequences")
    fig = base_figure("Boundary error per operator",
                      [*short_context(report), "‖X_pre W − X_post‖ / ‖X_post − X_pre‖", "1 = plain pruning",
                       f"on {plural(held, 'held-out calibration sequence')}" if held else "on calibration text"],
                      panels=("all tokens", "ordinary tokens (attention sinks left out)"))
    variants = {name: e["boundary_error"] for name, e in report.get("variants", {}).items() if "boundary_error" in e}
    colors = variant_colors(list(variants))
    for row, key in ((1, ""), (2, "_ordinary")):
        for name, errors in variants.items():
            fig.add_bar(x=[f"blocks {e['boundary']}" for e in errors], y=[held_out_error(e, key) for e in errors],
                        name=name, marker_color=colors[name], legendgroup=name, showlegend=row == 1,
                        hovertemplate=f"{name}<br>%{{x}}: %{{y:.3f}}<extra></extra>", row=row, col=1)
        fig.add_hline(y=1.0, line_dash="dot", line_color="#94a3b8", row=row, col=1,
                      annotation_text="plain pruning", annotation_position="top left", annotation_font_size=10)
        fig.update_yaxes(title_text="relative error", row=row, col=1)
    fig.update_layout(barmode="group")
    return fig


def drift_figure(report: dict) -> go.Figure:
    """Relative error of each variant's residual stream against the dense one, block by block after the cut."""
    app = report.get("app", {})
    corpus = app.get("drift_corpus")
    label = report.get("corpora", {}).get(corpus, {}).get("label", corpus)
    windows = app.get("drift_windows")
    fig = base_figure("Per-block drift after the cut",
                      [*short_context(report), "‖h_j − h_j(dense)‖ / ‖h_j(dense)‖", "dense = 0",
                       f"{plural(windows, 'window') if windows else '? windows'} of {label}"],
                      panels=("all tokens", "ordinary tokens (attention sinks left out)"))
    drifts = {name: e["drift"] for name, e in report.get("variants", {}).items() if "drift" in e}
    colors = variant_colors(list(drifts))
    if drifts:
        blocks = next(iter(drifts.values()))["blocks"]
        for row in (1, 2):
            fig.add_scatter(x=blocks, y=[0.0] * len(blocks), name="dense", mode="lines", legendgroup="dense",
                            line=dict(color=DENSE_COLOR, dash="dot"), showlegend=row == 1, row=row, col=1)
    for name, drift in drifts.items():
        for row, key in ((1, "error"), (2, "error_ordinary")):
            fig.add_scatter(x=drift["blocks"], y=drift[key], name=name, mode="lines+markers", legendgroup=name,
                            line=dict(color=colors[name], width=2), marker=dict(size=5), showlegend=row == 1,
                            hovertemplate=f"{name}<br>block %{{x}}: %{{y:.3f}}<extra></extra>", row=row, col=1)
    num_layers = report.get("num_layers")
    fig.update_xaxes(title_text=f"dense block j ({num_layers} = final norm)", row=2, col=1)
    fig.update_yaxes(title_text="relative error")
    return fig


def structure_figure(report: dict) -> go.Figure:
    """Each operator's W − I: its anti-symmetric share (what no symmetric operator can represent) and singular values."""
    fig = base_figure("Operator structure of M = W − I",
                      [*short_context(report), "‖(M − Mᵀ)/2‖_F / ‖M‖_F", "singular values of M"],
                      panels=("anti-symmetric share of ‖M‖_F", "singular values of M (descending)"))
    fits = {name: e["fits"] for name, e in report.get("variants", {}).items()
            if e.get("fits") and any(f["singular_values"] for f in e["fits"])}
    colors = variant_colors(list(fits))
    for name, reports in fits.items():
        fig.add_bar(x=[f"blocks {f['boundary']}" for f in reports], y=[f["antisym_fraction"] for f in reports],
                    name=name, marker_color=colors[name], legendgroup=name,
                    hovertemplate=f"{name}<br>%{{x}}: %{{y:.2f}}<extra></extra>", row=1, col=1)
        for k, fit in enumerate(reports):
            values = fit["singular_values"]
            fig.add_scatter(x=list(range(1, len(values) + 1)), y=values, mode="lines", legendgroup=name,
                            name=f"{name} · blocks {fit['boundary']}", showlegend=False,
                            line=dict(color=colors[name], width=2, dash=("solid", "dash", "dot")[k % 3]),
                            hovertemplate=f"{name} · blocks {fit['boundary']}<br>σ_%{{x}} = %{{y:.3g}}<extra></extra>",
                            row=2, col=1)
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1], title_text="share", row=1, col=1)
    fig.update_yaxes(type="log", title_text="σ", row=2, col=1)
    fig.update_xaxes(title_text="index", row=2, col=1)
    return fig


def tasks_figure(report: dict) -> go.Figure:
    """Zero-shot accuracy per task and mean, bars per variant, with the chance level."""
    tasks = report.get("tasks", {})
    fig = base_figure("Quick zero-shot tasks (lm-eval acc)",
                      [*short_context(report), "the same seeded examples for every variant",
                       "error bars: ± one standard error", f"labels: paired difference to none, points "
                       f"({SIGNIFICANT_MARK} significant at 95%)"])
    colors = variant_colors(list(tasks))
    chance: dict[str, float] = {}
    for name, result in tasks.items():
        xs = [s["task"] for s in result["scores"]] + ["mean"]
        ys = [s["acc"] for s in result["scores"]] + [result["mean_acc"]]
        errors = [s.get("acc_stderr") or 0.0 for s in result["scores"]] + [result.get("mean_acc_stderr") or 0.0]
        chance = {s["task"]: s["chance"] for s in result["scores"]} | {"mean": result["mean_chance"]}
        deltas = [comparison(report, name, "none", x) for x in xs]
        labels = ["" if d is None else f"{100 * d['diff']:+.1f}{SIGNIFICANT_MARK if d['significant'] else ''}"
                  for d in deltas]
        vs_none = [paired_cell(d) if d else "" for d in deltas]
        fig.add_bar(x=xs, y=ys, name=name, marker_color=colors[name], text=labels, textposition="outside",
                    customdata=vs_none,
                    error_y=dict(type="data", array=errors, visible=True, thickness=1.2, width=3),
                    hovertemplate=f"{esc(name)}<br>%{{x}}: %{{y:.1%}} ± %{{error_y.array:.1%}}"
                                  "<br>− none: %{customdata}<extra></extra>")
    if chance:
        fig.add_scatter(x=list(chance), y=list(chance.values()), mode="markers", name="chance",
                        marker=dict(symbol="line-ew-open", size=28, color="#0f172a", line=dict(width=2)))
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1], tickformat=".0%", title_text="accuracy")
    return fig


def distill_figure(report: dict) -> go.Figure:
    """Each distillation's KL to the dense model: the training loss per step (thin) and the validation KL (markers),
    live while it trains; the best validation is the state kept."""
    runs = {name: e["distill"] for name, e in report.get("variants", {}).items() if "distill" in e}
    first = next(iter(runs.values()), {})
    k = first.get("top_k")
    loss = "full vocabulary" if k and k == first.get("vocabulary") else f"teacher top-{k}" if k else "teacher top-K"
    fig = base_figure("Distillation: KL to the dense model",
                      [*short_context(report), f"KL on the {loss}", "training windows (line), held-out calibration "
                       "windows (markers)", "best validation kept"])
    colors = variant_colors(list(runs))
    for name, d in runs.items():
        fig.add_scatter(x=list(range(1, len(d["loss_curve"]) + 1)), y=d["loss_curve"], mode="lines", name=f"{name} train",
                        line=dict(color=colors[name], width=1), opacity=0.6, legendgroup=name,
                        hovertemplate=f"{esc(name)} step %{{x}}: training KL %{{y:.4f}}<extra></extra>")
        steps, values = zip(*d["val_curve"]) if d["val_curve"] else ((), ())
        fig.add_scatter(x=list(steps), y=list(values), mode="lines+markers", name=f"{name} validation",
                        line=dict(color=colors[name], width=2), legendgroup=name,
                        hovertemplate=f"{esc(name)} after %{{x}} steps: validation KL %{{y:.4f}}<extra></extra>")
    fig.update_xaxes(title_text="optimizer step")
    fig.update_yaxes(title_text="KL (nats per token)")
    return fig


def empty_figure(message: str) -> go.Figure:
    """A placeholder figure saying what will appear."""
    fig = go.Figure()
    fig.update_layout(template="plotly_white", height=380, xaxis_visible=False, yaxis_visible=False,
                      annotations=[dict(text=message, showarrow=False, font=dict(size=13, color="#64748b"))])
    return fig

