"""The distillation loss against an independent numpy computation, and its chunked backward against plain autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ghosted_core.distill.loss import distill_loss, full_vocabulary_kl, teacher_log_probs


class _Head(nn.Module):
    """The part of a causal LM the loss reads: an LM head and the config's vocabulary and soft-cap."""

    def __init__(self, width: int, vocab: int, softcap: float | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.config = type("Config", (), {"vocab_size": vocab, "final_logit_softcapping": softcap})()


def _numpy_topk_kl(student: np.ndarray, teacher: np.ndarray, k: int) -> float:
    """LinearPatch's loss written out: the teacher's top-k, both softmaxed over those k entries, KL, mean per token."""
    total = 0.0
    for s, t in zip(student, teacher):
        top = np.argsort(-t, kind="stable")[:k]
        p = np.exp(t[top] - t[top].max())
        p /= p.sum()
        q = np.exp(s[top] - s[top].max())
        q /= q.sum()
        total += float(np.sum(p * (np.log(p) - np.log(q))))
    return total / len(student)


@pytest.mark.parametrize("k, softcap", [(7, None), (7, 30.0), (40, None)])
def test_top_k_kl_equals_numpy(k, softcap):
    head = _Head(12, 40, softcap)
    hidden = torch.randn(3, 5, 12, dtype=torch.float32)
    teacher_hidden = hidden + 0.3 * torch.randn_like(hidden)
    with torch.no_grad():
        cap = (lambda x: torch.tanh(x / softcap) * softcap) if softcap else (lambda x: x)
        student_logits = cap(head.lm_head(hidden)).reshape(-1, 40)
        teacher_logits = cap(head.lm_head(teacher_hidden)).reshape(-1, 40)
        log_probs, indices = teacher_log_probs(teacher_logits, k)
        shape = (3, 5, -1)
        ours = distill_loss(head, hidden, log_probs.reshape(shape), None if indices is None else indices.reshape(shape))
    expected = _numpy_topk_kl(student_logits.double().numpy(), teacher_logits.double().numpy(), k)
    assert ours == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert ours > 0


def test_whole_vocabulary_is_the_exact_kl():
    head = _Head(12, 40)
    hidden = torch.randn(2, 6, 12)
    teacher_hidden = torch.randn(2, 6, 12)
    with torch.no_grad():
        teacher = head.lm_head(teacher_hidden)
        log_probs, indices = teacher_log_probs(teacher.reshape(-1, 40), 40)
        ours = distill_loss(head, hidden, log_probs.reshape(2, 6, 40), None)
        exact = full_vocabulary_kl(head.lm_head(hidden), teacher)
    assert indices is None
    assert ours == pytest.approx(float(exact), rel=1e-5)


def test_chunked_backward_equals_autograd_of_the_whole_batch(monkeypatch):
    """The LM head in chunks of 4 tokens (as a 128k vocabulary gets): the same gradient as one unchunked loss."""
    head = _Head(10, 30, seed=1)
    weight = nn.Parameter(torch.eye(10) + 0.1 * torch.randn(10, 10))
    x = torch.randn(2, 7, 10)
    with torch.no_grad():
        log_probs, indices = teacher_log_probs(head.lm_head(torch.randn(14, 10)), 6)
    log_probs, indices = log_probs.reshape(2, 7, 6), indices.reshape(2, 7, 6)

    monkeypatch.setattr("ghosted_core.distill.loss.LOGITS_BUDGET", 4 * 4 * 3 * 30)  # 4 tokens per chunk
    value = distill_loss(head, x @ weight, log_probs, indices, backward=True)
    chunked = weight.grad.clone()
    weight.grad = None

    logits = head.lm_head(x @ weight).reshape(14, 30)
    student = torch.log_softmax(logits.gather(-1, indices.reshape(14, 6)), -1)
    teacher = torch.log_softmax(log_probs.reshape(14, 6).float(), -1)
    whole = (teacher.exp() * (teacher - student)).sum() / 14
    whole.backward()
    assert value == pytest.approx(float(whole.detach()), rel=1e-6)
    assert torch.allclose(chunked, weight.grad, rtol=1e-5, atol=1e-7)
