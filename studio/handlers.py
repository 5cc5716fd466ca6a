"""What the page's events call: Run (streaming a run into every output), Stop, and the settings widgets.

Run streams one update per stage. Each update also stores, per browser session (gr.State),
which run the results on the page belong to, so that a later refusal, failure or Stop can
say so. Stop asks the session's runs to stop at their next batch (`studio.runs`) and reports
where they stopped.
"""

from __future__ import annotations

import functools
import inspect
import logging
import tempfile
import time
from collections.abc import Iterator
from html import escape
from dataclasses import replace

import gradio as gr

from ghosted_core.planning.advice import Advice, default_depth
from ghosted_core.data import user_text
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from ghosted_core.oom import guard_stages
from ghosted_core.progress import PROGRESS
from ghosted_core.stopping import RunStopped
from ghosted_core.run.pipeline import LIVE_STAGES
from ghosted_core.run.sweep import check_sweep, parse_depths
from studio.access import hub_token
from studio.cache import model_shape, num_blocks
from studio.history import add_run, settings_of
from studio.presets_view import find_preset, preset_note
from studio.runner import QuickTasks, RunRequest, build_options, build_request, check_options, run_compare_job, \
    run_job, run_sweep_job, settings_advice
from studio import guard
from studio.runs import RUNS, ActiveRun, client_gone
from studio.push import saving_account
from studio.saved import SAVED, save_estimate, saved_cap_bytes
from studio.session_files import serve_outputs
from studio.user_input import corpora_with_text, read_user_text
from studio.settings import COMPARE, DEFAULTS, NO_SAVE, STOP_WAIT_SECONDS, SWEEP, TASK_EXAMPLES
from studio.status import NOTHING_SHOWN, advice_lines, complete_status, failed_status, refused_status, \
    report_advice, running_status, shown_state, stopped_before_start, stopped_status
from studio.outputs import SETTING_NAMES, TOAST_SECONDS, as_outputs, blank_outputs, history_outputs, page_message, \
    render, render_compare, render_sweep, write_results

log = logging.getLogger(__name__)


def prepare_run(values: dict, session: str) -> RunRequest:
    """The checked request of one press of Run, from on_run's arguments by name: every check that needs no
    weights (widget values, your text, the library's checks, the work budget). GhostedError when refused."""
    v = values | {"model": guard.model_name(values.get("model"))[0]}
    text = read_user_text(guard.text(v.get("your_text"), "Paste text", user_text.MAX_BYTES), v.get("your_file"),
                          session)
    cal, evals = v["calibration"], tuple(v.get("eval_corpora") or ())
    if text is not None:
        cal, evals = corpora_with_text(v.get("text_use", "evaluation"), cal, evals)
    options = replace(build_options(v["model"], v["criterion"], v["depth"], v["manual_blocks"], v["operators"], cal,
                                    v["samples"], v["seqlen"], v["seed"], evals, v["eval_tokens"], v["prompt"],
                                    v["new_tokens"], v.get("distill_on", DEFAULTS.distill_on),
                                    v.get("distill_steps", DEFAULTS.distill_steps),
                                    v.get("distill_train", DEFAULTS.distill_train),
                                    hub_token(v["model"], v.get("oauth_token")),
                                    v.get("speed_on", DEFAULTS.speed_on)), user_text=text)
    quick = QuickTasks(guard.flag(v["tasks_on"], "Score every variant on quick tasks"),
                       guard.names(v["task_names"], "Tasks"),
                       guard.whole(v["task_examples"], "Examples per task", 1, TASK_EXAMPLES[1]))
    return build_request(options, quick, v.get("save_variant", NO_SAVE), v.get("export_format", "auto"),
                         v.get("mode", "single depth"), v.get("depths", "2:10:2"),
                         guard.names(v.get("compare_criteria"), "Criteria to compare"),
                         guard.names(v.get("gguf_type", ["f16"]), "GGUF types"),
                         guard.flag(v.get("gguf_imatrix", False), "Importance matrix for the k-quants"))


def on_run(model: str, criterion: str, depth: float, manual_blocks: str, operators: list[str], calibration: str,
           samples: float, seqlen: float, seed: float, eval_corpora: list[str], eval_tokens: float, prompt: str,
           new_tokens: float, tasks_on: bool, task_names: list[str], task_examples: float, save_variant: str = NO_SAVE,
           export_format: str = "auto", gguf_type: list[str] | None = None, mode: str = "single depth", depths: str = "2:10:2",
           your_text: str | None = None, your_file: str | None = None, text_use: str = "evaluation",
           compare_criteria: list[str] | None = None, distill_on: bool = DEFAULTS.distill_on,
           distill_steps: float = DEFAULTS.distill_steps, distill_train: str = DEFAULTS.distill_train,
           gguf_imatrix: bool = DEFAULTS.gguf_imatrix, speed_on: bool = DEFAULTS.speed_on,
           submitted: float | None = None, shown: dict | None = None,
           history: list[dict] | None = None, oauth_token: gr.OAuthToken | None = None,
           profile: gr.OAuthProfile | None = None, request: gr.Request | None = None,
           progress: gr.Progress = gr.Progress(track_tqdm=True)) -> Iterator[tuple]:
    """Run button: stream a single-depth run, a sweep or a comparison into the page, with the session's state;
    failures become gr.Error."""
    values = dict(locals())
    settings = {name: value for name, value in values.items() if name in SETTING_NAMES}
    start = time.perf_counter()
    queued = time.time() - submitted if submitted else None
    session = request.session_hash if request else ""
    try:
        job = prepare_run(values, session)
        stages, advice = job.stages(), job.advice() + [Advice(note) for note in job.notes]
    except GhostedError as err:  # refused before any work: the page keeps (and names) the previous results
        yield as_outputs({"status": refused_status(page_message(err), shown)})
        raise gr.Error(page_message(err), duration=TOAST_SECONDS, print_exception=False) from err
    run = RUNS.start(session, stages)
    run.settings = settings
    gone = client_gone(request)
    should_stop = lambda: run.stop.is_set() or gone()  # noqa: E731 (Stop pressed, or the client went away)
    report: dict = {}
    keep = None  # the session's folder for this run's saved model
    try:
        progress(0.0, desc=f"{stages[0]}…")
        yield as_outputs(blank_outputs(running_status(stages[0], 0, len(stages), 0.0, None, advice, queued))
                         | {"shown": NOTHING_SHOWN})
        with tempfile.TemporaryDirectory(prefix="ghosted-run-") as folder:  # removed when the run ends or is stopped
            if job.compare:
                updates, draw = run_compare_job(job.options, job.criteria, should_stop), render_compare
            elif job.sweep:
                updates, draw = run_sweep_job(job.options, job.depths, should_stop), render_sweep
            else:
                owner = saving_account(oauth_token, profile) if job.save_variant else None
                keep = str(SAVED.new_folder(session, owner)) if job.save_variant else None  # for the push
                updates = run_job(job.options, job.quick, job.save_variant, folder, should_stop, job.export_format,
                                  job.gguf_type, keep, job.gguf_imatrix, saved_cap_bytes() if keep else None)
                draw = render
            updates = guard_stages(updates, stages[0])  # out of memory: one message
            done, last = 0, None
            for stage, item in updates:
                elapsed = time.perf_counter() - start
                if stage == PROGRESS:  # a loop inside the stage in progress: its count and estimate in the status
                    current = stages[min(done, len(stages) - 1)]
                    progress(min((done + (item.fraction or 0.0)) / len(stages), 1.0), desc=f"{current}… {item.text()}")
                    yield as_outputs({"status": running_status(current, done, len(stages), elapsed, report or None,
                                                               advice, queued, item)})
                    continue
                report = item
                done += not (stage == last and stage in LIVE_STAGES)  # a live stage's updates are one planned stage
                last = stage
                run.done, run.report = done, report
                following = stages[done] if done < len(stages) else None
                if keep is not None:
                    report = within_saved_cap(session, job, stage, following, report)
                progress(min(done / len(stages), 1.0), desc=f"{following}…" if following else "done")
                if report.get("removed_layers"):
                    advice = report_advice(report) + [Advice(note) for note in job.notes]
                status = (running_status(following, done, len(stages), elapsed, report, advice, queued) if following
                          else complete_status(elapsed, report, advice, queued))
                values = draw(report, status, write_results(report, folder))
                values["shown"] = shown_state(report, "in progress" if following else "complete")
                if following is None:
                    values |= history_outputs(add_run(history, settings, report, "complete"), folder)
                yield as_outputs(serve_outputs(session, values))
    except RunStopped as stop:  # Stop pressed: the library stopped at its next batch
        run.stopped_at = stop.where
        RUNS.end(run)
        state = f"stopped during {stop.where}"
        with tempfile.TemporaryDirectory(prefix="ghosted-stopped-") as folder:
            yield as_outputs(serve_outputs(session, {
                "status": stopped_status(stop.where, time.perf_counter() - start, report, stages),
                "shown": shown_state(report, state)} | history_outputs(add_run(history, settings, report, state), folder)))
    except GhostedError as err:
        message = page_message(err)
        yield as_outputs({"status": failed_status(message, run.current, report),
                          "shown": shown_state(report, f"failed during {run.current}")})
        raise gr.Error(message, duration=TOAST_SECONDS, print_exception=False) from err
    except Exception as err:  # a bug: keep serving, say so, keep the traceback in the log
        log.exception("run failed")
        message = f"internal error ({type(err).__name__}: {escape(str(err))}); the server log has the traceback"
        yield as_outputs({"status": failed_status(message, run.current, report),
                          "shown": shown_state(report, f"failed during {run.current}")})
        raise gr.Error(message, duration=TOAST_SECONDS) from err
    finally:
        RUNS.end(run)
        if keep is not None:
            SAVED.release(session, keep)  # a save never admitted (failed, stopped, refused) holds nothing


def within_saved_cap(session: str, job: RunRequest, stage: str, following: str | None, report: dict) -> dict:
    """The cap on saved models (`studio.saved`) around this run's save: room made before it is written (from the
    variant's weight bytes the size stage counted), and once written it is kept, or refused with the reason in
    place of its download (the run's other results stay)."""
    if following == "save model":
        gain = report.get("variants", {}).get(job.save_variant, {}).get("gain") or {}
        SAVED.reserve(session, save_estimate(gain.get("weight_bytes", 0), job.export_format))
    elif stage == "save model":
        app = report.get("app", {})
        refusal = app.get("saved_refused") or SAVED.admit(session, app.get("saved_model"))
        if refusal:
            report = report | {"app": app | {"saved_model": None, "saved_folder": None, "saved_refused": refusal}}
    return report


def on_stop(shown: dict | None = None, history: list[dict] | None = None,
            request: gr.Request | None = None) -> Iterator[tuple]:
    """Stop button: the session's runs stop at their next batch; the status says where and what the page shows, and
    the stopped run joins the session history."""
    runs = RUNS.stop(request.session_hash if request else "")
    if not runs:
        yield stopped_before_start(shown), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    run = runs[-1]
    for each in runs:
        each.ended.wait(STOP_WAIT_SECONDS)
    state = f"stopped during {run.stopped_at or run.current}"
    with tempfile.TemporaryDirectory(prefix="ghosted-stopped-") as folder:  # the CSV must outlive the yield only
        kept = serve_outputs(request.session_hash if request else "",
                             history_outputs(add_run(history, run.settings, run.report or {}, state), folder))
        yield (stop_message(run), shown_state(run.report or {}, state), kept["history"], kept["history_table"],
               kept["history_file"])


def stop_message(run: ActiveRun) -> str:
    """What Stop reports about `run`: where it stopped, or that it will stop at its next batch."""
    if run.ended.is_set():
        return stopped_status(run.stopped_at or run.current, run.elapsed(), run.report, run.stages)
    return (f"**Stopping** during {run.current}: the server stops at its next batch or stage "
            f"({run.elapsed():.0f} s into the run); the results below are this run's finished stages.")


def model_note(name: str) -> str:
    """An honest note on what this machine can load, and whether it opens local folders to its users."""
    hub = "reachable" if hub_reachable() else "not reachable from this machine"
    folders = "a local folder or " if guard.local_folders() is not False else ""
    return (f"Embedded models load offline. Type {folders}a Hub id for others (the Hub is {hub}); "
            f"Llama, Mistral, Qwen2/3 and Gemma3 families. {guard.local_folders_note()}")


def on_model_change(name: str, oauth_token: gr.OAuthToken | None = None) -> tuple:
    """Bound the depth slider by the model's block count, reset the depth to a quarter of it, describe the model."""
    try:
        name, _local = guard.model_name(name)
        layers, width = model_shape(name, hub_token(name, oauth_token))
    except GhostedError as err:
        return f"**Cannot use this model:** {page_message(err)}", gr.update(), gr.update()
    except Exception as err:  # an unreadable folder or config: say so, keep serving
        return f"**Cannot read {escape(repr(name))}:** {escape(str(err))}", gr.update(), gr.update()
    depth = default_depth(layers)
    note = (f"{escape(name)}: {layers} decoder blocks (0–{layers - 1}), width {width}; depth reset to {depth} "
            f"(a quarter of the blocks).")
    preset = find_preset(name)
    if preset is not None:
        options = build_options(preset.hub_id, DEFAULTS.criterion, depth, "", list(DEFAULTS.operators),
                                DEFAULTS.calibration, DEFAULTS.samples, DEFAULTS.seqlen, DEFAULTS.seed,
                                list(DEFAULTS.eval_corpora), DEFAULTS.eval_tokens, "", DEFAULTS.new_tokens)
        note += "  \n" + preset_note(preset, options)
    return (note, gr.update(maximum=layers, value=depth, info=depth_info(layers)),
            gr.update(info=f"block indices 0–{layers - 1}, e.g. {max(0, layers - 11)}-{layers - 5}"))


def on_settings_change(model: str, criterion: str, depth: float, manual_blocks: str, operators: list[str],
                       samples: float, seqlen: float, mode: str = "single depth", depths: str = "",
                       oauth_token: gr.OAuthToken | None = None) -> str:
    """Advice on the settings before a run: a deep cut, a cut through the last block, too little calibration."""
    try:
        options = build_options(model, criterion, depth, manual_blocks, operators or ["none"], "mix", samples, seqlen,
                                0, [], 256, "", 4, hub_token=hub_token(model, oauth_token))
        if mode == SWEEP:
            chosen = check_sweep(options, parse_depths(depths or ""), num_blocks(options.model, options.load.hub_token))
            lines = advice_lines(settings_advice(options, chosen))
        else:
            check_options(options)
            lines = advice_lines(settings_advice(options))
    except GhostedError as err:
        return f"⚠ {page_message(err)}"
    except Exception:  # a model that cannot be read is explained by the model note
        return ""
    return "  \n".join(lines)


def on_mode_change(mode: str, criterion: str) -> tuple:
    """Sweep: the depth range instead of one depth, and the sweep's results instead of a single run's. Compare: the
    criteria list instead of one criterion, one depth, and the comparison's map, scores and table."""
    sweep, compare = mode == SWEEP, mode == COMPARE
    single = not sweep and not compare
    return (gr.update(visible=compare or (single and criterion not in ("manual", "none"))), gr.update(visible=sweep),
            gr.update(visible=single), gr.update(visible=sweep), gr.update(visible=compare),
            gr.update(visible=not compare), gr.update(visible=compare))


def rerun_values(values: dict) -> dict:
    """on_run's arguments for "rerun on your text": a comparison whose blocks your text chooses (your text takes
    the calibration role, and keeps the evaluation role if it had it). GhostedError when no text is given."""
    if not (values.get("your_text") or "").strip() and not values.get("your_file"):
        raise GhostedError("paste or upload your text under 'Your text' first: the comparison then reruns with your "
                           "text choosing the blocks")
    use = values.get("text_use", "evaluation")
    return values | {"mode": COMPARE, "text_use": "both" if use in ("evaluation", "both") else "calibration"}


@functools.wraps(on_run)  # the same parameters, so Gradio passes the Run inputs, the request and the progress
def on_rerun_on_your_text(*args, **kwargs) -> Iterator[tuple]:
    """The comparison again, its blocks chosen (and operators fitted) on your text: one click."""
    values = inspect.signature(on_run).bind(*args, **kwargs).arguments
    try:
        values = rerun_values(values)
    except GhostedError as err:
        yield as_outputs({"status": refused_status(page_message(err), values.get("shown"))})
        raise gr.Error(page_message(err), duration=TOAST_SECONDS) from err
    yield from on_run(**values)


def on_history_select(history: list[dict] | None, event: gr.SelectData) -> tuple:
    """A click on a row of the history table: that run's settings back in every widget."""
    row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
    settings = settings_of(history, int(row))
    if settings is None:
        return tuple(gr.skip() for _ in SETTING_NAMES)
    return tuple(gr.update(value=settings[name]) if name in settings else gr.skip() for name in SETTING_NAMES)


def depth_info(layers: int) -> str:
    """The depth slider's help text for a model with `layers` blocks."""
    return f"of {layers} blocks (removing all {layers} is refused)"


def on_criterion_change(criterion: str, mode: str = "single depth") -> tuple:
    """Depth for similarity criteria (one, or a sweep's range), the block picker for manual, neither for none."""
    if mode == COMPARE:
        return gr.update(visible=True), gr.update(visible=False)
    return (gr.update(visible=criterion not in ("manual", "none") and mode != SWEEP),
            gr.update(visible=criterion == "manual"))
