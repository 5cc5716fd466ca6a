"""The distillation loss (both forms) against an independent numpy computation, and its chunked backward against plain
autograd."""

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


def _numpy_tail_kl(student: np.ndarray, teacher: np.ndarray, k: int) -> float:
    """The tail form written out: both full softmaxes, coarse-grained to the teacher's top-k entries plus the rest."""
    total = 0.0
    for s, t in zip(student, teacher):
        p = np.exp(t - t.max())
        p /= p.sum()
        q = np.exp(s - s.max())
        q /= q.sum()
        top = np.argsort(-t, kind="stable")[:k]
        rest = np.ones(len(t), dtype=bool)
        rest[top] = False
        p_b = np.append(p[top], p[rest].sum())
        q_b = np.append(q[top], q[rest].sum())
        total += float(np.sum(p_b * (np.log(p_b) - np.log(q_b))))
    return total / len(student)


def _targets(head: _Head, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        log_probs, indices = teacher_log_probs(head.lm_head(hidden).reshape(-1, head.config.vocab_size), k)
    shape = (*hidden.shape[:2], -1)
    return log_probs.reshape(shape), None if indices is None else indices.reshape(shape)


@pytest.mark.parametrize("k", [1, 7, 39])
def test_tail_kl_equals_numpy_and_is_the_exact_kl_when_one_entry_is_left(k):
    head = _Head(12, 40)
    hidden, teacher_hidden = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    log_probs, indices = _targets(head, teacher_hidden, k)
    with torch.no_grad():
        ours = distill_loss(head, hidden, log_probs, indices, loss="topk_tail")
        student = head.lm_head(hidden).reshape(-1, 40).double().numpy()
        teacher = head.lm_head(teacher_hidden).reshape(-1, 40).double().numpy()
        exact = float(full_vocabulary_kl(head.lm_head(hidden), head.lm_head(teacher_hidden)))
    assert ours == pytest.approx(_numpy_tail_kl(student, teacher, k), rel=1e-4, abs=1e-7)
    assert 0 < ours <= exact * (1 + 1e-5)  # coarse-graining never increases a KL
    if k == 39:  # the rest is one entry: nothing is coarse-grained
        assert ours == pytest.approx(exact, rel=1e-4)


def test_only_the_tail_form_sees_the_students_mass_outside_the_teachers_top_k():
    """Raising every logit the teacher did not keep leaves LinearPatch's renormalized top-K loss unchanged, and
    raises the tail form's: the leak to the tail that full-softmax perplexity pays for."""
    head = _Head(12, 40, seed=3)
    log_probs, indices = _targets(head, torch.randn(1, 8, 12), 6)  # (1, 8, 6): 8 tokens
    with torch.no_grad():
        base = head.lm_head(torch.randn(8, 12))  # (8, 40) the student's logits per token
        outside = torch.ones(8, 40).scatter_(1, indices.reshape(8, 6), 0.0)  # 1 where the teacher kept nothing
        loss = {}
        for name, logits in (("base", base), ("raised", base + 3.0 * outside)):
            rows = _Head(8, 40)  # one-hot hidden states: token i's logits are column i of the head's weight
            rows.lm_head.weight.copy_(logits.T)
            hidden = torch.eye(8).reshape(1, 8, 8)
            loss[name] = [distill_loss(rows, hidden, log_probs, indices, loss=form) for form in ("topk", "topk_tail")]
    assert loss["raised"][0] == pytest.approx(loss["base"][0], rel=1e-5)
    assert loss["raised"][1] > loss["base"][1] + 0.1


def test_tail_form_chunked_backward_equals_autograd(monkeypatch):
    head = _Head(10, 30, seed=1)
    weight = nn.Parameter(torch.eye(10) + 0.1 * torch.randn(10, 10))
    x = torch.randn(2, 7, 10)
    log_probs, indices = _targets(head, torch.randn(2, 7, 10), 6)
    monkeypatch.setattr("ghosted_core.distill.loss.LOGITS_BUDGET", 4 * 4 * 4 * 30)  # 4 tokens per chunk
    value = distill_loss(head, x @ weight, log_probs, indices, backward=True, loss="topk_tail")
    chunked = weight.grad.clone()
    weight.grad = None

    logits = head.lm_head(x @ weight).reshape(14, 30)
    q = torch.log_softmax(logits, -1)
    idx = indices.reshape(14, 6)
    rest = torch.logsumexp(q.scatter(1, idx, float("-inf")), -1, keepdim=True)
    student = torch.cat([q.gather(1, idx), rest], -1)
    p = log_probs.reshape(14, 6).float()
    teacher = torch.log_softmax(torch.cat([p, torch.log1p(-p.exp().sum(-1, keepdim=True))], -1), -1)
    whole = (teacher.exp() * (teacher - student)).sum() / 14
    whole.backward()
    assert value == pytest.approx(float(whole.detach()), rel=1e-5)
    assert torch.allclose(chunked, weight.grad, rtol=1e-4, atol=1e-7)
