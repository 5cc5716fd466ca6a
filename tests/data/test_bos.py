"""Tests for the BOS rule of ghosted_core.data.corpora: every window starts as the tokenizer would start it.

A tokenizer that adds BOS is built from SmolLM2's by giving it a Llama-3-style post-processor
("<bos> $A"), so these run without Gemma-3; tests/evaluation/test_bos_perplexity.py (slow)
checks the real Gemma-3 against its own logits.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.data import corpora, user_text
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import perplexity
from ghosted_core.run.options import RunOptions, validate
from ghosted_core.run.pipeline import calibration_batches, window_counts
from conftest import make_tiny_model

BOS_ID = 1  # SmolLM2's "<|im_start|>": never produced by encoding plain text


@pytest.fixture(scope="module")
def bos_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with a post-processor that starts every encoding with token 1, as Llama-3's does."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    token = tokenizer.convert_ids_to_tokens(BOS_ID)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{token} $A", pair=f"{token} $A $B", special_tokens=[(token, BOS_ID)])
    assert tokenizer("Hello")["input_ids"][0] == BOS_ID
    return tokenizer


def _stream(tokenizer, name: str, split: str) -> torch.Tensor:
    """The split's text encoded independently of the windowing code, without special tokens."""
    text = corpora.load_corpus(name, split).text
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def test_auto_follows_the_tokenizer(bos_tokenizer, smollm2_tokenizer):
    assert corpora.resolve_bos(bos_tokenizer).token_id == BOS_ID
    assert corpora.resolve_bos(bos_tokenizer).applied == "window"
    assert corpora.resolve_bos(smollm2_tokenizer).token_id is None  # SmolLM2 sets a bos_token but never adds it
    assert corpora.resolve_bos(smollm2_tokenizer).applied == "none"
    assert corpora.resolve_bos(bos_tokenizer, "none").token_id is None
    assert corpora.resolve_bos(smollm2_tokenizer, "window").token_id == smollm2_tokenizer.bos_token_id
    with pytest.raises(GhostedError, match="BOS rule"):
        corpora.resolve_bos(smollm2_tokenizer, "sometimes")
    with pytest.raises(GhostedError, match="BOS rule"):
        validate(RunOptions(bos="twice"))


def test_every_evaluation_window_is_bos_then_the_next_text_tokens(bos_tokenizer):
    windows = corpora.evaluation_windows(bos_tokenizer, "wiki", seqlen=128, max_tokens=1024)  # (8, 128)
    assert windows.shape == (8, 128)
    assert (windows[:, 0] == BOS_ID).all()
    assert (windows[:, 1:] != BOS_ID).all()
    stream = _stream(bos_tokenizer, "wiki", "evaluation")
    assert torch.equal(windows[:, 1:].reshape(-1), stream[: 8 * 127])  # every text token once, in order
    assert window_counts(windows) == {"windows": 8, "tokens": 1024, "predicted_tokens": 8 * 127}


def test_every_calibration_and_heldout_window_starts_with_bos(bos_tokenizer):
    fit, held = corpora.calibration_windows(bos_tokenizer, "mix", n=12, seqlen=64, seed=0, heldout=4)
    assert fit.shape == (12, 64) and held.shape == (4, 64)
    windows = torch.cat([fit, held])
    assert (windows[:, 0] == BOS_ID).all() and (windows[:, 1:] != BOS_ID).all()
    stream = _stream(bos_tokenizer, "mix", "calibration")
    pieces = stream[: stream.numel() // 63 * 63].view(-1, 63)  # the text of every candidate window
    assert all(any(torch.equal(w[1:], p) for p in pieces) for w in windows)
    assert len({tuple(w.tolist()) for w in windows}) == 16  # fit and held-out stay disjoint


def test_a_run_calibrates_on_bos_windows(bos_tokenizer, smollm2_tokenizer):
    options = RunOptions(train_size=6, seqlen=64, heldout_size=2, calibration="wiki",
                         calibrate=CalibrationOptions(batch_size=4))
    batches, tokens = calibration_batches(bos_tokenizer, options)
    assert [b.heldout for b in batches] == [False, False, True]
    assert all((b.input_ids[:, 0] == BOS_ID).all() for b in batches)
    assert tokens == 6 * 64
    plain, _ = calibration_batches(smollm2_tokenizer, options)
    assert not any((b.input_ids == smollm2_tokenizer.bos_token_id).any() for b in plain)


def test_smollm2_windows_have_no_bos(smollm2_tokenizer):
    windows = corpora.evaluation_windows(smollm2_tokenizer, "wiki", seqlen=128, max_tokens=1024)
    stream = _stream(smollm2_tokenizer, "wiki", "evaluation")
    assert torch.equal(windows.reshape(-1), stream[:1024])  # plain text cut in windows, as before the rule
    fit, held = corpora.calibration_windows(smollm2_tokenizer, "mix", n=8, seqlen=64, seed=0, heldout=2)
    specials = set(smollm2_tokenizer.all_special_ids)
    assert not any(int(t) in specials for t in torch.cat([fit, held])[:, 0])


def test_your_text_windows_start_with_bos(bos_tokenizer):
    text = user_text.from_text(corpora.load_corpus("books", "evaluation").text[:60_000])
    cal, ev = text.corpus("calibration", shared=True), text.corpus("evaluation", shared=True)
    fit, _ = corpora.calibration_windows(bos_tokenizer, cal, n=4, seqlen=64, seed=0)
    windows = corpora.evaluation_windows(bos_tokenizer, ev, seqlen=64)
    assert (fit[:, 0] == BOS_ID).all() and (windows[:, 0] == BOS_ID).all()
    assert corpora.evaluation_windows(bos_tokenizer, ev, seqlen=64, bos="none")[:, 0].ne(BOS_ID).all()


def test_the_bos_position_is_never_scored():
    """Perplexity over BOS windows = exp(mean NLL of positions 1 … T−1), from the model's own logits."""
    model = make_tiny_model("llama", vocab_size=64)
    torch.manual_seed(0)
    body = torch.randint(2, 64, (3, 15))
    windows = torch.cat([torch.full((3, 1), BOS_ID), body], dim=1)  # (3, 16)
    ours = perplexity(model, {"dense": model}, windows, batch_size=2, quiet=True)["dense"]
    with torch.no_grad():
        logits = model(input_ids=windows).logits.double()  # (3, 16, V)
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, windows[:, 1:, None]).squeeze(-1)  # (3, 15)
    assert ours == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    assert nll.numel() == window_counts(windows)["predicted_tokens"]
