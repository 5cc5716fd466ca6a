"""Widget values → a checked `RunRequest`, and the runs themselves: `run_job` and `run_sweep_job`, each one `@spaces.GPU` call."""

from __future__ import annotations

import shutil
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PretrainedConfig

from ghosted_core.planning.advice import Advice, calibration_advice, cut_advice
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.planning.estimate import check_work_budget, zerogpu
from ghosted_core.evaluation.generation import GenerationOptions
from ghosted_core.export.folder import archive_export, check_export, export_variant, zip_export
from ghosted_core.export.gain import SpeedOptions, variant_size
from ghosted_core.export.gguf import GGUF_FORMAT, GGUFExport, GGUFOptions, export_gguf, find_llamacpp, parse_gguf_types
from ghosted_core.model.embedded import needs_conversion
from ghosted_core.model.loading import LoadedModel, LoadOptions, peek_config
from ghosted_core.plan import MAX_BLOCKS
from ghosted_core.progress import ProgressEvent, staged
from ghosted_core.recovery.operators import OPERATORS
from ghosted_core.recovery.assessment import Diagnostics
from ghosted_core.distill.options import DistillOptions
from ghosted_core.run.options import SEED_LIMIT, RunOptions, distilled, gguf_options, parse_variants, validate
from ghosted_core.run.result import RunResult
from ghosted_core.run.pipeline import run_stages
from ghosted_core.planning.presets import check_preset, gpu_seconds
from ghosted_core.selection.criteria import parse_layers
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.run.sweep import check_sweep, parse_depths, sweep_stages
from ghosted_core.run.sweep import planned_stages as sweep_planned
from studio.cache import MODELS, model_shape, num_blocks
from studio.presets_view import device, find_preset
from studio.saved import save_estimate, too_big
from ghosted_core.run.compare import check_compare, compare_stages
from ghosted_core.run.compare import planned_stages as compare_planned
from studio import guard
from studio.settings import COMPARE, DEFAULTS, DISTILL_STEPS, DISTILL_TRAIN, EVAL_TOKENS, MAX_SAMPLES, NEW_TOKENS, \
    NO_SAVE, RUN_BUDGET_ENV, SEQLENS, SWEEP, gpu_compare, gpu_run, gpu_sweep, run_budget_seconds


@dataclass(frozen=True)
class QuickTasks:
    """Zero-shot tasks to score every variant on after the run (off by default: they take minutes)."""

    enabled: bool = False
    tasks: tuple[str, ...] = ()
    limit: int = DEFAULTS.task_examples  # examples per task, a seeded subset (the run's seed)


def distill_variants(operators: Sequence[str], on: bool, train: str) -> list[str]:
    """The variants the Distillation widgets add to the chosen operators (none when off)."""
    if not guard.flag(on, "Distill after the fit"):
        return []
    train = guard.choice(train, "What trains", tuple(DISTILL_TRAIN))
    names = [name for name in operators if "+kd" not in name]
    chosen = distilled(names, names) if train in ("operator", "both") else []
    if train in ("stock", "both"):
        chosen += [f"{name}+kd_mlp" for name in names]
    return list(dict.fromkeys(chosen))


def build_options(model: str, criterion: str, depth: float, manual_blocks: str, operators: Sequence[str],
                  calibration: str, samples: float, seqlen: float | str, seed: float, eval_corpora: Sequence[str],
                  eval_tokens: float, prompt: str, new_tokens: float, distill_on: bool = False,
                  distill_steps: float = DEFAULTS.distill_steps, distill_train: str = DEFAULTS.distill_train,
                  hub_token: str | bool | None = False, speed_on: bool = DEFAULTS.speed_on) -> RunOptions:
    """The library's options from the widgets' values; GhostedError on input no run could use. `hub_token`: the
    Hub access of the request (`studio.access.hub_token`; anonymous unless given).

    Every value is held to the type and the largest value its widget offers (`studio.guard`): the API takes any
    JSON, and the upper bounds bound what one request may cost the server.
    """
    model, local = guard.model_name(model)
    operators = guard.names(operators, "Operators")
    if not operators:
        raise GhostedError(f"choose at least one recovery operator ({', '.join(OPERATORS)})")
    manual_blocks = guard.text(manual_blocks, "Blocks to remove (manual)", 5 * guard.FIELD_CHARS)
    layers = parse_layers(manual_blocks) if criterion == "manual" else ()
    if criterion == "manual" and not layers:
        raise GhostedError("the manual criterion needs the blocks to remove, e.g. 19-25 or 3,7,12")
    seed = guard.whole(seed, "Seed", 0, SEED_LIMIT - 1)
    return RunOptions(
        model=model,
        load=LoadOptions(local_folders=local, hub_token=hub_token),
        criterion=criterion,
        num_prune=guard.whole(depth, "Blocks to remove", 1, MAX_BLOCKS - 1),
        layers=layers,
        variants=parse_variants([*operators, *distill_variants(operators, distill_on, distill_train)]),
        distill=DistillOptions(steps=guard.whole(distill_steps, "Distillation steps", *DISTILL_STEPS)),
        calibration=calibration,
        train_size=guard.whole(samples, "Sequences", 1, MAX_SAMPLES),
        seqlen=guard.whole(seqlen, "Sequence length", 2, max(SEQLENS)),
        seed=seed,
        eval_corpora=guard.names(eval_corpora, "Perplexity corpora"),
        eval_max_tokens=guard.whole(eval_tokens, "Perplexity tokens per corpus", 1, EVAL_TOKENS[1]),
        drift_windows=DEFAULTS.drift_windows,
        prompt=guard.text(prompt, "Prompt", guard.PROMPT_CHARS).strip() or None,
        generation=GenerationOptions(max_new_tokens=guard.whole(new_tokens, "New tokens", 1, NEW_TOKENS[1]), seed=seed),
        speed=SpeedOptions(measure=guard.flag(speed_on, "Measure speed")),
        calibrate=CalibrationOptions(quiet=False),
        diagnostics=Diagnostics(fit_errors=False, singular_values=True),  # the structure chart shows them
    )


def check_options(options: RunOptions) -> None:
    """The library's checks of `options` against the model's block count, before any weights load."""
    validate(options, num_blocks(options.model, options.load.hub_token))


def check_save(options: RunOptions, save_variant: str, export_format: str = "auto") -> str | None:
    """The variant to save as a download, None for none; it must be one the run builds, in a format it can have."""
    if not save_variant or save_variant == NO_SAVE:
        return None
    built = [v.name for v in options.variants] if options.criterion != "none" else []
    if save_variant not in built:
        raise GhostedError(f"cannot save {save_variant!r}: it is not among this run's variants "
                           f"({', '.join(built) or 'none: nothing is pruned'}); add it to 'Operators' or choose {NO_SAVE!r}")
    operator = next(v.operator for v in options.variants if v.name == save_variant)
    check_export([operator], "stock" if export_format == GGUF_FORMAT else export_format,
                 config=peek_config(options.model, options.load.local_folders, options.load.hub_token))
    if export_format == GGUF_FORMAT:
        find_llamacpp()  # a missing build is refused before the run, not after it
    return save_variant


def conversion_stage(model: str) -> list[str]:
    """["convert model"] while the embedded model's GGUF is not converted yet (a first use converts it as its own
    stage), else nothing."""
    return ["convert model"] if needs_conversion(model) else []


def planned_stages(options: RunOptions, quick: QuickTasks, save_variant: str | None = None) -> list[str]:
    """The stage names `run_job` will yield, in order (for the progress bar and the status)."""
    prunes = options.criterion != "none"
    stages = conversion_stage(options.model) + ["load model", "score blocks"]
    stages += ["calibrate", "fit operators"] if prunes else []
    stages += ["distill"] if prunes and any(v.distill for v in options.variants) else []
    stages += ["perplexity"] * len(options.eval_corpora)
    stages += ["drift"] if prunes and options.eval_corpora and options.drift_windows else []
    stages += ["generate"] if options.prompt else []
    stages += ["tasks"] if quick.enabled else []  # one pass answers every variant
    stages += ["size and speed"]
    stages += ["save model"] if save_variant else []
    return stages


def settings_advice(options: RunOptions, depths: tuple[int, ...] = ()) -> list[Advice]:
    """What the library's advice says about these settings before anything runs (depth, cut, calibration size)."""
    layers, width = model_shape(options.model, options.load.hub_token)
    removed = options.layers if options.criterion == "manual" else ()
    deepest = max(depths, default=options.num_prune)
    count = len(removed) if options.criterion == "manual" else deepest if options.criterion != "none" else 0
    advice = cut_advice(layers, count, removed) if count else []
    if options.criterion != "none":
        advice += calibration_advice(options.train_size * options.seqlen, width, [v.name for v in options.variants])
    return advice


@dataclass(frozen=True)
class RunRequest:
    """Everything one press of Run asks for, checked: a single-depth run or a depth sweep."""

    options: RunOptions
    quick: QuickTasks = QuickTasks()
    save_variant: str | None = None
    export_format: str = "auto"  # auto, stock, remote_code or gguf (stock plus its GGUF)
    gguf_type: tuple[str, ...] = ("f16",)  # GGUF types (any of GGUF_OUTTYPES)
    gguf_imatrix: bool = False  # k-quants with an importance matrix from the run's calibration text
    depths: tuple[int, ...] = ()  # a sweep's depths; empty for a single-depth run
    notes: tuple[str, ...] = ()  # settings the request set aside, said in the status
    criteria: tuple[str, ...] = ()  # a comparison's criteria; empty otherwise

    @property
    def sweep(self) -> bool:
        return bool(self.depths)

    @property
    def compare(self) -> bool:
        return bool(self.criteria)

    def stages(self) -> list[str]:
        if self.sweep:
            return conversion_stage(self.options.model) + sweep_planned(self.depths)
        if self.compare:
            return conversion_stage(self.options.model) + compare_planned(self.criteria)
        return planned_stages(self.options, self.quick, self.save_variant)

    def advice(self) -> list[Advice]:
        return settings_advice(self.options, self.depths)


def build_request(options: RunOptions, quick: QuickTasks, save_variant: str, export_format: str, mode: str,
                  depths_text: str, criteria: Sequence[str] = (), gguf_type: Sequence[str] = ("f16",),
                  gguf_imatrix: bool = False) -> RunRequest:
    """A checked request from the options and the mode widgets; GhostedError for anything no run could do."""
    if mode == COMPARE:
        notes = _set_aside(options, quick, save_variant, "a comparison")
        options = replace(without_distillation(options), prompt=None, tasks=(), layers=())
        chosen = check_compare(options, [c for c in criteria or () if c not in ("manual", "none")],
                               num_blocks(options.model, options.load.hub_token))
        request = RunRequest(options, notes=tuple(notes), criteria=chosen)
    elif mode == SWEEP:
        depths = parse_depths(guard.text(depths_text, "Depths to sweep", guard.FIELD_CHARS))
        notes = _set_aside(options, quick, save_variant, "a sweep")
        options = replace(without_distillation(options), prompt=None, tasks=())
        layers = num_blocks(options.model, options.load.hub_token)
        request = RunRequest(options, depths=check_sweep(options, depths, layers), notes=tuple(notes))
    else:
        if quick.enabled and not quick.tasks:
            raise GhostedError("quick tasks are on but none is selected; pick at least one task or switch them off")
        check_options(options)
        save = check_save(options, save_variant, export_format)
        types = parse_gguf_types(gguf_type) if save and export_format == GGUF_FORMAT else ("f16",)  # before any load
        request = RunRequest(options, quick, save, export_format, types, gguf_imatrix)
    preset = find_preset(options.model)
    if preset is not None:  # offline, gated without a token or too big: refused before anything downloads
        check_preset(preset.hub_id, options, device(), request.depths or None, preset_token(options.load.hub_token))
    if zerogpu():
        gpu_seconds(options, request.depths or None)  # refuses a run longer than a ZeroGPU call may hold
    budget = run_budget_seconds()
    if budget:
        check_work_budget(run_config(options), options, device(), budget, request.depths or None,
                          runs=max(1, len(request.criteria)), setting=f"{RUN_BUDGET_ENV}={budget:g} s")
    return request


def run_config(options: RunOptions) -> PretrainedConfig:
    """The config of the run's model, with the request's Hub access (a preset's written-down numbers: no download)."""
    preset = find_preset(options.model)
    if preset is not None:
        return preset.config()
    return peek_config(options.model, options.load.local_folders, options.load.hub_token)


def preset_token(token: str | bool | None) -> str | None:
    """The token a preset's gating check sees: the server's (None) where the operator lends it, else the visitor's
    own or none ("")."""
    return None if token is None else token or ""


def _set_aside(options: RunOptions, quick: QuickTasks, save_variant: str, what: str) -> list[str]:
    """What a sweep or a comparison leaves out of the settings, said in the status."""
    notes = []
    if options.prompt or quick.enabled:
        notes.append(f"{what} reports perplexity and boundary errors: the prompt and quick tasks apply to "
                     "single-depth runs")
    if save_variant and save_variant != NO_SAVE:
        notes.append(f"{what} saves no model: save one from a single-depth run")
    if any(v.distill for v in options.variants):
        notes.append(f"{what} fits the training-free operators only: distillation runs in single-depth runs")
    return notes


def without_distillation(options: RunOptions) -> RunOptions:
    return replace(options, variants=tuple(v for v in options.variants if v.distill is None))


# ---------------------------------------------------------------- the run (the @spaces.GPU unit)


def with_app_timings(library: dict[str, float], app: dict[str, float]) -> dict[str, float]:
    """A report's stage times: the app's own (convert, load) first, then the library's stages."""
    return {stage: round(seconds, 3) for stage, seconds in app.items()} | {
        stage: seconds for stage, seconds in library.items() if stage not in app}


def load_stages(model: str, timings: dict[str, float], should_stop: StopCheck = None,
                token: str | bool | None = False) -> Generator[tuple[str, dict], None, LoadedModel]:
    """(Convert →) load `model` from the shared cache, each step timed into `timings`.

    Yields the convert stage's snapshot when a first use converts the GGUF (outside any lock other
    users wait on); returns the loaded model.
    """
    if needs_conversion(model):
        start = time.perf_counter()
        MODELS.convert(model)
        timings["convert model"] = time.perf_counter() - start
        yield "convert model", {"model": model, "timings": with_app_timings({}, timings), "variants": {}}
    check_stop(should_stop, "load model")
    start = time.perf_counter()
    loaded = MODELS.get(model, token)
    timings["load model"] = time.perf_counter() - start
    return loaded


def snapshot(result: RunResult, options: RunOptions, timings: dict[str, float]) -> dict:
    """Plain JSON-ready data of the run so far: results.json's layout plus what the page also shows."""
    report = result.to_json()
    tasks = {name: entry["tasks"] for name, entry in report["variants"].items() if "tasks" in entry}
    report["timings"] = with_app_timings(report["timings"], timings)
    report["app"] = {
        "drift_corpus": options.eval_corpora[0] if options.eval_corpora else None,
        "drift_windows": options.drift_windows,
        "max_new_tokens": options.generation.max_new_tokens,
        "generation_seed": options.generation.seed,
    }
    if tasks:
        report["tasks"] = tasks
    return report


@gpu_run
def run_job(options: RunOptions, quick: QuickTasks, save_variant: str | None = None, folder: str | None = None,
            should_stop: StopCheck = None, export_format: str = "auto", gguf_type: Sequence[str] = ("f16",),
            keep: str | None = None, gguf_imatrix: bool = False,
            saved_cap: int | None = None) -> Iterator[tuple[str, dict | ProgressEvent]]:
    """(Convert →) load → select → calibrate → fit → evaluate (→ tasks) (→ save), yielding (stage, snapshot) after each,
    and (PROGRESS, event) while a stage's loop runs (`progress.staged`: the run computes in a worker thread).

    Refuses bad input before loading any weights. A first use of an embedded model whose GGUF
    was not converted at setup converts it as its own stage. `should_stop` is polled between
    batches and stages (`RunStopped`). Yields only plain data (a saved model is a path: its zip or
    GGUF in `folder`, its export folder in `keep` for the Hub push), so it can run in a ZeroGPU
    worker process. A save estimated over `saved_cap` bytes (`studio.saved`) is refused before it is written.
    """
    yield from staged(lambda _sink: _run(options, quick, save_variant, folder, should_stop, export_format, gguf_type,
                                         keep, gguf_imatrix, saved_cap))  # a generator function, as spaces.GPU wants


def _run(options: RunOptions, quick: QuickTasks, save_variant: str | None, folder: str | None, should_stop: StopCheck,
         export_format: str, gguf_type: Sequence[str], keep: str | None,
         gguf_imatrix: bool, saved_cap: int | None = None) -> Iterator[tuple[str, dict]]:
    check_options(options)
    timings: dict[str, float] = {}
    loaded = yield from load_stages(options.model, timings, should_stop, options.load.hub_token)
    if quick.enabled and quick.tasks:
        options = replace(options, tasks=quick.tasks, task_limit=quick.limit)
    result = None
    for stage, result in run_stages(options, loaded, should_stop):
        yield stage, snapshot(result, options, timings)
    if save_variant and folder and result is not None:
        check_stop(should_stop, "save model")
        start = time.perf_counter()
        saved = save_model(result.models[save_variant], result.tokenizer, options.model, save_variant, Path(folder),
                           export_format, gguf_type, Path(keep) if keep else None,
                           gguf_options(options, gguf_imatrix) if export_format == GGUF_FORMAT else None, saved_cap)
        result.timings["save model"] = time.perf_counter() - start
        report = snapshot(result, options, timings)
        report["app"] |= saved
        yield "save model", report


def save_model(model, tokenizer, model_name: str, variant: str, folder: Path, export_format: str,
               gguf_type: Sequence[str], keep: Path | None, gguf: GGUFOptions | None = None,
               cap: int | None = None) -> dict:
    """Export one variant for the page: into `keep` (the session's push folder) when given, the download (its zip,
    or for the gguf format its GGUF, or a zip of its GGUF files when several) in `folder`. Returns the report's
    "app" fields about it; with nothing written and the reason in "saved_refused" when its weights alone
    (`variant_size`, counted without reading them) put it over `cap` bytes of saved models."""
    stem = f"{safe_name(model_name)}-{safe_name(variant)}"
    if cap is not None and (need := save_estimate(variant_size(model).weight_bytes, export_format)) > cap:
        return {"saved_model": None, "saved_variant": variant, "saved_refused": too_big(need, cap)}
    try:
        if export_format == GGUF_FORMAT:
            saved = export_gguf(model, tokenizer, (keep or folder) / stem, gguf_type, gguf or GGUFOptions())
            download = saved.gguf if len(saved.ggufs) == 1 else zip_export(saved.folder, folder / f"{stem}-gguf.zip",
                                                                          suffix=".gguf")
        elif keep is not None:
            saved = export_variant(model, tokenizer, keep / stem, export_format)
            download = zip_export(saved.folder, folder / f"{stem}.zip")
        else:
            saved = archive_export(model, tokenizer, folder / f"{stem}.zip", export_format)
            download = saved.archive
    except BaseException:  # a save that fails (a full disk, a stop) leaves nothing the push could pick up
        if keep is not None:
            shutil.rmtree(keep / stem, ignore_errors=True)
        raise
    return {"saved_model": str(download), "saved_mode": saved.mode, "saved_reason": saved.reason,
            "saved_variant": saved.variant, "saved_gguf": None if saved.gguf is None else saved.gguf.name,
            "saved_folder": None if keep is None else str(saved.folder)} | _gguf_fields(saved)


def _gguf_fields(saved) -> dict:
    """The report's "app" fields about every GGUF of a gguf save (file, type, size, perplexity; the matrix's text)."""
    if not isinstance(saved, GGUFExport):
        return {}
    return {"saved_ggufs": [g.to_json() | {"path": None} for g in saved.ggufs], "saved_imatrix": saved.imatrix,
            "saved_gguf_text": saved.eval_label, "saved_gguf_reference_ppl": saved.reference_ppl}


@gpu_compare
def run_compare_job(options: RunOptions, criteria: tuple[str, ...],
                    should_stop: StopCheck = None) -> Iterator[tuple[str, dict | ProgressEvent]]:
    """Criteria compared: (convert →) load → each criterion's blocks → one calibration pass → each criterion's
    operators, yielding (stage, the comparison's results.json so far): the map, scores and table grow criterion by
    criterion; (PROGRESS, event) while a stage's loop runs."""
    def stages(_sink) -> Iterator[tuple[str, dict]]:
        timings: dict[str, float] = {}
        loaded = yield from load_stages(options.model, timings, should_stop, options.load.hub_token)
        yield from _reports(compare_stages(options, criteria, loaded, should_stop=should_stop), timings)

    yield from staged(stages)


@gpu_sweep
def run_sweep_job(options: RunOptions, depths: tuple[int, ...],
                  should_stop: StopCheck = None) -> Iterator[tuple[str, dict | ProgressEvent]]:
    """A depth sweep: (convert →) load → score once → calibrate once → dense perplexity → one update per depth.

    Yields (stage, the sweep's results.json so far): the curve grows depth by depth; (PROGRESS, event) between.
    """
    def stages(_sink) -> Iterator[tuple[str, dict]]:
        timings: dict[str, float] = {}
        loaded = yield from load_stages(options.model, timings, should_stop, options.load.hub_token)
        yield from _reports(sweep_stages(options, depths, loaded, should_stop=should_stop), timings)

    yield from staged(stages)


def _reports(stages: Iterator, timings: dict[str, float]) -> Iterator[tuple[str, dict]]:
    """(stage, results.json so far) of a sweep or a comparison, with the app's own stage times first."""
    for stage, result in stages:
        report = result.to_json()
        report["timings"] = with_app_timings(report["timings"], timings)
        yield stage, report


def safe_name(model: str) -> str:
    """A model id or folder as a file-name stem ('org/name' → 'org-name')."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model.strip("/")).strip("-.") or "model"
