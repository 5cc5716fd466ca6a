"""Plotly figures from a run's JSON snapshot; each names the model, the removed blocks and its corpora."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from studio.tables import DENSE_COLOR, blocks_text, variant_colors


def base_figure(title: str, subtitle: str, rows: int = 1, cols: int = 1, subplot_titles: Sequence[str] = ()) -> go.Figure:
    """A figure with the app's layout; `subtitle` carries the model, removed blocks and corpus label."""
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(subplot_titles) or None, horizontal_spacing=0.12)
    fig.update_layout(
        template="plotly_white", height=400, margin=dict(l=60, r=20, t=90, b=60),
        title=dict(text=f"{title}<br><span style='font-size:11px;color:#64748b'>{subtitle}</span>", x=0.01, y=0.96,
                   font=dict(size=14)),
        legend=dict(orientation="h", yanchor="top", y=-0.2, x=0, font=dict(size=11)),
        font=dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12),
    )
    for annotation in fig.layout.annotations:
        annotation.font.size = 12
    return fig


def short_context(report: dict) -> str:
    """One-line plot subtitle: model, removed blocks, calibration corpus."""
    removed = report.get("removed_layers", [])
    cal = report.get("calibration", {}).get("label", "")
    return (f"{report.get('model', '')} · removed {blocks_text(removed)} ({len(removed)} of {report.get('num_layers', '?')})"
            + (f" · calibration {cal.split(' (')[0]} ({'exact' if 'exact' in cal else 'stand-in'})" if cal else ""))


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
        low, high = min(scores), max(scores)
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


def _boundary_error(entry: dict, key: str) -> float | None:
    """Held-out error when there were held-out sequences, else the fit error."""
    value = entry.get(f"heldout{key}")
    return value if value is not None else entry.get(f"fit{key}")


def boundary_error_figure(report: dict) -> go.Figure:
    """Relative boundary error per boundary and operator, over all tokens and over ordinary ones."""
    cal = report.get("calibration", {})
    fig = base_figure("Boundary error per boundary and operator: ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ (1 = plain pruning)",
                      f"{short_context(report)} · on {cal.get('heldout_sequences', '?')} held-out calibration sequences",
                      cols=2, subplot_titles=("all tokens", "ordinary tokens (attention sinks left out)"))
    variants = {name: e["boundary_error"] for name, e in report.get("variants", {}).items() if "boundary_error" in e}
    colors = variant_colors(list(variants))
    for col, key in ((1, ""), (2, "_ordinary")):
        for name, errors in variants.items():
            fig.add_bar(x=[f"blocks {e['boundary']}" for e in errors], y=[_boundary_error(e, key) for e in errors],
                        name=name, marker_color=colors[name], legendgroup=name, showlegend=col == 1,
                        hovertemplate=f"{name}<br>%{{x}}: %{{y:.3f}}<extra></extra>", row=1, col=col)
        fig.add_hline(y=1.0, line_dash="dot", line_color="#94a3b8", row=1, col=col)
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="relative error", row=1, col=1)
    return fig


def drift_figure(report: dict) -> go.Figure:
    """Relative error of each variant's residual stream against the dense one, block by block after the cut."""
    app = report.get("app", {})
    corpus = app.get("drift_corpus")
    label = report.get("corpora", {}).get(corpus, {}).get("label", corpus)
    fig = base_figure("Per-block drift after the cut: ‖h_j − h_j(dense)‖ / ‖h_j(dense)‖ (dense = 0)",
                      f"{short_context(report)} · {app.get('drift_windows', '?')} window(s) of {label}",
                      cols=2, subplot_titles=("all tokens", "ordinary tokens (attention sinks left out)"))
    drifts = {name: e["drift"] for name, e in report.get("variants", {}).items() if "drift" in e}
    colors = variant_colors(list(drifts))
    if drifts:
        blocks = next(iter(drifts.values()))["blocks"]
        for col in (1, 2):
            fig.add_scatter(x=blocks, y=[0.0] * len(blocks), name="dense", mode="lines", legendgroup="dense",
                            line=dict(color=DENSE_COLOR, dash="dot"), showlegend=col == 1, row=1, col=col)
    for name, drift in drifts.items():
        for col, key in ((1, "error"), (2, "error_ordinary")):
            fig.add_scatter(x=drift["blocks"], y=drift[key], name=name, mode="lines+markers", legendgroup=name,
                            line=dict(color=colors[name], width=2), marker=dict(size=5), showlegend=col == 1,
                            hovertemplate=f"{name}<br>block %{{x}}: %{{y:.3f}}<extra></extra>", row=1, col=col)
    num_layers = report.get("num_layers")
    fig.update_xaxes(title_text=f"dense block j ({num_layers} = final norm)")
    fig.update_yaxes(title_text="relative error", row=1, col=1)
    return fig


def structure_figure(report: dict) -> go.Figure:
    """Each operator's W − I: its anti-symmetric share (what no symmetric operator can represent) and singular values."""
    fig = base_figure("Operator structure of M = W − I",
                      f"{short_context(report)} · ‖(M − Mᵀ)/2‖_F / ‖M‖_F and singular values of M",
                      cols=2, subplot_titles=("anti-symmetric share of ‖M‖_F", "singular values of M (descending)"))
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
                            row=1, col=2)
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1], title_text="share", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_xaxes(title_text="index", row=1, col=2)
    return fig


def tasks_figure(report: dict) -> go.Figure:
    """Zero-shot accuracy per task and mean, bars per variant, with the chance level."""
    tasks = report.get("tasks", {})
    fig = base_figure("Quick zero-shot tasks (lm-eval acc)", f"{short_context(report)} · seeded example subsets")
    colors = variant_colors(list(tasks))
    chance: dict[str, float] = {}
    for name, result in tasks.items():
        xs = [s["task"] for s in result["scores"]] + ["mean"]
        ys = [s["acc"] for s in result["scores"]] + [result["mean_acc"]]
        chance = {s["task"]: s["chance"] for s in result["scores"]} | {"mean": result["mean_chance"]}
        fig.add_bar(x=xs, y=ys, name=name, marker_color=colors[name],
                    hovertemplate=f"{name}<br>%{{x}}: %{{y:.1%}}<extra></extra>")
    if chance:
        fig.add_scatter(x=list(chance), y=list(chance.values()), mode="markers", name="chance",
                        marker=dict(symbol="line-ew-open", size=28, color="#0f172a", line=dict(width=2)))
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1], tickformat=".0%", title_text="accuracy")
    return fig


def empty_figure(message: str) -> go.Figure:
    """A placeholder figure saying what will appear."""
    fig = go.Figure()
    fig.update_layout(template="plotly_white", height=380, xaxis_visible=False, yaxis_visible=False,
                      annotations=[dict(text=message, showarrow=False, font=dict(size=13, color="#64748b"))])
    return fig

