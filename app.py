"""Ghosted Layers Studio: the Gradio app. UI only; every number comes from `ghosted_core`.

Flow of a run: widget values → `RunOptions` (`build_options`) → `run_job`, which loads the
model through the process-wide cache and drains `ghosted_core.pipeline.run_stages`, yielding
a plain JSON snapshot (`RunResult.to_json()` plus what the app adds) after every stage →
formatting helpers turn a snapshot into HTML, tables and plotly figures. `run_job` is the
one `@spaces.GPU` unit on a ZeroGPU Space (it yields only plain CPU-side data); elsewhere
the decorator is a no-op.

`python app.py` serves on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 0.0.0.0:7860).
"""

from __future__ import annotations

import os

# First, before anything loads torch: the package sets OMP_WAIT_POLICY=PASSIVE. On 2 shared cores
# (load average ~4) a default run took 70-87 s with it and 302 s without it.
import ghosted_core  # noqa: F401, I001

import html
import json
import logging
import math
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gradio as gr
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ghosted_core import data
from ghosted_core.calibration import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation import GenerationOptions
from ghosted_core.export import archive_recovered
from ghosted_core.hub import hub_reachable
from ghosted_core.models import DEFAULT_MODEL, EMBEDDED, LoadedModel, load_model, peek_config
from ghosted_core.operators import OPERATORS
from ghosted_core.pipeline import SEQUENTIAL_SUFFIX, RunOptions, RunResult, parse_variants, run_stages, validate
from ghosted_core.selection import CRITERIA, parse_layers
from ghosted_core.tasks import TASKS

log = logging.getLogger("ghosted_app")

ASSETS = Path(__file__).resolve().parent / "assets"


# ---------------------------------------------------------------- defaults and limits


NO_SAVE = "don't save"


@dataclass(frozen=True)
class Defaults:
    """What a newcomer gets on pressing Run: sized to finish within a minute on 2 CPU cores (see bench/app_speed.py)."""

    model: str = DEFAULT_MODEL
    criterion: str = "streamline"
    depth: int = 7  # blocks removed
    operators: tuple[str, ...] = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme")
    calibration: str = "mix"  # broad stand-in for C4
    samples: int = 12  # calibration sequences (the paper: 128); 3072 tokens, over 5× the width of SmolLM2
    seqlen: int = 256  # calibration and perplexity window length (the paper: 2048)
    seed: int = 0
    eval_corpora: tuple[str, ...] = ("ptb", "wiki")  # ptb is exact and not in the calibration mix
    eval_tokens: int = 1024  # perplexity tokens per corpus
    drift_windows: int = 1  # windows of the first evaluation corpus for per-block drift
    new_tokens: int = 16  # a CPU decode step of SmolLM2 takes ~80 ms, for each of 7 variants
    tasks: tuple[str, ...] = ("arc_easy", "copa", "piqa")
    task_examples: int = 20
    save_variant: str = NO_SAVE  # a variant to download as a recovered model (zip); off by default (~0.4 GB)


DEFAULTS = Defaults()
SEQLENS = (64, 128, 256, 512, 1024, 2048)
CACHE_SIZE = int(os.environ.get("GHOSTED_APP_CACHE_MODELS", "2"))  # models held in memory at once
RUN_CONCURRENCY = int(os.environ.get("GHOSTED_APP_CONCURRENCY", "1"))  # runs computing at once
QUEUE_SIZE = int(os.environ.get("GHOSTED_APP_QUEUE", "16"))  # runs waiting at most
GPU_SECONDS = int(os.environ.get("GHOSTED_APP_GPU_SECONDS", "120"))  # ZeroGPU time asked per run

OPERATOR_CHOICES = list(OPERATORS) + [f"{name}{SEQUENTIAL_SUFFIX}" for name in OPERATORS if name != "none"]
CRITERION_HELP = {  # short dropdown labels; the registry's paper names are longer
    "streamline": "contiguous run (LLM-Streamline)",
    "shortgpt": "lowest block influence (ShortGPT)",
    "angular": "angular distance (PruneMe)",
    "manual": "the blocks you list",
    "none": "dense model only",
}


def _spaces_gpu():
    """`spaces.GPU(duration=…)` on a Hugging Face Space, a no-op decorator elsewhere."""
    try:
        import spaces
    except ImportError:
        return lambda fn: fn
    return spaces.GPU(duration=GPU_SECONDS)


gpu = _spaces_gpu()


# ---------------------------------------------------------------- the model cache


class ModelCache:
    """Loaded models shared by every run and user, keyed by model id; at most `capacity`, least recently used first out.

    One lock around lookups and loads: two users asking for the same model load it once, and
    two different loads never compete for memory.
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> LoadedModel:
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            loaded = load_model(name)
            self._models[name] = loaded
            while len(self._models) > self.capacity:
                evicted, _ = self._models.popitem(last=False)
                log.info("model cache full: dropped %s", evicted)
            return loaded

    def peek(self, name: str) -> LoadedModel | None:
        with self._lock:
            return self._models.get(name)

    def put(self, loaded: LoadedModel) -> None:
        """Hold an already loaded model (e.g. one a test session loaded) under its name."""
        with self._lock:
            self._models[loaded.name] = loaded
            self._models.move_to_end(loaded.name)
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)


MODELS = ModelCache(CACHE_SIZE)


def num_blocks(name: str) -> int:
    """Decoder blocks of `name`, from the cache or its config (no weights loaded)."""
    cached = MODELS.peek(name)
    return cached.num_layers if cached else int(peek_config(name).num_hidden_layers)


# ---------------------------------------------------------------- widget values → options


@dataclass(frozen=True)
class QuickTasks:
    """Zero-shot tasks to score every variant on after the run (off by default: they take minutes)."""

    enabled: bool = False
    tasks: tuple[str, ...] = ()
    limit: int = DEFAULTS.task_examples  # examples per task, a seeded subset (the run's seed)


def build_options(model: str, criterion: str, depth: float, manual_blocks: str, operators: Sequence[str],
                  calibration: str, samples: float, seqlen: float | str, seed: float, eval_corpora: Sequence[str],
                  eval_tokens: float, prompt: str, new_tokens: float) -> RunOptions:
    """The library's options from the widgets' values; GhostedError on input no run could use."""
    model = (model or "").strip()
    if not model:
        raise GhostedError(f"choose a model: an embedded one ({', '.join(EMBEDDED)}), a local folder or a Hub id")
    if not operators:
        raise GhostedError(f"choose at least one recovery operator ({', '.join(OPERATORS)})")
    layers = parse_layers(manual_blocks or "") if criterion == "manual" else ()
    if criterion == "manual" and not layers:
        raise GhostedError("the manual criterion needs the blocks to remove, e.g. 19-25 or 3,7,12")
    return RunOptions(
        model=model,
        criterion=criterion,
        num_prune=int(depth),
        layers=layers,
        variants=parse_variants(list(operators)),
        calibration=calibration,
        train_size=int(samples),
        seqlen=int(seqlen),
        seed=int(seed),
        eval_corpora=tuple(eval_corpora or ()),
        eval_max_tokens=int(eval_tokens),
        drift_windows=DEFAULTS.drift_windows,
        prompt=(prompt or "").strip() or None,
        generation=GenerationOptions(max_new_tokens=int(new_tokens), seed=int(seed)),
        calibrate=CalibrationOptions(quiet=False),
    )


def check_options(options: RunOptions) -> None:
    """The library's checks of `options` against the model's block count, before any weights load."""
    validate(options, num_blocks(options.model))


def check_save(options: RunOptions, save_variant: str) -> str | None:
    """The variant to save as a download, None for none; it must be one the run builds."""
    if not save_variant or save_variant == NO_SAVE:
        return None
    built = [v.name for v in options.variants] if options.criterion != "none" else []
    if save_variant not in built:
        raise GhostedError(f"cannot save {save_variant!r}: it is not among this run's variants "
                           f"({', '.join(built) or 'none: nothing is pruned'}); add it to 'Operators' or choose {NO_SAVE!r}")
    return save_variant


def planned_stages(options: RunOptions, quick: QuickTasks, save_variant: str | None = None) -> list[str]:
    """The stage names `run_job` will yield, in order (for the progress bar)."""
    prunes = options.criterion != "none"
    stages = ["load model", "score blocks"]
    stages += ["calibrate", "fit operators"] if prunes else []
    stages += ["perplexity"] * len(options.eval_corpora)
    stages += ["drift"] if prunes and options.eval_corpora and options.drift_windows else []
    stages += ["generate"] if options.prompt else []
    stages += ["tasks"] * len(("dense", *(v.name for v in options.variants))) if quick.enabled else []
    stages += ["save model"] if save_variant else []
    return stages


# ---------------------------------------------------------------- the run (the @spaces.GPU unit)


def snapshot(result: RunResult, options: RunOptions, load_seconds: float) -> dict:
    """Plain JSON-ready data of the run so far: results.json's layout plus what the page also shows."""
    report = result.to_json()
    tasks = {name: entry["tasks"] for name, entry in report["variants"].items() if "tasks" in entry}
    report["timings"]["load model"] = round(load_seconds, 3)
    report["app"] = {
        "drift_corpus": options.eval_corpora[0] if options.eval_corpora else None,
        "drift_windows": options.drift_windows,
        "max_new_tokens": options.generation.max_new_tokens,
        "generation_seed": options.generation.seed,
    }
    if tasks:
        report["tasks"] = tasks
    return report


@gpu
def run_job(options: RunOptions, quick: QuickTasks, save_variant: str | None = None,
            folder: str | None = None) -> Iterator[tuple[str, dict]]:
    """Load → select → calibrate → fit → evaluate (→ tasks) (→ save), yielding (stage, snapshot) after each stage.

    Refuses bad input before loading any weights. Yields only plain data (a saved model is a
    zip path in `folder`), so it can run in a ZeroGPU worker process.
    """
    check_options(options)
    start = time.perf_counter()
    loaded = MODELS.get(options.model)
    load_seconds = time.perf_counter() - start
    if quick.enabled and quick.tasks:
        options = replace(options, tasks=quick.tasks, task_limit=quick.limit)
    result = None
    for stage, result in run_stages(options, loaded):
        yield stage, snapshot(result, options, load_seconds)
    if save_variant and folder and result is not None:
        path = archive_recovered(result.models[save_variant], result.tokenizer,
                                 Path(folder) / f"{safe_name(options.model)}-{save_variant}.zip")
        report = snapshot(result, options, load_seconds)
        report["app"]["saved_model"] = str(path)
        yield "save model", report


def safe_name(model: str) -> str:
    """A model id or folder as a file-name stem ('org/name' → 'org-name')."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model.strip("/")).strip("-.") or "model"


# ---------------------------------------------------------------- formatting: text and tables


PALETTE = ("#dc2626", "#ea580c", "#ca8a04", "#4f46e5", "#0d9488", "#16a34a", "#9333ea", "#db2777", "#0891b2",
           "#65a30d", "#7c3aed", "#c2410c", "#0284c7")
DENSE_COLOR = "#334155"


def variant_colors(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per variant: dense slate, then the palette in the order of OPERATOR_CHOICES."""
    colors = {"dense": DENSE_COLOR}
    for name in names:
        if name != "dense":
            index = OPERATOR_CHOICES.index(name) if name in OPERATOR_CHOICES else len(colors)
            colors[name] = PALETTE[index % len(PALETTE)]
    return colors


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell; '–' when missing or not finite."""
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"


def blocks_text(blocks: Sequence[int]) -> str:
    """(19, 20, 21, 25) → '19–21, 25'."""
    runs: list[list[int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b - 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "none"


def corpus_tag(report: dict, corpus: str) -> str:
    """'ptb (exact)' or 'wiki (stand-in)': the short form used in table headers and legends."""
    info = report.get("corpora", {}).get(corpus, {})
    return f"{corpus} ({'exact' if info.get('real') else 'stand-in'})"


def context_line(report: dict) -> str:
    """Model, removed blocks and calibration: the caption every table and chart carries."""
    removed = report.get("removed_layers", [])
    line = f"**{report.get('model', '')}** ({report.get('num_layers', '?')} blocks) · {report.get('criterion', '')} removed " \
           f"**{len(removed)} block{'s' if len(removed) != 1 else ''}: {blocks_text(removed)}**"
    cal = report.get("calibration", {})
    if cal.get("label"):
        line += f" · calibration: {cal['label']}, {cal['sequences']} × {cal['seqlen']} tokens, seed {cal['seed']}"
    return line


def corpora_caption(report: dict) -> str:
    """One line per evaluation corpus: its full label and how much of it was read."""
    parts = []
    for corpus in report.get("variants", {}).get("dense", {}).get("ppl", {}):
        info = report["corpora"].get(corpus, {})
        parts.append(f"{corpus} = {info.get('label', corpus)} ({info.get('windows', '?')} windows, "
                     f"{info.get('tokens', '?')} tokens)")
    return " · ".join(parts)


def status_markdown(stage: str, done: int, total: int, elapsed: float, report: dict | None, finished: bool) -> str:
    """The status panel: where the run is, what it is about, and any notes from the library."""
    head = (f"**Run complete** in {elapsed:.1f} s" if finished
            else f"**Running:** {stage} done ({done}/{total}) · {elapsed:.1f} s elapsed")
    lines = [head]
    if report:
        lines.append(context_line(report))
        timings = report.get("timings", {})
        if timings:
            lines.append("Stage times: " + " · ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
        lines += [f"*Note:* {note}" for note in report.get("notes", [])]
    return "\n\n".join(lines)


def generations_html(report: dict) -> str:
    """Side-by-side cards: each variant's continuation of the same prompt, with its perplexities."""
    variants = report.get("variants", {})
    prompt = report.get("prompt")
    texts = {name: entry["generation"] for name, entry in variants.items() if "generation" in entry}
    if not prompt:
        return "<p class='gen-empty'>No prompt given: generation skipped.</p>"
    if not texts:
        return "<p class='gen-empty'>Generations appear here once the generate stage has run.</p>"
    app = report.get("app", {})
    colors = variant_colors(list(texts))
    cards = []
    for name, text in texts.items():
        ppl = " · ".join(f"{corpus} {fmt(value)}" for corpus, value in variants[name].get("ppl", {}).items())
        cards.append(
            f"<div class='gen-card{' dense' if name == 'dense' else ''}' data-variant='{html.escape(name)}'>"
            f"<div class='gen-head'><span class='gen-name'><span class='gen-swatch' style='background:{colors[name]}'>"
            f"</span>{html.escape(name)}</span><span class='gen-ppl'>{html.escape(ppl and 'ppl ' + ppl)}</span></div>"
            f"<div class='gen-text'>{html.escape(text.strip()) or '<i>(empty)</i>'}</div></div>")
    corpora = ", ".join(corpus_tag(report, c) for c in variants.get("dense", {}).get("ppl", {}))
    about = (f"{report.get('model', '')}, blocks {blocks_text(report.get('removed_layers', []))} removed · greedy, "
             f"{app.get('max_new_tokens', '?')} new tokens, seed {app.get('generation_seed', '?')}"
             + (f" · ppl on {corpora}" if corpora else ""))
    return (f"<div class='gen-prompt'><b>Prompt:</b> <span class='gen-prompt-text'>{html.escape(prompt)}</span>"
            f"<div class='gen-about'>{html.escape(about)}</div></div>"
            f"<div class='gen-grid'>{''.join(cards)}</div>")


def recovered_share(ppl_op: float, ppl_none: float | None, ppl_dense: float | None) -> float | None:
    """Share of the pruning damage an operator recovers: (ppl_none − ppl_op) / (ppl_none − ppl_dense)."""
    if ppl_none is None or ppl_dense is None or not math.isfinite(ppl_none) or ppl_none == ppl_dense:
        return None
    return (ppl_none - ppl_op) / (ppl_none - ppl_dense)


def perplexity_table(report: dict) -> pd.DataFrame:
    """Variant × corpus perplexity, and for every operator the share of pruning damage recovered."""
    variants = report.get("variants", {})
    corpora = list(variants.get("dense", {}).get("ppl", {}))
    columns = ["variant"]
    for corpus in corpora:
        columns += [f"{corpus_tag(report, corpus)} ppl", f"{corpus_tag(report, corpus)} recovered"]
    rows = []
    for name, entry in variants.items():
        row = [name]
        for corpus in corpora:
            value = entry.get("ppl", {}).get(corpus)
            share = None
            if name not in ("dense", "none") and value is not None:
                share = recovered_share(value, variants.get("none", {}).get("ppl", {}).get(corpus),
                                        variants["dense"]["ppl"].get(corpus))
            row += [fmt(value), "–" if share is None else f"{share:.0%}"]
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)


def perplexity_caption(report: dict) -> str:
    """What the perplexity table is about, and the formula of its 'recovered' columns."""
    if not report.get("variants", {}).get("dense", {}).get("ppl"):
        return "Perplexity appears here once the first corpus is done."
    note = ("recovered = (ppl_none − ppl_op) / (ppl_none − ppl_dense): 100% is the dense model, 0% plain pruning, "
            "negative worse than plain pruning")
    if "none" not in report["variants"]:
        note = "add the `none` operator to see the share of pruning damage each operator recovers"
    return f"{context_line(report)}  \n{corpora_caption(report)}  \n{note}"


def tasks_table(report: dict) -> pd.DataFrame:
    """Variant × task accuracy (%) and the mean over the tasks run."""
    tasks = report.get("tasks", {})
    names = [s["task"] for s in next(iter(tasks.values()))["scores"]] if tasks else []
    rows = []
    for variant, result in tasks.items():
        acc = {s["task"]: s["acc"] for s in result["scores"]}
        rows.append([variant, *(fmt(100 * acc[t], 1) for t in names),
                     fmt(100 * result["mean_acc"], 1) if result["mean_acc"] is not None else "–"])
    return pd.DataFrame(rows, columns=["variant", *(f"{t} acc %" for t in names), "mean acc %"])


def tasks_caption(report: dict) -> str:
    """Where the task examples came from and how many were scored."""
    tasks = report.get("tasks", {})
    if not tasks:
        return "Quick tasks run after the other stages when enabled."
    first = next(iter(tasks.values()))
    lines = [context_line(report) + f" · lm-eval, {first.get('limit') or 'all'} examples per task "
                                    f"(seeded subset, the same for every variant)"]
    lines += [f"{s['task']}: {s['data']}; chance {100 * s['chance']:.0f}%" for s in first["scores"]]
    lines += [f"{u['task']}: not run ({u['reason']})" for u in first.get("unavailable", [])]
    return "  \n".join(lines)


# ---------------------------------------------------------------- formatting: plotly figures


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


# ---------------------------------------------------------------- callbacks


OUTPUT_NAMES = ("status", "generations", "ppl_caption", "ppl_table", "scores", "errors", "drift", "structure",
                "tasks_caption", "tasks_table", "tasks_plot", "results_file", "model_file")


def render(report: dict, status: str, results_path: str | None) -> tuple:
    """All output values for one snapshot, in OUTPUT_NAMES order."""
    variants = report.get("variants", {})
    has_fits = any("boundary_error" in e for e in variants.values())
    has_drift = any("drift" in e for e in variants.values())
    return (
        status,
        generations_html(report),
        perplexity_caption(report),
        perplexity_table(report) if variants.get("dense", {}).get("ppl") else None,
        scores_figure(report) if report.get("removed_layers") or report.get("scores") else empty_figure("scoring blocks…"),
        boundary_error_figure(report) if has_fits else empty_figure("boundary errors appear after the fit"),
        drift_figure(report) if has_drift else empty_figure("per-block drift appears after perplexity"),
        structure_figure(report) if has_fits else empty_figure("operator structure appears after the fit"),
        tasks_caption(report),
        tasks_table(report) if report.get("tasks") else None,
        tasks_figure(report) if report.get("tasks") else None,
        results_path,
        report.get("app", {}).get("saved_model"),
    )


def blank_outputs(status: str) -> tuple:
    """Outputs at the start of a run: the previous run's results cleared."""
    waiting = empty_figure("waiting for the run…")
    return (status, "<p class='gen-empty'>Generations appear here once the generate stage has run.</p>",
            "Perplexity appears here once the first corpus is done.", None, waiting, waiting, waiting, waiting,
            "Quick tasks run after the other stages when enabled.", None, None, None, None)


def failed_outputs(message: str) -> tuple:
    """The status panel says the run ended on an error; everything else stays as it was."""
    return (f"**Run stopped:** {message}", *(gr.skip() for _ in OUTPUT_NAMES[1:]))


def write_results(report: dict, folder: str) -> str:
    """results.json of the run so far, in the run's own folder (Gradio copies it into its cache on every update)."""
    path = Path(folder) / "results.json"
    path.write_text(json.dumps(report, indent=2))
    return str(path)


# The library's messages name CLI flags; the page names its widgets.
FLAG_LABELS = {
    "--total_num_prune": "'Blocks to remove'",
    "--layers": "'Blocks to remove (manual)'",
    "--train_size": "'Sequences'",
    "--seqlen": "'Sequence length'",
    "--insert_type": "'Operators'",
    "--task_limit": "'Examples per task'",
}


def page_message(err: GhostedError) -> str:
    """The library's message with CLI flag names replaced by the page's widget labels."""
    message = str(err)
    for flag, label in FLAG_LABELS.items():
        message = message.replace(flag, label)
    return message


def on_run(model: str, criterion: str, depth: float, manual_blocks: str, operators: list[str], calibration: str,
           samples: float, seqlen: float, seed: float, eval_corpora: list[str], eval_tokens: float, prompt: str,
           new_tokens: float, tasks_on: bool, task_names: list[str], task_examples: float, save_variant: str = NO_SAVE,
           progress: gr.Progress = gr.Progress(track_tqdm=True)) -> Iterator[tuple]:
    """Run button: stream the run's stages into the page; any failure becomes a gr.Error."""
    start = time.perf_counter()
    try:
        options = build_options(model, criterion, depth, manual_blocks, operators, calibration, samples, seqlen, seed,
                                eval_corpora, eval_tokens, prompt, new_tokens)
        quick = QuickTasks(bool(tasks_on), tuple(task_names or ()), int(task_examples))
        if quick.enabled and not quick.tasks:
            raise GhostedError("quick tasks are on but none is selected; pick at least one task or switch them off")
        check_options(options)
        saving = check_save(options, save_variant)
        stages = planned_stages(options, quick, saving)
        progress(0.0, desc=f"{stages[0]}…")
        yield blank_outputs(f"**Running:** {stages[0]}…")
        with tempfile.TemporaryDirectory(prefix="ghosted-run-") as folder:  # removed when the run ends or is stopped
            for done, (stage, report) in enumerate(run_job(options, quick, saving, folder), start=1):
                elapsed = time.perf_counter() - start
                following = stages[done] if done < len(stages) else None
                progress(min(done / len(stages), 1.0), desc=f"{following}…" if following else "done")
                status = status_markdown(stage, done, len(stages), elapsed, report, finished=following is None)
                yield render(report, status, write_results(report, folder))
    except GhostedError as err:
        yield failed_outputs(page_message(err))
        raise gr.Error(page_message(err), duration=None) from err
    except Exception as err:  # a bug: keep serving, say so, keep the traceback in the log
        log.exception("run failed")
        message = f"internal error ({type(err).__name__}: {err}); the server log has the traceback"
        yield failed_outputs(message)
        raise gr.Error(message, duration=None) from err


def model_note(name: str) -> str:
    """An honest note on what this machine can load."""
    hub = "reachable" if hub_reachable() else "not reachable from this machine"
    return (f"Embedded models load offline. Type a local folder or a Hub id for others (the Hub is {hub}); "
            "Llama, Mistral, Qwen2/3 and Gemma3 families.")


def on_model_change(name: str, depth: float) -> tuple:
    """Bound the depth slider and the block picker by the chosen model's block count."""
    name = (name or "").strip()
    try:
        layers = num_blocks(name)
    except GhostedError as err:
        return f"**Cannot use this model:** {err}", gr.update(), gr.update()
    except Exception as err:  # an unreadable folder or config: say so, keep serving
        return f"**Cannot read {name!r}:** {err}", gr.update(), gr.update()
    info = depth_info(layers)
    return (f"{name}: {layers} decoder blocks (0–{layers - 1}).", gr.update(maximum=layers, value=min(int(depth), layers - 1),
                                                                            info=info),
            gr.update(info=f"block indices 0–{layers - 1}, e.g. {max(0, layers - 11)}-{layers - 5}"))


def depth_info(layers: int) -> str:
    """The depth slider's help text for a model with `layers` blocks."""
    return f"of {layers} blocks (removing all {layers} is refused)"


def on_criterion_change(criterion: str) -> tuple:
    """Depth for similarity criteria, the block picker for manual, neither for none."""
    return gr.update(visible=criterion not in ("manual", "none")), gr.update(visible=criterion == "manual")


# ---------------------------------------------------------------- the page


def read_prompts() -> list[str]:
    """Example prompts from assets/prompts.txt, one a line."""
    return [line.strip() for line in (ASSETS / "prompts.txt").read_text().splitlines() if line.strip()]


def corpus_choices(split: str) -> list[tuple[str, str]]:
    """(label, name) pairs from the corpus registry; the label says stand-in or exact."""
    return [(f"{name} — {label}", name) for name, label in data.describe(data.corpus_names(), split).items()]


def build_demo() -> gr.Blocks:
    """The page: controls on the left, results filling in on the right."""
    prompts = read_prompts()
    default_layers = num_blocks_or(DEFAULTS.model, 30)
    with gr.Blocks(title="Ghosted Layers Studio", delete_cache=(3600, 7200)) as demo:
        with gr.Row(equal_height=True):
            with gr.Column(scale=2, elem_id="app-header"):
                gr.Markdown(
                    "# Ghosted Layers Studio\n"
                    "Remove decoder blocks from a language model, fit a training-free linear map **W** where they were, "
                    "and see what pruning broke and what each operator gives back: generations, perplexity, "
                    "boundary error, per-block drift and the structure of W. Press **Run** to try the defaults "
                    "(about a minute on 2 CPU cores).")
            with gr.Column(scale=3):
                gr.HTML((ASSETS / "method.svg").read_text(), elem_id="method-diagram")
        with gr.Row():
            with gr.Column(scale=1, min_width=340, elem_id="controls"):
                with gr.Row(elem_id="run-buttons"):
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-button")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-button")
                with gr.Accordion("Model and pruning", open=True):
                    model = gr.Dropdown(list(EMBEDDED), value=DEFAULTS.model, allow_custom_value=True, label="Model",
                                        elem_id="model",
                                        info="an embedded model, a local folder or a Hub id")
                    model_info = gr.Markdown(model_note(DEFAULTS.model), elem_classes="caption")
                    criterion = gr.Dropdown([(f"{name} — {CRITERION_HELP.get(name, spec.paper)}", name)
                                             for name, spec in CRITERIA.items()],
                                            value=DEFAULTS.criterion, label="Which blocks to remove")
                    depth = gr.Slider(1, default_layers, value=DEFAULTS.depth, step=1, label="Blocks to remove",
                                      info=depth_info(default_layers), elem_id="depth")
                    manual_blocks = gr.Textbox(label="Blocks to remove (manual)", value="19-25", visible=False,
                                               info=f"block indices 0–{default_layers - 1}, e.g. 19-25 or 3,7,12")
                with gr.Accordion("Recovery operators", open=True):
                    operators = gr.Dropdown(OPERATOR_CHOICES, value=list(DEFAULTS.operators), multiselect=True,
                                            label="Operators",
                                            info=f"{SEQUENTIAL_SUFFIX}: fit each boundary on the already recovered model")
                with gr.Accordion("Calibration", open=False):
                    calibration = gr.Dropdown(corpus_choices("calibration"), value=DEFAULTS.calibration,
                                              label="Calibration corpus")
                    samples = gr.Slider(1, 128, value=DEFAULTS.samples, step=1, label="Sequences",
                                        info="the paper: 128")
                    seqlen = gr.Dropdown(list(SEQLENS), value=DEFAULTS.seqlen, label="Sequence length (tokens)",
                                         info="also the perplexity window; the paper: 2048")
                    seed = gr.Number(DEFAULTS.seed, precision=0, label="Seed")
                with gr.Accordion("Evaluation", open=False):
                    eval_corpora = gr.CheckboxGroup(corpus_choices("evaluation"), value=list(DEFAULTS.eval_corpora),
                                                    label="Perplexity corpora")
                    eval_tokens = gr.Slider(256, 16384, value=DEFAULTS.eval_tokens, step=256,
                                            label="Perplexity tokens per corpus")
                with gr.Accordion("Generation", open=True):
                    prompt = gr.Textbox(prompts[0], label="Prompt", lines=2)
                    gr.Examples([[p] for p in prompts], inputs=[prompt], label="Example prompts")
                    new_tokens = gr.Slider(4, 128, value=DEFAULTS.new_tokens, step=4, label="New tokens")
                with gr.Accordion("Quick zero-shot tasks", open=False):
                    tasks_on = gr.Checkbox(False, label="Score every variant on quick tasks (slow: minutes)")
                    task_names = gr.CheckboxGroup(list(TASKS), value=list(DEFAULTS.tasks), label="Tasks")
                    task_examples = gr.Slider(5, 200, value=DEFAULTS.task_examples, step=5,
                                              label="Examples per task (seeded subset)")
                with gr.Accordion("Save a recovered model", open=False):
                    save_variant = gr.Dropdown([NO_SAVE] + OPERATOR_CHOICES, value=DEFAULTS.save_variant,
                                               label="Variant to download",
                                               info="surviving blocks + operators as safetensors in a zip "
                                                    "(SmolLM2: about 0.4 GB); must be one of the operators above")
                    model_file = gr.File(label="Recovered model (zip; load with ghosted_core.export.load_recovered)",
                                         elem_id="model-file", interactive=False)
            with gr.Column(scale=2):
                status = gr.Markdown("Press **Run** to start.", elem_id="status")
                gr.Markdown("### Generations", elem_classes="section-title")
                generations = gr.HTML("<p class='gen-empty'>Generations appear here once the generate stage has run.</p>",
                                      elem_id="generations")
                gr.Markdown("### Perplexity", elem_classes="section-title")
                ppl_caption = gr.Markdown("", elem_classes="caption")
                ppl_table = gr.Dataframe(label="Perplexity by corpus and variant", interactive=False, elem_id="ppl-table",
                                         show_label=False, wrap=True)
                gr.Markdown("### Charts", elem_classes="section-title")
                scores_plot = gr.Plot(label="Criterion scores", elem_id="plot-scores", show_label=False)
                errors_plot = gr.Plot(label="Boundary error", elem_id="plot-errors", show_label=False)
                drift_plot = gr.Plot(label="Per-block drift", elem_id="plot-drift", show_label=False)
                structure_plot = gr.Plot(label="Operator structure", elem_id="plot-structure", show_label=False)
                with gr.Column(visible=False) as tasks_box:
                    gr.Markdown("### Quick tasks", elem_classes="section-title")
                    tasks_caption_md = gr.Markdown("Quick tasks run after the other stages when enabled.",
                                                   elem_classes="caption")
                    tasks_table_df = gr.Dataframe(interactive=False, show_label=False, elem_id="tasks-table")
                    tasks_plot = gr.Plot(show_label=False, elem_id="plot-tasks")
                results_file = gr.File(label="results.json", elem_id="results-file", interactive=False)

        inputs = [model, criterion, depth, manual_blocks, operators, calibration, samples, seqlen, seed, eval_corpora,
                  eval_tokens, prompt, new_tokens, tasks_on, task_names, task_examples, save_variant]
        outputs = [status, generations, ppl_caption, ppl_table, scores_plot, errors_plot, drift_plot, structure_plot,
                   tasks_caption_md, tasks_table_df, tasks_plot, results_file, model_file]
        run_event = run_btn.click(on_run, inputs, outputs, api_name="run", concurrency_limit=RUN_CONCURRENCY,
                                  concurrency_id="run", show_progress_on=[status])
        stop_btn.click(None, None, None, cancels=[run_event], api_name="stop")
        model.change(on_model_change, [model, depth], [model_info, depth, manual_blocks], api_name="model_info")
        criterion.change(on_criterion_change, criterion, [depth, manual_blocks], api_visibility="private")
        tasks_on.change(lambda on: gr.update(visible=on), tasks_on, tasks_box, api_visibility="private")
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=RUN_CONCURRENCY)
    return demo


def num_blocks_or(name: str, fallback: int) -> int:
    """Block count of `name`, or `fallback` when it cannot be read at start-up (e.g. assets not set up yet)."""
    try:
        return num_blocks(name)
    except Exception as err:  # start-up must not fail on a missing asset; the run says what is wrong
        log.warning("cannot read the block count of %s: %s", name, err)
        return fallback


def launch_options() -> dict:
    """Theme and CSS, which Gradio 6 takes at launch."""
    return {"theme": gr.themes.Soft(primary_hue="indigo", neutral_hue="slate"),
            "css_paths": [ASSETS / "app.css"]}


demo = build_demo()


def main() -> None:
    """Serve on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 0.0.0.0:7860)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "accelerate", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), **launch_options())


if __name__ == "__main__":
    main()
