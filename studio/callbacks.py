"""What the page's events call: Run (streaming a run into every output), model and criterion changes."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from studio.cache import num_blocks
from studio.charts import boundary_error_figure, drift_figure, empty_figure, scores_figure, structure_figure, \
    tasks_figure
from studio.runner import QuickTasks, build_options, check_options, check_save, planned_stages, run_job
from studio.settings import NO_SAVE
from studio.tables import generations_html, perplexity_caption, perplexity_table, status_markdown, tasks_caption, \
    tasks_table

log = logging.getLogger(__name__)


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

