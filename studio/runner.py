"""Widget values → `RunOptions`, and the run itself: `run_job`, the one `@spaces.GPU` unit."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ghosted_core.advice import Advice, calibration_advice, cut_advice
from ghosted_core.calibration import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation import GenerationOptions
from ghosted_core.export import archive_recovered
from ghosted_core.models import EMBEDDED, needs_conversion
from ghosted_core.operators import OPERATORS
from ghosted_core.pipeline import RunOptions, RunResult, parse_variants, run_stages, validate
from ghosted_core.selection import parse_layers
from ghosted_core.stopping import StopCheck, check_stop
from studio.cache import MODELS, model_shape, num_blocks
from studio.settings import DEFAULTS, NO_SAVE, gpu


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
    """The stage names `run_job` will yield, in order (for the progress bar and the status)."""
    prunes = options.criterion != "none"
    stages = ["convert model"] if needs_conversion(options.model) else []
    stages += ["load model", "score blocks"]
    stages += ["calibrate", "fit operators"] if prunes else []
    stages += ["perplexity"] * len(options.eval_corpora)
    stages += ["drift"] if prunes and options.eval_corpora and options.drift_windows else []
    stages += ["generate"] if options.prompt else []
    stages += ["tasks"] * len(("dense", *(v.name for v in options.variants))) if quick.enabled else []
    stages += ["save model"] if save_variant else []
    return stages


def settings_advice(options: RunOptions) -> list[Advice]:
    """What the library's advice says about these settings before anything runs (depth, cut, calibration size)."""
    layers, width = model_shape(options.model)
    removed = options.layers if options.criterion == "manual" else ()
    count = len(removed) if options.criterion == "manual" else options.num_prune if options.criterion != "none" else 0
    advice = cut_advice(layers, count, removed) if count else []
    if options.criterion != "none":
        advice += calibration_advice(options.train_size * options.seqlen, width, [v.name for v in options.variants])
    return advice


# ---------------------------------------------------------------- the run (the @spaces.GPU unit)


def snapshot(result: RunResult, options: RunOptions, timings: dict[str, float]) -> dict:
    """Plain JSON-ready data of the run so far: results.json's layout plus what the page also shows."""
    report = result.to_json()
    tasks = {name: entry["tasks"] for name, entry in report["variants"].items() if "tasks" in entry}
    report["timings"] = {stage: round(seconds, 3) for stage, seconds in timings.items()} | {
        stage: seconds for stage, seconds in report["timings"].items() if stage not in timings}
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
def run_job(options: RunOptions, quick: QuickTasks, save_variant: str | None = None, folder: str | None = None,
            should_stop: StopCheck = None) -> Iterator[tuple[str, dict]]:
    """(Convert →) load → select → calibrate → fit → evaluate (→ tasks) (→ save), yielding (stage, snapshot) after each.

    Refuses bad input before loading any weights. A first use of an embedded model whose GGUF
    was not converted at setup converts it as its own stage. `should_stop` is polled between
    batches and stages (`RunStopped`). Yields only plain data (a saved model is a zip path in
    `folder`), so it can run in a ZeroGPU worker process.
    """
    check_options(options)
    timings: dict[str, float] = {}
    if needs_conversion(options.model):
        start = time.perf_counter()
        MODELS.convert(options.model)  # outside any lock that other users wait on
        timings["convert model"] = time.perf_counter() - start
        yield "convert model", {"model": options.model, "timings": {k: round(v, 3) for k, v in timings.items()},
                                "variants": {}}
    check_stop(should_stop, "load model")
    start = time.perf_counter()
    loaded = MODELS.get(options.model)
    timings["load model"] = time.perf_counter() - start
    if quick.enabled and quick.tasks:
        options = replace(options, tasks=quick.tasks, task_limit=quick.limit)
    result = None
    for stage, result in run_stages(options, loaded, should_stop):
        yield stage, snapshot(result, options, timings)
    if save_variant and folder and result is not None:
        check_stop(should_stop, "save model")
        start = time.perf_counter()
        path = archive_recovered(result.models[save_variant], result.tokenizer,
                                 Path(folder) / f"{safe_name(options.model)}-{save_variant}.zip")
        result.timings["save model"] = time.perf_counter() - start
        report = snapshot(result, options, timings)
        report["app"]["saved_model"] = str(path)
        yield "save model", report


def safe_name(model: str) -> str:
    """A model id or folder as a file-name stem ('org/name' → 'org-name')."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model.strip("/")).strip("-.") or "model"
