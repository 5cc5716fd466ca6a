"""The page: controls on the left, results on the right, and the events that connect them."""

from __future__ import annotations

import logging

import gradio as gr
from starlette.middleware import Middleware

from ghosted_core.data import corpora
from ghosted_core.run.options import SEQUENTIAL_SUFFIX
from ghosted_core.selection.criteria import CRITERIA
from ghosted_core.evaluation.tasks import TASKS
from studio.cache import num_blocks
from ghosted_core.export.folder import EXPORT_MODES
from ghosted_core.export.gguf import GGUF_FORMAT, GGUF_OUTTYPES
from ghosted_core.recovery.operators import OPERATORS
from studio.outputs import INPUT_NAMES, OUTPUT_NAMES, SAVE_HINT, SETTING_NAMES, STATE_NAMES
from studio.handlers import depth_info, model_note, on_criterion_change, on_history_select, on_mode_change, \
    on_model_change, on_rerun_on_your_text, on_run, on_settings_change, on_stop
from studio.admission import RUN_INPUT_COUNT, RUN_QUEUE, check_rerun, check_run, guard_queue, on_submit, \
    on_submit_rerun
from studio.push import on_push, on_space, push_available
from studio.saved import SAVED
from studio.history import history_table
from studio.presets_view import model_choices
from studio.settings import ASSETS, CRITERION_HELP, DEFAULTS, DISTILL_STEPS, DISTILL_TRAIN, EVAL_TOKENS, MAX_SAMPLES, \
    MODES, NEW_TOKENS, NO_SAVE, QUEUE_SIZE, RUN_CONCURRENCY, SEQLENS, TASK_EXAMPLES
from ghosted_core.run.options import DISTILL_CHOICES, OPERATOR_CHOICES
from studio.user_input import USES
from studio.disk import UploadQuota
from studio.doors import Doorkeeper
from studio.sessions import session_capacity, use_lean_sessions
from studio.session_files import DELETE_CACHE, SESSION_FILES
from studio.uploads import SESSION_UPLOADS
from ghosted_core.data.user_text import MAX_BYTES
from studio.speed import default_run_note
from studio.status import NOTHING_SHOWN
from ghosted_core.report.compare import compare_table
from ghosted_core.report.sweep import sweep_table
from studio.outputs import COMPARE_HINT
from ghosted_core.report.tables import empty_perplexity_table

log = logging.getLogger(__name__)


def read_prompts() -> list[str]:
    """Example prompts from assets/prompts.txt, one a line."""
    return [line.strip() for line in (ASSETS / "prompts.txt").read_text().splitlines() if line.strip()]


def corpus_choices(split: str) -> list[tuple[str, str]]:
    """(label, name) pairs from the corpus registry; the label says stand-in or exact."""
    return [(f"{name} — {label}", name) for name, label in corpora.describe(corpora.corpus_names(), split).items()]


# After Run, bring the status panel into view: on a phone the results column sits below every control.
# (The same after Stop: its answer lands in the status.) The inputs pass through unchanged.
SCROLL_TO_STATUS = ("(...inputs) => { document.getElementById('run-progress')?.scrollIntoView({block: 'start', "
                    "behavior: 'smooth'}); return inputs; }")


def method_diagram() -> str:
    """The method in one picture: a wide left-to-right version, and a top-to-bottom one for phones (CSS picks)."""
    return (f"<div class='diagram-wide'>{(ASSETS / 'method.svg').read_text()}</div>"
            f"<div class='diagram-narrow'>{(ASSETS / 'method-narrow.svg').read_text()}</div>")


def build_demo(concurrency: int = RUN_CONCURRENCY) -> gr.Blocks:
    """The page: controls on the left, results filling in on the right (stacked on a phone).

    `concurrency`: runs computing at once (GHOSTED_APP_CONCURRENCY); the others wait in the queue.
    """
    use_lean_sessions()  # deep links are refused (studio.doors): sessions keep no copy for them
    prompts = read_prompts()
    default_layers = num_blocks_or(DEFAULTS.model, 30)
    can_push, push_note = push_available()
    with gr.Blocks(title="Ghosted Layers Studio", delete_cache=DELETE_CACHE) as demo:
        with gr.Row(equal_height=True):
            with gr.Column(scale=2, elem_id="app-header"):
                gr.Markdown(
                    "# Ghosted Layers Studio\n"
                    "Remove decoder blocks from a language model, fit a training-free linear map **W** where they were, "
                    "and see what pruning broke and what each operator gives back: generations, perplexity, "
                    "boundary error, per-block drift and the structure of W. Or **sweep** the depth and see how far "
                    "you can prune, on your own text if you like. Press **Run** to try the defaults.\n\n"
                    f"{default_run_note()}", elem_id="app-intro")
            with gr.Column(scale=3):
                gr.HTML(method_diagram(), elem_id="method-diagram")
        with gr.Row():
            with gr.Column(scale=1, min_width=340, elem_id="controls"):
                with gr.Row(elem_id="run-buttons"):
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-button")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-button")
                run_advice = gr.Markdown("", elem_id="run-advice")
                with gr.Accordion("Model and pruning", open=True):
                    model = gr.Dropdown(model_choices(), value=DEFAULTS.model, allow_custom_value=True, label="Model",
                                        elem_id="model",
                                        info="embedded (offline), a Hub preset, a local folder or any Hub id")
                    model_info = gr.Markdown(model_note(DEFAULTS.model), elem_classes="caption", elem_id="model-info")
                    criterion = gr.Dropdown([(f"{name}: {CRITERION_HELP.get(name, spec.paper)}", name)
                                             for name, spec in CRITERIA.items()],
                                            value=DEFAULTS.criterion, label="Which blocks to remove", elem_id="criterion")
                    compare_criteria = gr.Dropdown(
                        [(f"{name}: {CRITERION_HELP.get(name, spec.paper)}", name) for name, spec in CRITERIA.items()
                         if name not in ("manual", "none")], value=list(DEFAULTS.compare_criteria), multiselect=True,
                        label="Criteria to compare", visible=False, elem_id="compare-criteria",
                        info="each one's blocks, then every operator on every distinct plan (one calibration pass)")
                    mode = gr.Radio(list(MODES), value=DEFAULTS.mode, label="Depth", elem_id="mode",
                                    info="sweep: every depth of a range from one calibration pass; compare criteria: "
                                         "which blocks each criterion removes at one depth, and what each costs")
                    depth = gr.Slider(1, default_layers, value=DEFAULTS.depth, step=1, label="Blocks to remove",
                                      info=depth_info(default_layers), elem_id="depth")
                    depths = gr.Textbox(DEFAULTS.depths, label="Depths to sweep (START:STOP:STEP, STOP included)",
                                        visible=False, elem_id="depths", info="2:10:2 removes 2, 4, 6, 8 and 10 blocks")
                    manual_blocks = gr.Textbox(label="Blocks to remove (manual)", value="19-25", visible=False,
                                               info=f"block indices 0–{default_layers - 1}, e.g. 19-25 or 3,7,12")
                with gr.Accordion("Recovery operators", open=True):
                    operators = gr.Dropdown(OPERATOR_CHOICES, value=list(DEFAULTS.operators), multiselect=True,
                                            label="Operators", elem_id="operators",
                                            info=f"{SEQUENTIAL_SUFFIX}: fit each boundary on the already recovered model")
                with gr.Accordion("Distillation (trains after the fit)", open=False, elem_id="distill-box"):
                    distill_on = gr.Checkbox(DEFAULTS.distill_on, label="Distill after the fit (slow: minutes)",
                                             elem_id="distill-on",
                                             info="KL to the dense model's top-50 next-token distribution on the "
                                                  "calibration corpus; each distilled variant is shown beside its start")
                    distill_steps = gr.Slider(*DISTILL_STEPS, value=DEFAULTS.distill_steps, step=1,
                                              label="Steps per distilled variant", elem_id="distill-steps",
                                              info="2 calibration windows per step; stops early when the held-out KL "
                                                   "stops improving, and keeps its best state")
                    distill_train = gr.Radio([(label, name) for name, label in DISTILL_TRAIN.items()],
                                             value=DEFAULTS.distill_train, label="What trains", elem_id="distill-train")
                with gr.Accordion("Your text", open=False, elem_id="your-text-box"):
                    your_text = gr.Textbox(label="Paste text", lines=4, max_lines=12, elem_id="your-text",
                                           placeholder="or upload a file below; left empty, the built-in corpora apply")
                    your_file = gr.File(label="Upload .txt, or .jsonl with a \"text\" field per line (up to 5 MB)",
                                        file_types=[".txt", ".jsonl"], type="filepath", elem_id="your-file")
                    text_use = gr.Radio(list(USES), value=DEFAULTS.text_use, label="Use your text for",
                                        info="labelled 'your text' everywhere; an upload is read once, kept in "
                                             "memory for your session only, and its file deleted")
                with gr.Accordion("Calibration", open=False):
                    calibration = gr.Dropdown(corpus_choices("calibration"), value=DEFAULTS.calibration,
                                              label="Calibration corpus")
                    samples = gr.Slider(1, MAX_SAMPLES, value=DEFAULTS.samples, step=1, label="Sequences",
                                        info="the paper: 128", elem_id="samples")
                    seqlen = gr.Dropdown(list(SEQLENS), value=DEFAULTS.seqlen, label="Sequence length (tokens)",
                                         info="also the perplexity window; the paper: 2048")
                    seed = gr.Number(DEFAULTS.seed, precision=0, label="Seed")
                with gr.Accordion("Evaluation", open=False, elem_id="evaluation-box"):
                    eval_corpora = gr.CheckboxGroup(corpus_choices("evaluation"), value=list(DEFAULTS.eval_corpora),
                                                    label="Perplexity corpora")
                    eval_tokens = gr.Slider(*EVAL_TOKENS, value=DEFAULTS.eval_tokens, step=256,
                                            label="Perplexity tokens per corpus", elem_id="eval-tokens")
                    speed_on = gr.Checkbox(DEFAULTS.speed_on, label="Measure each variant's speed against dense",
                                           elem_id="speed-on",
                                           info="prefill and decode in transformers, batch 1, median of 3 rounds "
                                                "(seconds per variant); sizes are always shown")
                with gr.Accordion("Generation", open=True):
                    prompt = gr.Textbox(prompts[0], label="Prompt", lines=2)
                    gr.Examples([[p] for p in prompts], inputs=[prompt], label="Example prompts")
                    new_tokens = gr.Slider(*NEW_TOKENS, value=DEFAULTS.new_tokens, step=4, label="New tokens")
                with gr.Accordion("Quick zero-shot tasks", open=False):
                    tasks_on = gr.Checkbox(False, label="Score every variant on quick tasks (slow: minutes)")
                    task_names = gr.CheckboxGroup(list(TASKS), value=list(DEFAULTS.tasks), label="Tasks")
                    task_examples = gr.Slider(*TASK_EXAMPLES, value=DEFAULTS.task_examples, step=5,
                                              label="Examples per task (seeded subset)")
                with gr.Accordion("Save a recovered model", open=False, elem_id="save-box"):
                    save_variant = gr.Dropdown([NO_SAVE] + OPERATOR_CHOICES + DISTILL_CHOICES, value=DEFAULTS.save_variant,
                                               label="Variant to download", elem_id="save-variant",
                                               info="must be one of the operators above (SmolLM2: about 0.4 GB)")
                    export_format = gr.Radio([*EXPORT_MODES, GGUF_FORMAT], value=DEFAULTS.export_format,
                                             label="Format", elem_id="export-format",
                                             info="stock: a plain Hugging Face model ("
                                                  + ", ".join(n for n, spec in OPERATORS.items() if spec.stock)
                                                  + " fold into it); remote_code: loads with "
                                                  "trust_remote_code=True; auto: stock where the variant folds; "
                                                  "gguf: stock, converted for llama.cpp by its own converter")
                    gguf_type = gr.CheckboxGroup(list(GGUF_OUTTYPES), value=list(DEFAULTS.gguf_type),
                                                 label="GGUF types", elem_id="gguf-type",
                                                 info="for the gguf format, one file each: f16 (2 bytes per weight), "
                                                      "q8_0 (about half), q6_k, q5_k_m, q4_k_m (about 30%)")
                    gguf_imatrix = gr.Checkbox(DEFAULTS.gguf_imatrix, label="Importance matrix for the k-quants",
                                               elem_id="gguf-imatrix",
                                               info="llama-imatrix on the run's calibration text (q4_k_m, q5_k_m, "
                                                    "q6_k); about one forward pass over 16k tokens")
                    model_file = gr.File(label="Recovered model (zip, the .gguf, or a zip of the .gguf files)",
                                         elem_id="model-file",
                                         interactive=False)
                    save_note_md = gr.Markdown(SAVE_HINT, elem_classes="caption", elem_id="save-note")
                    gr.Markdown(push_note, elem_classes="caption", elem_id="push-note")
                    if on_space() and can_push:  # OAuth exists only on a Space (see studio.push)
                        gr.LoginButton(elem_id="login-button")
                    repo_id = gr.Textbox(label="New Hub repo (name, or org/name)", interactive=can_push,
                                         elem_id="push-repo")
                    private = gr.Checkbox(False, label="Make it a private repo", interactive=can_push,
                                          elem_id="push-private")
                    token = gr.Textbox(label="Hugging Face write token", type="password", elem_id="push-token",
                                       interactive=can_push, visible=not on_space())
                    push_btn = gr.Button("Push to the Hub", interactive=can_push, elem_id="push-button")
                    push_result = gr.Markdown("", elem_classes="caption", elem_id="push-result")
            with gr.Column(scale=2):
                progress_slot = gr.HTML("", elem_id="run-progress")  # the progress bar, so it never covers the status
                status = gr.Markdown("Press **Run** to start.", elem_id="status")
                with gr.Column(visible=True) as single_box:
                    gr.Markdown("### Generations", elem_classes="section-title")
                    generations = gr.HTML("<p class='gen-empty'>Generations appear here once the generate stage has "
                                          "run.</p>", elem_id="generations")
                    gr.Markdown("### Perplexity", elem_classes="section-title")
                    ppl_caption = gr.Markdown("", elem_classes="caption")
                    ppl_table = gr.Dataframe(empty_perplexity_table(), label="Perplexity by corpus and variant",
                                             interactive=False, elem_id="ppl-table", show_label=False, wrap=True)
                    gr.Markdown("### What it buys", elem_classes="section-title")
                    tradeoff_plot = gr.Plot(label="Trade-off", elem_id="plot-tradeoff", show_label=False)
                    gr.Markdown("### Charts", elem_classes="section-title")
                    scores_plot = gr.Plot(label="Criterion scores", elem_id="plot-scores", show_label=False)
                    errors_plot = gr.Plot(label="Boundary error", elem_id="plot-errors", show_label=False)
                    drift_plot = gr.Plot(label="Per-block drift", elem_id="plot-drift", show_label=False)
                    structure_plot = gr.Plot(label="Operator structure", elem_id="plot-structure", show_label=False)
                    distill_plot = gr.Plot(label="Distillation", elem_id="plot-distill", show_label=False)
                    with gr.Column(visible=False) as tasks_box:
                        gr.Markdown("### Quick tasks", elem_classes="section-title")
                        tasks_caption_md = gr.Markdown("Quick tasks run after the other stages when enabled.",
                                                       elem_classes="caption")
                        tasks_table_df = gr.Dataframe(interactive=False, show_label=False, elem_id="tasks-table")
                        tasks_plot = gr.Plot(show_label=False, elem_id="plot-tasks")
                with gr.Column(visible=False) as sweep_box:
                    gr.Markdown("### Depth sweep", elem_classes="section-title")
                    sweep_caption_md = gr.Markdown("A sweep's curve and table appear here depth by depth.",
                                                   elem_classes="caption")
                    curve_plot = gr.Plot(show_label=False, elem_id="plot-curve")
                    recovered_plot = gr.Plot(show_label=False, elem_id="plot-recovered")
                    sweep_tradeoff_plot = gr.Plot(show_label=False, elem_id="plot-sweep-tradeoff")
                    sweep_table_df = gr.Dataframe(sweep_table({}), interactive=False, show_label=False,
                                                  elem_id="sweep-table", wrap=True)
                with gr.Column(visible=False) as compare_box:
                    gr.Markdown("### Which blocks? Criteria compared", elem_classes="section-title")
                    compare_caption_md = gr.Markdown(COMPARE_HINT, elem_classes="caption", elem_id="compare-caption")
                    rerun_btn = gr.Button("Rerun this comparison on your text (it chooses the blocks)",
                                          elem_id="rerun-your-text", size="sm")
                    map_plot = gr.Plot(show_label=False, elem_id="plot-map")
                    criterion_scores_plot = gr.Plot(show_label=False, elem_id="plot-criterion-scores")
                    compare_table_df = gr.Dataframe(compare_table({}), interactive=False, show_label=False,
                                                    elem_id="compare-table", wrap=True)
                results_file = gr.File(label="results.json", elem_id="results-file", interactive=False)
                with gr.Accordion("Runs in this session", open=False, elem_id="history-box"):
                    gr.Markdown("Every run of this browser tab (gone when you close it). Click a row to put that "
                                "run's settings back.", elem_classes="caption")
                    history_df = gr.Dataframe(history_table([]), interactive=False, show_label=False,
                                              elem_id="history-table", wrap=True)
                    history_file = gr.File(label="history (CSV)", interactive=False, elem_id="history-file")

        submitted = gr.State(None)  # when Run was pressed (server clock): queueing counts apart from running
        shown = gr.State(NOTHING_SHOWN)  # which run the results on the page belong to
        history = gr.State([])  # the runs of this session

        widgets = {"model": model, "criterion": criterion, "depth": depth, "manual_blocks": manual_blocks,
                   "operators": operators, "calibration": calibration, "samples": samples, "seqlen": seqlen,
                   "seed": seed, "eval_corpora": eval_corpora, "eval_tokens": eval_tokens, "prompt": prompt,
                   "new_tokens": new_tokens, "tasks_on": tasks_on, "task_names": task_names,
                   "task_examples": task_examples, "save_variant": save_variant, "export_format": export_format,
                   "gguf_type": gguf_type,
                   "mode": mode, "depths": depths, "your_text": your_text, "your_file": your_file, "text_use": text_use,
                   "compare_criteria": compare_criteria, "distill_on": distill_on, "distill_steps": distill_steps,
                   "distill_train": distill_train, "gguf_imatrix": gguf_imatrix, "speed_on": speed_on}
        components = {"status": status, "generations": generations, "ppl_caption": ppl_caption, "ppl_table": ppl_table,
                      "scores": scores_plot, "errors": errors_plot, "drift": drift_plot, "structure": structure_plot,
                      "tasks_caption": tasks_caption_md, "tasks_table": tasks_table_df, "tasks_plot": tasks_plot,
                      "results_file": results_file, "model_file": model_file, "save_note": save_note_md,
                      "sweep_caption": sweep_caption_md, "curve": curve_plot, "recovered": recovered_plot,
                      "sweep_table": sweep_table_df, "history_table": history_df, "history_file": history_file,
                      "compare_caption": compare_caption_md, "similarity_map": map_plot,
                      "criterion_scores": criterion_scores_plot, "compare_table": compare_table_df,
                      "distill_plot": distill_plot, "tradeoff": tradeoff_plot, "sweep_tradeoff": sweep_tradeoff_plot,
                      "shown": shown, "history": history}
        inputs = [widgets[name] for name in INPUT_NAMES]
        outputs = [components[name] for name in (*OUTPUT_NAMES, *STATE_NAMES)]
        run_inputs = [*inputs, submitted, shown, history]
        assert len(run_inputs) == RUN_INPUT_COUNT  # what the run events' validator answers for
        submit = run_btn.click(on_submit, run_inputs, [submitted, status], queue=False, js=SCROLL_TO_STATUS,
                               api_visibility="private")
        run_event = submit.then(on_run, run_inputs, outputs, api_name="run", validator=check_run,
                                concurrency_limit=concurrency, concurrency_id=RUN_QUEUE,
                                show_progress_on=[progress_slot])
        stop_btn.click(on_stop, [shown, history], [status, shown, history, history_df, history_file],
                       cancels=[run_event], api_name="stop", concurrency_limit=None, show_progress="hidden",
                       js=SCROLL_TO_STATUS)
        model.change(on_model_change, [model], [model_info, depth, manual_blocks], api_name="model_info",
                     concurrency_limit=None)
        criterion.change(on_criterion_change, [criterion, mode], [depth, manual_blocks], api_visibility="private",
                         concurrency_limit=None)
        mode.change(on_mode_change, [mode, criterion], [depth, depths, single_box, sweep_box, compare_box, criterion,
                                                        compare_criteria],
                    api_visibility="private", concurrency_limit=None)
        rerun = rerun_btn.click(on_submit_rerun, run_inputs, [submitted, status], queue=False, js=SCROLL_TO_STATUS,
                                api_visibility="private")
        rerun.then(on_rerun_on_your_text, run_inputs, outputs, api_name="rerun_on_your_text", validator=check_rerun,
                   concurrency_limit=concurrency, concurrency_id=RUN_QUEUE, show_progress_on=[progress_slot])
        settings = [model, criterion, depth, manual_blocks, operators, samples, seqlen, mode, depths]
        for widget in settings:
            widget.change(on_settings_change, settings, run_advice, api_name="check" if widget is model else None,
                          api_visibility="public" if widget is model else "private", concurrency_limit=None,
                          show_progress="hidden")
        tasks_on.change(lambda on: gr.update(visible=on), tasks_on, tasks_box, api_visibility="private")
        history_df.select(on_history_select, [history], [widgets[name] for name in SETTING_NAMES],
                          api_visibility="private", concurrency_limit=None)
        push_btn.click(on_push, [repo_id, private, token], [push_result, token], api_name="push",
                       concurrency_limit=None)
        your_file.upload(on_upload, your_file, None, api_visibility="private", queue=False)
        demo.unload(on_session_end)  # a closed tab: the files served to it, and its saved model, go
    # api_open=False: a queued event (a run) is reached through the queue only, never run directly by
    # /gradio_api/run/<name> (Gradio opens that route to queued events off a Space), so no request skips admission
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=concurrency, api_open=False)
    guard_queue(demo._queue)  # a place in the queue is checked and claimed under one lock
    return demo


def num_blocks_or(name: str, fallback: int) -> int:
    """Block count of `name`, or `fallback` when it cannot be read at start-up (e.g. assets not set up yet)."""
    try:
        return num_blocks(name)
    except Exception as err:  # start-up must not fail on a missing asset; the run says what is wrong
        log.warning("cannot read the block count of %s: %s", name, err)
        return fallback


def on_session_end(request: gr.Request) -> None:
    """Gradio's unload event: the session's tab is closed (its heartbeat stream ended)."""
    SESSION_FILES.end(request.session_hash)
    SESSION_UPLOADS.end(request.session_hash)
    SAVED.forget(request.session_hash)


def on_upload(path: str | None, request: gr.Request) -> None:
    """A file uploaded on the page: the session claims it, so that another visitor's run of the same content
    (one path: Gradio names uploads by content) cannot remove it before this session reads it."""
    SESSION_UPLOADS.claim(request.session_hash, path)


def launch_options() -> dict:
    """Theme and CSS, which Gradio 6 takes at launch; the server's upload limit (enforced by the server, whatever
    the page says: a larger upload is refused before it is stored); errors that Gradio itself raises before a
    handler runs (a file path that was never uploaded, a malformed value) answered with their message, not a bare
    "Error" (the handlers turn every error of their own into a gr.Error message); and the routes a stranger may use
    (`studio.doors`: the page's and its API's only), then the upload quotas (`studio.disk`); the sessions Gradio
    keeps, from the memory given them (`studio.sessions`)."""
    return {"theme": gr.themes.Soft(primary_hue="indigo", neutral_hue="slate"),
            "css_paths": [ASSETS / "app.css"], "max_file_size": MAX_BYTES, "show_error": True,
            "state_session_capacity": session_capacity(),
            "app_kwargs": {"middleware": [Middleware(Doorkeeper), Middleware(UploadQuota)]}}


