"""The trade-off in one picture: perplexity against measured decode speed and against size, the Pareto front marked.

Reads a run's or a sweep's JSON snapshot (each variant's "gain" entry, `export.gain`): a run gives one point per
variant, a sweep one per depth × operator, dense included. Speeds are ratios to dense measured in the same rounds
(a sweep times dense again at every depth), so points from different depths compare. A point is on the front when
no other point is at least as good on both axes and better on one; the front's points carry their names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from ghosted_core.report.charts import base_figure, empty_figure
from ghosted_core.report.tables import DENSE_COLOR, blocks_text, corpus_tag, esc, variant_colors

FRONT_COLOR = "#0f172a"
MB = 1e6


@dataclass(frozen=True)
class Point:
    """One variant at one depth: its held-out perplexity, decode speed against dense and checkpoint size."""

    variant: str
    depth: int  # blocks removed (0: dense)
    removed: tuple[int, ...]
    ppl: float
    decode: float | None  # × dense; None where speed was not measured
    decode_tps: float | None
    prefill: float | None
    weight_bytes: int
    size: float  # × dense
    format: str

    @property
    def label(self) -> str:
        return "dense" if self.variant == "dense" else f"{self.variant}, n = {self.depth}"


def _point(name: str, depth: int, removed: Sequence[int], ppl: float | None, gain: dict | None) -> Point | None:
    if ppl is None or not gain:
        return None
    return Point(name, depth, tuple(removed), ppl, gain.get("decode_vs_dense"),
                 (gain.get("decode_tokens_per_s") or {}).get("median"), gain.get("prefill_vs_dense"),
                 gain["weight_bytes"], gain.get("size_vs_dense", 1.0), gain.get("format", "stock"))


def default_corpus(report: dict) -> str | None:
    """The corpus the picture uses: the first evaluation corpus of the run."""
    sweep = report.get("sweep")
    ppl = (sweep.get("dense", {}) if sweep else report.get("variants", {}).get("dense", {})).get("ppl", {})
    return next(iter(ppl), None)


def tradeoff_points(report: dict, corpus: str | None = None) -> list[Point]:
    """Every variant with both a perplexity on `corpus` and a gain entry: dense first, then by depth."""
    corpus = corpus or default_corpus(report)
    sweep = report.get("sweep")
    points: list[Point | None] = []
    if sweep:
        results = sweep.get("results", [])
        dense_gain = results[0].get("dense_gain") if results else None
        points.append(_point("dense", 0, (), sweep.get("dense", {}).get("ppl", {}).get(corpus), dense_gain))
        for result in results:
            for name, entry in result["variants"].items():
                points.append(_point(name, result["n"], result["removed_layers"], entry.get("ppl", {}).get(corpus),
                                     entry.get("gain")))
    else:
        removed = report.get("removed_layers", [])
        for name, entry in report.get("variants", {}).items():
            points.append(_point(name, 0 if name == "dense" else len(removed), () if name == "dense" else removed,
                                 entry.get("ppl", {}).get(corpus), entry.get("gain")))
    return [p for p in points if p is not None]


def pareto_front(points: Sequence[Point], gain: Callable[[Point], float | None]) -> list[Point]:
    """Points no other point beats: lower perplexity and higher `gain` (speed, or smaller size as −bytes), or equal on
    one and better on the other. Ordered by `gain`, best first; points without a `gain` value are left out."""
    ranked = sorted((p for p in points if gain(p) is not None), key=lambda p: (-gain(p), p.ppl))
    front: list[Point] = []
    for point in ranked:  # the best perplexity so far among faster points; a point joins only if it improves on it
        if not front or point.ppl < front[-1].ppl:
            front.append(point)
    return front


def _hover(point: Point, corpus: str, report: dict) -> str:
    speed = "speed not measured" if point.decode is None else \
        f"decode {point.decode:.2f}× dense ({point.decode_tps:.1f} tok/s), prefill {point.prefill:.2f}×"
    size = f"{point.weight_bytes / MB:,.0f} MB ({point.size:.2f}× dense), {point.format.replace('_', ' ')}"
    lines = [f"<b>{esc(point.label)}</b>" + (f" (blocks {blocks_text(point.removed)})" if point.removed else ""),
             f"ppl {point.ppl:.4g} on {esc(corpus_tag(report, corpus))}", speed, size]
    if point.variant != "dense":
        lines.append(f"save: depth {point.depth}, operator {esc(point.variant)} → Save · CLI: --total_num_prune "
                     f"{point.depth} --insert_type {esc(point.variant)} --save_model DIR")
    return "<br>".join(lines) + "<extra></extra>"


def _subtitle(report: dict, corpus: str) -> list[str]:
    settings = report.get("gain") or next((r.get("gain") for r in report.get("sweep", {}).get("results", [])), None) \
        or {}
    machine = settings.get("measured_on") or {}
    speed = (f"decode {settings.get('decode_tokens')} tokens, batch 1, median of {settings.get('repeats')}, "
             f"{machine.get('device', '?')} {machine.get('threads', '?')} threads" if settings.get("measured")
             else "speed not measured")
    return [report.get("model", ""), f"ppl on {corpus_tag(report, corpus)}", speed, "sizes as saved (stock where it folds)",
            "line: the Pareto front"]


def tradeoff_figure(report: dict, corpus: str | None = None) -> go.Figure:
    """Perplexity (log) against decode speed (× dense, measured) and against size (MB), one point per variant and
    depth, dense as the reference, the Pareto front drawn as a line through the points worth shipping."""
    corpus = corpus or default_corpus(report)
    points = tradeoff_points(report, corpus)
    if len(points) < 2:
        return empty_figure("the trade-off appears once the variants' perplexity and size are known")
    fig = base_figure("What pruning buys: perplexity against speed and size", _subtitle(report, corpus),
                      panels=("perplexity against decode speed (× dense)", "perplexity against size on disk (MB)"))
    names = list(dict.fromkeys(p.variant for p in points if p.variant != "dense"))
    colors = variant_colors(names) | {"dense": DENSE_COLOR}
    axes = ((1, lambda p: p.decode), (2, lambda p: p.weight_bytes / MB))
    for row, x_of in axes:
        gain = (lambda p: p.decode) if row == 1 else (lambda p: -p.weight_bytes)
        for name in ["dense", *names]:
            mine = [p for p in points if p.variant == name and x_of(p) is not None]
            if not mine:
                continue
            fig.add_scatter(x=[x_of(p) for p in mine], y=[p.ppl for p in mine], mode="markers", name=name,
                            legendgroup=name, showlegend=row == 1,
                            marker=dict(color=colors[name], size=10 if name == "dense" else 9,
                                        symbol="diamond" if name == "dense" else "circle",
                                        line=dict(width=1, color="white")),
                            hovertemplate=[_hover(p, corpus, report) for p in mine], row=row, col=1)
        front = pareto_front(points, gain)
        if front:
            fig.add_scatter(x=[x_of(p) for p in front], y=[p.ppl for p in front], mode="lines+markers+text",
                            name="Pareto front", legendgroup="front", showlegend=row == 1,
                            line=dict(color=FRONT_COLOR, width=1.5, dash="dot"),
                            marker=dict(size=15, color="rgba(0,0,0,0)", line=dict(width=2, color=FRONT_COLOR)),
                            text=[esc(p.label) for p in front], textposition="top right", textfont=dict(size=10),
                            hoverinfo="skip", row=row, col=1)
    if all(p.decode is None for p in points):
        fig.add_annotation(text="speed not measured (turned off)", xref="x domain", yref="y domain", x=0.5, y=0.5,
                           showarrow=False, font=dict(color="#64748b"), row=1, col=1)
    fig.update_yaxes(type="log", title_text="perplexity (log)")
    fig.update_xaxes(title_text="decode speed, × dense (higher is faster)", row=1, col=1)
    fig.update_xaxes(title_text="weights on disk, MB", row=2, col=1)
    return fig
