"""What the page's events call: Run (streaming a run into every output), Stop, and the settings widgets.

Run streams one update per stage. Each update also stores, per browser session (gr.State),
which run the results on the page belong to, so that a later refusal, failure or Stop can
say so. Stop asks the session's runs to stop at their next batch (`studio.runs`) and reports
where they stopped.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from ghosted_core.advice import default_depth
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from ghosted_core.stopping import RunStopped
from studio.cache import model_shape
from studio.charts import boundary_error_figure, drift_figure, empty_figure, scores_figure, structure_figure, \
    tasks_figure
from studio.runner import QuickTasks, build_options, check_options, check_save, planned_stages, run_job, \
    settings_advice
from studio.runs import RUNS, ActiveRun
from studio.settings import NO_SAVE, STOP_WAIT_SECONDS
from studio.status import NOTHING_SHOWN, advice_lines, complete_status, failed_status, refused_status, \
    report_advice, running_status, shown_state, stopped_before_start, stopped_status
from studio.tables import empty_perplexity_table, generations_html, perplexity_caption, perplexity_table, \
    tasks_caption, tasks_table

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
        perplexity_table(report) if variants.get("dense", {}).get("ppl") else empty_perplexity_table(),
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
            "Perplexity appears here once the first corpus is done.", empty_perplexity_table(), waiting, waiting,
            waiting, waiting, "Quick tasks run after the other stages when enabled.", None, None, None, None)


def status_only(status: str) -> tuple:
    """The status panel changes; every other output stays as it was."""
    return (status, *(gr.skip() for _ in OUTPUT_NAMES[1:]))


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


def on_submit() -> tuple[float, str]:
    """Run pressed: note the time (queueing counts apart from running) and say the run waits for the server."""
    return time.time(), "**Queued:** waiting for the server to start your run…"


def on_run(model: str, criterion: str, depth: float, manual_blocks: str, operators: list[str], calibration: str,
           samples: float, seqlen: float, seed: float, eval_corpora: list[str], eval_tokens: float, prompt: str,
           new_tokens: float, tasks_on: bool, task_names: list[str], task_examples: float, save_variant: str = NO_SAVE,
           submitted: float | None = None, shown: dict | None = None, request: gr.Request | None = None,
           progress: gr.Progress = gr.Progress(track_tqdm=True)) -> Iterator[tuple]:
    """Run button: stream the run's stages into the page (plus the page state); any failure becomes a gr.Error."""
    start = time.perf_counter()
    queued = time.time() - submitted if submitted else None
    try:
        options = build_options(model, criterion, depth, manual_blocks, operators, calibration, samples, seqlen, seed,
                                eval_corpora, eval_tokens, prompt, new_tokens)
        quick = QuickTasks(bool(tasks_on), tuple(task_names or ()), int(task_examples))
        if quick.enabled and not quick.tasks:
            raise GhostedError("quick tasks are on but none is selected; pick at least one task or switch them off")
        check_options(options)
        saving = check_save(options, save_variant)
        stages = planned_stages(options, quick, saving)
        advice = settings_advice(options)
    except GhostedError as err:  # refused before any work: the page keeps (and names) the previous results
        yield (*status_only(refused_status(page_message(err), shown)), gr.skip())
        raise gr.Error(page_message(err), duration=None) from err
    run = RUNS.start(request.session_hash if request else "", stages)
    report: dict = {}
    try:
        progress(0.0, desc=f"{stages[0]}…")
        yield (*blank_outputs(running_status(stages[0], 0, len(stages), 0.0, None, advice, queued)), NOTHING_SHOWN)
        with tempfile.TemporaryDirectory(prefix="ghosted-run-") as folder:  # removed when the run ends or is stopped
            for done, (stage, report) in enumerate(run_job(options, quick, saving, folder, run.stop.is_set), start=1):
                run.done, run.report = done, report
                elapsed = time.perf_counter() - start
                following = stages[done] if done < len(stages) else None
                progress(min(done / len(stages), 1.0), desc=f"{following}…" if following else "done")
                if report.get("removed_layers"):
                    advice = report_advice(report)
                status = (running_status(following, done, len(stages), elapsed, report, advice, queued) if following
                          else complete_status(elapsed, report, advice, queued))
                yield (*render(report, status, write_results(report, folder)),
                       shown_state(report, "in progress" if following else "complete"))
    except RunStopped as stop:  # Stop pressed: the library stopped at its next batch
        run.stopped_at = stop.where
        RUNS.end(run)
        yield (*status_only(stopped_status(stop.where, time.perf_counter() - start, report, stages)),
               shown_state(report, f"stopped during {stop.where}"))
    except GhostedError as err:
        message = page_message(err)
        yield (*status_only(failed_status(message, run.current, report)), shown_state(report, f"failed during {run.current}"))
        raise gr.Error(message, duration=None) from err
    except Exception as err:  # a bug: keep serving, say so, keep the traceback in the log
        log.exception("run failed")
        message = f"internal error ({type(err).__name__}: {err}); the server log has the traceback"
        yield (*status_only(failed_status(message, run.current, report)), shown_state(report, f"failed during {run.current}"))
        raise gr.Error(message, duration=None) from err
    finally:
        RUNS.end(run)


def on_stop(shown: dict | None = None, request: gr.Request | None = None) -> tuple[str, dict]:
    """Stop button: the session's runs stop at their next batch; the status says where, and what the page shows."""
    runs = RUNS.stop(request.session_hash if request else "")
    if not runs:
        return stopped_before_start(shown), gr.skip()
    run = runs[-1]
    for each in runs:
        each.ended.wait(STOP_WAIT_SECONDS)
    return stop_message(run), shown_state(run.report or {}, f"stopped during {run.stopped_at or run.current}")


def stop_message(run: ActiveRun) -> str:
    """What Stop reports about `run`: where it stopped, or that it will stop at its next batch."""
    if run.ended.is_set():
        return stopped_status(run.stopped_at or run.current, run.elapsed(), run.report, run.stages)
    return (f"**Stopping** during {run.current}: the server stops at its next batch or stage "
            f"({run.elapsed():.0f} s into the run); the results below are this run's finished stages.")


def model_note(name: str) -> str:
    """An honest note on what this machine can load."""
    hub = "reachable" if hub_reachable() else "not reachable from this machine"
    return (f"Embedded models load offline. Type a local folder or a Hub id for others (the Hub is {hub}); "
            "Llama, Mistral, Qwen2/3 and Gemma3 families.")


def on_model_change(name: str) -> tuple:
    """Bound the depth slider by the model's block count and reset the depth to a sensible share of it."""
    name = (name or "").strip()
    try:
        layers, width = model_shape(name)
    except GhostedError as err:
        return f"**Cannot use this model:** {err}", gr.update(), gr.update()
    except Exception as err:  # an unreadable folder or config: say so, keep serving
        return f"**Cannot read {name!r}:** {err}", gr.update(), gr.update()
    depth = default_depth(layers)
    return (f"{name}: {layers} decoder blocks (0–{layers - 1}), width {width}; depth reset to {depth} "
            f"(a quarter of the blocks).",
            gr.update(maximum=layers, value=depth, info=depth_info(layers)),
            gr.update(info=f"block indices 0–{layers - 1}, e.g. {max(0, layers - 11)}-{layers - 5}"))


def on_settings_change(model: str, criterion: str, depth: float, manual_blocks: str, operators: list[str],
                       samples: float, seqlen: float) -> str:
    """Advice on the settings before a run: a deep cut, a cut through the last block, too little calibration."""
    try:
        options = build_options(model, criterion, depth, manual_blocks, operators or ["none"], "mix", samples, seqlen,
                                0, [], 256, "", 4)
        check_options(options)
        lines = advice_lines(settings_advice(options))
    except GhostedError as err:
        return f"⚠ {page_message(err)}"
    except Exception:  # a model that cannot be read is explained by the model note
        return ""
    return "  \n".join(lines)


def depth_info(layers: int) -> str:
    """The depth slider's help text for a model with `layers` blocks."""
    return f"of {layers} blocks (removing all {layers} is refused)"


def on_criterion_change(criterion: str) -> tuple:
    """Depth for similarity criteria, the block picker for manual, neither for none."""
    return gr.update(visible=criterion not in ("manual", "none")), gr.update(visible=criterion == "manual")

