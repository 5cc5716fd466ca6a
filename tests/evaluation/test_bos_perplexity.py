"""Slow: Gemma-3's perplexity with a BOS per window, against an independent computation from its own logits,
and what lm-eval prepends for Gemma-3 and SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

from ghosted_core.data import corpora
from ghosted_core.evaluation.perplexity import perplexity
from ghosted_core.evaluation.tasks import _make_lm

pytestmark = pytest.mark.slow

SEQLEN, TOKENS = 512, 1024  # the 512-token windows, two of them (it measured the first 2048 tokens of wiki)


@pytest.fixture(scope="module")
def gemma():
    from ghosted_core.model.loading import load_model

    return load_model("gemma3-270m")


def _independent_perplexity(model, tokenizer, text: str) -> float:
    """BOS + 511 text tokens per window, the text encoded by the tokenizer's own default (which adds
    the BOS), scored from the full model's logits in float64, one window at a time."""
    encoded = tokenizer(text, verbose=False)["input_ids"]  # (BOS, text...)
    assert encoded[0] == tokenizer.bos_token_id
    body = encoded[1 : 1 + (TOKENS // SEQLEN) * (SEQLEN - 1)]
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(TOKENS // SEQLEN):
            ids = torch.tensor([[tokenizer.bos_token_id, *body[k * (SEQLEN - 1) : (k + 1) * (SEQLEN - 1)]]])  # (1, 512)
            logits = model(input_ids=ids, use_cache=False).logits[0].double()  # (512, V)
            logp = torch.log_softmax(logits[:-1], dim=-1)  # (511, V): position 0 (BOS) is never a target
            total -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += SEQLEN - 1
    return math.exp(total / count)


def test_gemma3_dense_perplexity_with_bos_matches_its_logits(gemma, all_threads):
    model, tokenizer = gemma.model, gemma.tokenizer
    assert corpora.resolve_bos(tokenizer).token == "<bos>"
    windows = corpora.evaluation_windows(tokenizer, "wiki", SEQLEN, TOKENS)  # (2, 512)
    assert windows.shape == (TOKENS // SEQLEN, SEQLEN) and (windows[:, 0] == tokenizer.bos_token_id).all()
    ours = perplexity(model, {"dense": model}, windows, batch_size=1, quiet=True)["dense"]
    reference = _independent_perplexity(model, tokenizer, corpora.load_corpus("wiki", "evaluation").text)
    assert ours == pytest.approx(reference, rel=0.02)
    plain = corpora.evaluation_windows(tokenizer, "wiki", SEQLEN, TOKENS, bos="none")
    without = perplexity(model, {"dense": model}, plain, batch_size=1, quiet=True)["dense"]
    assert without > 1.5 * ours  # the issue measured 38.7 without a BOS against 17.1 with one


def test_lm_eval_prepends_bos_for_gemma3_only(gemma, smollm2):
    """lm-eval 0.4.13 (add_bos_token=None) encodes with the tokenizer's default: BOS for Gemma-3, none for SmolLM2."""
    text = "The capital of France is"
    gemma_lm = _make_lm(gemma.model, gemma.tokenizer, 1, False)
    assert gemma_lm.tok_encode(text)[0] == gemma.tokenizer.bos_token_id
    assert gemma_lm.tok_encode(text)[1:] == gemma.tokenizer(text, add_special_tokens=False)["input_ids"]
    smol_lm = _make_lm(smollm2.model, smollm2.tokenizer, 1, False)
    assert smol_lm.tok_encode(text) == smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
