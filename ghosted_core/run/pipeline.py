"""The one entry point the CLI and the app share: load → select → calibrate → fit → evaluate.

`run_stages` is a generator: after each stage it yields the stage's name and the result
so far, so the app can fill its page while later stages run; `run` just drains it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator


from ghosted_core.data import corpora
from ghosted_core.calibration.collect import HeldoutRows, collect_stats, make_batches
from ghosted_core.export.gain import measure_gain
from ghosted_core.evaluation.perplexity import block_drift, perplexity
from ghosted_core.evaluation.generation import generate
from ghosted_core.memory_parts import min_calibration_sequences
from ghosted_core.export.model_card import run_record
from ghosted_core.model.loading import LoadedModel, load_model, max_positions, model_placement, peek_config
from ghosted_core.oom import guard_stages
from ghosted_core.recovery.operators import needs_of
from ghosted_core.selection.choose import select_blocks
from ghosted_core.selection.criteria import get_criterion
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.evaluation.tasks import evaluate_variants
from ghosted_core.data.user_text import USER_CORPUS
from ghosted_core.run.distilling import distill_stage, distilled_variants, train_blocks
from ghosted_core.run.fitting import fit_variants
from ghosted_core.memory import resident_bytes
from ghosted_core.run.options import RunOptions, for_family, memory_plan, planned, selection_request, validate
from ghosted_core.run.result import RunResult

log = logging.getLogger(__name__)

# stages that yield several times while they run (distillation: after the teacher pass and every validation), so
# that a front end can draw them live; every other stage yields once
LIVE_STAGES = ("distill",)


def run_stages(options: RunOptions, loaded: LoadedModel | None = None,
               should_stop: StopCheck = None) -> Iterator[tuple[str, RunResult]]:
    """Run everything `options` asks for, yielding (stage, result so far) after each stage.

    `should_stop` (e.g. `threading.Event().is_set`) is polled before every stage and between the
    batches of perplexity and drift and the variants of generation and tasks; when it returns
    True the generator raises `stopping.RunStopped` naming the stage, and the result yielded last
    holds every stage finished before it. Running out of memory raises a `GhostedError` that
    names the settings to lower, once what the stage held is freed (`oom.guard_stages`).
    """
    return guard_stages(_stages(options, loaded, should_stop), "load model")


def _stages(options: RunOptions, loaded: LoadedModel | None,
            should_stop: StopCheck) -> Iterator[tuple[str, RunResult]]:
    validate(options)
    result = RunResult(options)
    clock = time.perf_counter()

    def done(stage: str) -> tuple[str, RunResult]:
        nonlocal clock
        now = time.perf_counter()
        result.timings[stage] = result.timings.get(stage, 0.0) + now - clock
        clock = now
        return stage, result

    config = loaded.model.config if loaded is not None else peek_config(options.model, options.load.local_folders)
    options, family_notes = for_family(options, config)
    result.options = options
    result.notes += family_notes
    if loaded is None:  # refuse bad depths, and what cannot fit, before loading any weight
        validate(options, config.num_hidden_layers, max_positions(config), config)
    options, plan = planned(options, loaded)
    result.options, result.memory_plan = options, plan
    if loaded is None:
        loaded = load_model(options.model, options.load)
    dense, tokenizer = loaded.model, loaded.tokenizer
    result.model_description = loaded.description
    result.num_layers, result.hidden_size = loaded.num_layers, loaded.hidden_size
    result.tokenizer = tokenizer
    result.bos = corpora.resolve_bos(tokenizer, options.bos).to_json()
    result.models["dense"] = dense
    validate(options, loaded.num_layers, max_positions(dense.config), dense.config)
    yield done("load model")

    check_stop(should_stop, "score blocks")
    spec = get_criterion(options.criterion)
    needs_data = spec.needs_similarity or options.criterion != "none"
    batches = []
    if needs_data:
        batches, result.calibration_tokens = calibration_batches(tokenizer, options)
        result.corpora[options.calibration] = corpus_entry(options, options.calibration, "calibration")
        result.calibration_label = result.corpora[options.calibration]["label"]
        result.notes += calibration_size_notes(result.calibration_tokens, loaded.hidden_size, options)
    plan, sim = select_blocks(dense, options.criterion, selection_request(options, loaded.num_layers), batches, options.quiet)
    result.plan, result.similarity = plan, sim
    yield done("score blocks")

    if plan.removed:
        check_stop(should_stop, "calibrate")
        result.memory_plan = memory_plan(options, dense.config, *model_placement(dense), len(plan.boundaries),
                                         resident=resident_bytes(dense),  # the boundaries it made, as placed
                                         train_blocks=train_blocks(plan, options))
        needs = needs_of(v.operator for v in options.variants)
        kept = HeldoutRows() if options.calibrate.keep_heldout else None  # the held-out rows, from this same pass
        stats = collect_stats(dense, plan.boundaries, batches, options.calibrate, needs, heldout=kept)
        yield done("calibrate")
        check_stop(should_stop, "fit operators")
        fitted = [v for v in options.variants if v.distill is None]  # a distilled variant starts from one of these
        reports, models = fit_variants(dense, plan, fitted, stats, batches, options, kept)
        del stats, kept  # every statistic was released as soon as its fits existed; the rows once measured
        for variant in fitted:
            result.fits[variant.name] = reports[variant.name]
            result.notes += [f"{variant.name}, boundary {r.boundary}: {note}"
                             for r in reports[variant.name] for note in r.notes]
            result.models[variant.name] = models[variant.name]
        yield done("fit operators")
        if distilled_variants(options):
            check_stop(should_stop, "distill")
            for _note in distill_stage(dense, tokenizer, plan, options, result.models, result.distill,
                                       result.calibration_label, should_stop):
                yield done("distill")

    eval_seqlen = options.eval_seqlen or options.seqlen
    first_windows = None
    for corpus in options.eval_corpora:
        windows = corpora.evaluation_windows(tokenizer, options.corpus(corpus, "evaluation"), eval_seqlen,
                                             options.eval_max_tokens, options.bos)
        first_windows = windows if first_windows is None else first_windows
        result.corpora[corpus] = corpus_entry(options, corpus, "evaluation") | window_counts(windows)
        result.perplexity[corpus] = perplexity(dense, result.models, windows, options.eval_batch_size, options.quiet,
                                               desc=f"perplexity {corpus}", should_stop=should_stop)
        yield done("perplexity")
    _record_run(result)

    if plan.removed and first_windows is not None and options.drift_windows > 0:
        pruned = {name: model for name, model in result.models.items() if name != "dense"}
        result.drift = block_drift(dense, pruned, plan, first_windows[: options.drift_windows], options.calibrate,
                                   should_stop=should_stop)
        yield done("drift")

    if options.prompt:
        result.generations = generate(result.models, tokenizer, options.prompt, options.generation, should_stop)
        yield done("generate")

    if options.tasks:  # every variant on the same examples, in one pass per task (the dense prefix shared)
        check_stop(should_stop, "tasks")
        result.tasks = evaluate_variants(dense, result.models, tokenizer, options.tasks, options.task_limit,
                                         options.seed, options.task_batch_size, progress=not options.quiet,
                                         should_stop=should_stop)
        yield done("tasks")

    # last, so that its timings do not slow the other stages' and no other stage's buffers are alive
    check_stop(should_stop, "size and speed")
    result.gain = measure_gain(result.models, options.speed, should_stop, options.quiet)
    yield done("size and speed")


def calibration_size_notes(tokens: int, width: int, options: RunOptions) -> list[str]:
    """A warning (logged and returned for the result) when a least-squares fit gets fewer than 4·C tokens."""
    needs = needs_of(v.operator for v in options.variants)
    if not (needs.residual or needs.branch) or tokens >= 4 * width:
        return []
    wanted = min_calibration_sequences(width, options.seqlen, floor=1)
    note = (f"calibration has {tokens} tokens, fewer than 4·C = {4 * width} for a {width}-wide model: the least-squares "
            f"fits are poorly determined{' (rank-deficient: a relative ridge decides them)' if tokens < width else ''}; "
            f"use --train_size {wanted} or more at --seqlen {options.seqlen}")
    log.warning(note)
    return [note]


def _record_run(result: RunResult) -> None:
    """Add the run's facts (base model, calibration, perplexities) to each variant's `ghosted` record,
    so that an export of the variant can state them in its model card."""
    report = result.to_json()
    for name, model in result.models.items():
        if name != "dense" and getattr(model.config, "ghosted", None) is not None:
            model.config.ghosted.update(run_record(report, name))


def calibration_batches(tokenizer, options: RunOptions) -> tuple[list, int]:
    """The seeded calibration windows of a run as forward-pass batches (fit, then held-out), and the fit token count."""
    fit_ids, heldout_ids = corpora.calibration_windows(tokenizer, options.corpus(options.calibration, "calibration"),
                                                       options.train_size, options.seqlen, options.seed, options.heldout,
                                                       options.bos)
    return make_batches(fit_ids, heldout_ids, options.calibrate.batch_size), int(fit_ids.numel())


def corpus_entry(options: RunOptions, name: str, split: str) -> dict:
    """The results.json record of a corpus: its label, whether it is the paper's own data, whether it is the user's."""
    corpus = corpora.get_corpus(options.corpus(name, split), split)
    return {"label": corpus.label, "real": corpus.real, "user": name == USER_CORPUS}


def window_counts(windows) -> dict:
    """What results.json says about a corpus's perplexity windows: how many, their tokens (a BOS
    per window included, where the rule adds one) and the predictions the perplexity rests on."""
    return {"windows": len(windows), "tokens": int(windows.numel()), "predicted_tokens": corpora.predicted_tokens(windows)}


def run(options: RunOptions, loaded: LoadedModel | None = None) -> RunResult:
    """Run all stages and return the final result."""
    result = None
    for _stage, result in run_stages(options, loaded):
        pass
    return result
