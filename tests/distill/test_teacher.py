"""The teacher cache: the dense model's own top-K, its prefix states, its budgets; the distillation windows."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens
from students import peaked  # noqa: F401 (a fixture)
from ghosted_core.distill.teacher import build_teacher, prefix_bytes
from ghosted_core.errors import GhostedError


def test_targets_are_the_dense_models_top_k_and_prefix_states_its_stream(peaked):
    train, val = random_tokens(5, 16, seed=1), random_tokens(2, 16, seed=2)
    cache = build_teacher(peaked, train, val, kept=9, prefix_blocks=[2, 4], prefix_budget=2**30, batch_size=3)
    ids = torch.cat([train, val])
    with torch.no_grad():
        out = peaked(ids, output_hidden_states=True)
    logits = out.logits.float()  # (W, T, V) of the plain forward
    values, indices = torch.topk(logits, 9, dim=-1)
    assert torch.equal(cache.indices.long(), indices)
    expected = torch.log_softmax(logits, -1).gather(-1, indices)  # log p over the whole vocabulary, at the top 9
    assert torch.allclose(cache.log_probs.float(), expected, atol=2e-2, rtol=1e-3)  # float16 cache
    for j in (2, 4):
        assert torch.allclose(cache.prefix[j], out.hidden_states[j], atol=1e-5)
    assert cache.windows == 7 and cache.targets(slice(5, 7))[0].shape == (2, 16, 9)


def test_the_whole_vocabulary_is_kept_without_indices(tiny_llama):
    cache = build_teacher(tiny_llama, random_tokens(2, 8), random_tokens(1, 8, seed=1), kept=97)
    assert cache.indices is None and cache.log_probs.shape == (3, 8, 97)
    assert torch.allclose(cache.log_probs.float().exp().sum(-1), torch.ones(3, 8), atol=2e-2)


def test_prefix_budget_keeps_only_what_fits(tiny_llama):
    train, val = random_tokens(4, 8), random_tokens(1, 8, seed=1)
    one = prefix_bytes(5, 8, tiny_llama.config.hidden_size, 4)
    cache = build_teacher(tiny_llama, train, val, kept=5, prefix_blocks=[3, 1], prefix_budget=one)
    assert sorted(cache.prefix) == [3]  # in the order given, as many as fit
    assert sorted(build_teacher(tiny_llama, train, val, kept=5, prefix_blocks=[3], prefix_budget=one - 1).prefix) == []


def test_a_cache_over_its_budget_is_refused_before_any_forward(tiny_llama):
    with pytest.raises(GhostedError, match="teacher cache needs .*--distill_top_k"):
        build_teacher(tiny_llama, random_tokens(4, 8), random_tokens(1, 8), kept=50, cache_budget=100)


def test_distillation_windows_are_calibration_text_and_never_overlap(smollm2_tokenizer):
    from ghosted_core.data import corpora

    fit, held = corpora.calibration_windows(smollm2_tokenizer, "ptb", 6, 64, seed=3, heldout=2)
    train, val = corpora.distillation_windows(smollm2_tokenizer, "ptb", 10, 4, 64, seed=3, fit=6, heldout=2)
    rows = lambda t: {tuple(r.tolist()) for r in t}  # noqa: E731
    assert torch.equal(train[:6], fit) and torch.equal(val[:2], held)  # calibration's windows first
    assert not rows(train) & rows(val) and len(rows(train)) == 10 and len(rows(val)) == 4
    with pytest.raises(GhostedError, match="distillation .* validation windows need"):
        corpora.distillation_windows(smollm2_tokenizer, "ptb", 10**6, 4, 64, seed=3, fit=6, heldout=2)
