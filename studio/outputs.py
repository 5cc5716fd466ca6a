"""What the page shows: the Run outputs' names and order, and a run's JSON snapshot rendered into them."""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import gradio as gr

from ghosted_core.errors import GhostedError
from ghosted_core.report.charts import boundary_error_figure, distill_figure, drift_figure, empty_figure, \
    scores_figure, structure_figure, tasks_figure
from studio.history import history_csv, history_table
from ghosted_core.report.compare import compare_caption, compare_table, criterion_scores_figure, \
    similarity_map_figure
from ghosted_core.report.sweep import curve_figure, recovered_figure, sweep_caption, sweep_table
from ghosted_core.report.tradeoff import tradeoff_figure
from ghosted_core.report.tables import empty_perplexity_table, generations_html, perplexity_caption, \
    perplexity_table, tasks_caption, tasks_table

log = logging.getLogger(__name__)


TOAST_SECONDS = 12  # the error pop-up goes after this; the status panel keeps the message (the pop-up would cover it)


OUTPUT_NAMES = ("status", "generations", "ppl_caption", "ppl_table", "scores", "errors", "drift", "structure",
                "tasks_caption", "tasks_table", "tasks_plot", "results_file", "model_file", "save_note",
                "sweep_caption", "curve", "recovered", "sweep_table", "history_table", "history_file",
                "compare_caption", "similarity_map", "criterion_scores", "compare_table", "distill_plot",
                "tradeoff", "sweep_tradeoff")
STATE_NAMES = ("shown", "history")  # per-session state, after the components (hidden from the API)
# The Run inputs, in order (the /run endpoint's parameters). History restores all but your text.
INPUT_NAMES = ("model", "criterion", "depth", "manual_blocks", "operators", "calibration", "samples", "seqlen", "seed",
               "eval_corpora", "eval_tokens", "prompt", "new_tokens", "tasks_on", "task_names", "task_examples",
               "save_variant", "export_format", "gguf_type", "mode", "depths", "your_text", "your_file", "text_use",
               "compare_criteria", "distill_on", "distill_steps", "distill_train", "gguf_imatrix", "speed_on")
SETTING_NAMES = tuple(name for name in INPUT_NAMES if name not in ("your_text", "your_file"))  # never kept


def as_outputs(values: dict) -> tuple:
    """Output values in OUTPUT_NAMES + STATE_NAMES order; an output not in `values` keeps what it shows."""
    return tuple(values.get(name, gr.skip()) for name in (*OUTPUT_NAMES, *STATE_NAMES))


def render(report: dict, status: str, results_path: str | None) -> dict:
    """The single-depth outputs for one snapshot."""
    variants = report.get("variants", {})
    has_fits = any("boundary_error" in e for e in variants.values())
    has_drift = any("drift" in e for e in variants.values())
    has_distill = any("distill" in e for e in variants.values())
    app = report.get("app", {})
    return {
        "status": status,
        "generations": generations_html(report),
        "ppl_caption": perplexity_caption(report),
        "ppl_table": perplexity_table(report) if variants.get("dense", {}).get("ppl") else empty_perplexity_table(),
        "scores": scores_figure(report) if report.get("removed_layers") or report.get("scores")
        else empty_figure("scoring blocks…"),
        "errors": boundary_error_figure(report) if has_fits else empty_figure("boundary errors appear after the fit"),
        "drift": drift_figure(report) if has_drift else empty_figure("per-block drift appears after perplexity"),
        "structure": structure_figure(report) if has_fits else empty_figure("operator structure appears after the fit"),
        "tasks_caption": tasks_caption(report),
        "tasks_table": tasks_table(report) if report.get("tasks") else None,
        "tasks_plot": tasks_figure(report) if report.get("tasks") else None,
        "results_file": results_path,
        "model_file": app.get("saved_model"),
        "save_note": save_note(app) if app.get("saved_model") or app.get("saved_refused") else gr.skip(),
        "distill_plot": distill_figure(report) if has_distill else empty_figure(DISTILL_HINT),
        "tradeoff": tradeoff_figure(report),
    }


def render_sweep(report: dict, status: str, results_path: str | None) -> dict:
    """The sweep outputs for one snapshot: the curve, damage recovered, the depth × operator table."""
    return {"status": status, "sweep_caption": sweep_caption(report), "curve": curve_figure(report),
            "recovered": recovered_figure(report), "sweep_table": sweep_table(report), "results_file": results_path,
            "sweep_tradeoff": tradeoff_figure(report)}


def render_compare(report: dict, status: str, results_path: str | None) -> dict:
    """The comparison outputs for one snapshot: the map, each criterion's scores, the criterion × operator table."""
    return {"status": status, "compare_caption": compare_caption(report), "similarity_map": similarity_map_figure(report),
            "criterion_scores": criterion_scores_figure(report), "compare_table": fitted_table(compare_table(report)),
            "results_file": results_path}


def fitted_table(table) -> dict:
    """The criteria × operators table with column widths that add up to the table's box (cells wrap): left to
    content, Gradio sizes each column to its widest cell unwrapped, and six operators run past a 1280 px page."""
    operators = len(table.columns) - 3  # criterion, blocks removed, …operators…, scoring cost
    share = f"{66 / max(operators, 1):.1f}%"
    return gr.update(value=table, column_widths=["13%", "11%", *[share] * operators, "10%"])


def blank_outputs(status: str) -> dict:
    """Outputs at the start of a run: the previous run's results cleared."""
    waiting = empty_figure("waiting for the run…")
    return {"status": status, "generations": "<p class='gen-empty'>Generations appear here once the generate stage has run.</p>",
            "ppl_caption": "Perplexity appears here once the first corpus is done.", "ppl_table": empty_perplexity_table(),
            "scores": waiting, "errors": waiting, "drift": waiting, "structure": waiting,
            "tasks_caption": "Quick tasks run after the other stages when enabled.", "tasks_table": None,
            "tasks_plot": None, "results_file": None, "model_file": None, "save_note": SAVE_HINT,
            "sweep_caption": "A sweep's curve and table appear here depth by depth.", "curve": waiting,
            "recovered": waiting, "sweep_table": sweep_table({}), "compare_caption": COMPARE_HINT,
            "similarity_map": waiting, "criterion_scores": waiting, "compare_table": compare_table({}),
            "distill_plot": empty_figure(DISTILL_HINT), "tradeoff": waiting, "sweep_tradeoff": waiting}


DISTILL_HINT = "distillation curves appear here while it trains (switch it on under 'Distillation')"


COMPARE_HINT = "A comparison's map, scores and table appear here criterion by criterion."


SAVE_HINT = "Choose a variant above to download it after the next run."


def save_note(app: dict) -> str:
    """Which format the download is in, why, and how to load it; or why nothing was saved (`studio.saved`)."""
    if app.get("saved_refused"):
        return f"**Not saved:** {app['saved_refused']}"
    if app.get("saved_gguf"):
        files = app.get("saved_ggufs") or [{"file": app["saved_gguf"]}]
        listed = ", ".join(f"`{f['file']}`" + (f" ({f['bytes'] / 1e6:.0f} MB" + (f", ppl {f['ppl']:.2f}" if "ppl" in f
                                                                               else "") + ")" if "bytes" in f else "")
                           for f in files)
        imatrix = f", k-quants with an importance matrix on {app['saved_imatrix']}" if app.get("saved_imatrix") else ""
        bundle = " (one zip holds them all)" if len(files) > 1 else ""
        how = (f"**GGUF** for llama.cpp: {listed}{bundle} (llama.cpp's own converter and llama-quantize{imatrix}; "
               f"perplexity by llama-perplexity on {app.get('saved_gguf_text') or 'held-out text'}): "
               "`llama-cli -m FILE -p \"…\"`; Push to the Hub sends the stock folder with every GGUF")
        return f"`{app.get('saved_variant', '')}` saved as {how}. Why stock: {app.get('saved_reason', '')}."
    if app.get("saved_mode") == "stock":
        how = ("a **stock** Hugging Face folder: plain `AutoModelForCausalLM.from_pretrained(folder)` and serving "
               "engines load it")
    else:
        how = ("a **remote_code** folder: load it with `AutoModelForCausalLM.from_pretrained(folder, "
               "trust_remote_code=True)`; plain transformers refuses it (its model type is a Ghosted one), "
               "it never loads silently wrong")
    return f"`{app.get('saved_variant', '')}` saved as {how}. Why this format: {app.get('saved_reason', '')}."


def history_outputs(history: list[dict], folder: str) -> dict:
    """The session's history, its table and its CSV (written in `folder`, which must outlive the yield)."""
    return {"history": history, "history_table": history_table(history), "history_file": history_csv(history, folder)}


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
    "--seed": "'Seed'",
    "--eval_max_tokens": "'Perplexity tokens per corpus'",
    "--max_new_tokens": "'New tokens'",
}


def page_message(err: GhostedError) -> str:
    """The library's message with CLI flag names replaced by the page's widget labels, HTML-escaped.

    Messages quote what was typed (an unknown model, a block list), and both the status panel and
    gr.Error's pop-up render HTML: escaped, a typed `<script>` shows as text.
    """
    message = str(err)
    for flag, label in FLAG_LABELS.items():
        message = message.replace(flag, label)
    return html.escape(message, quote=False)
