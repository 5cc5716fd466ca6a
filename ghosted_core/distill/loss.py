"""The distillation loss: KL from the teacher's cached top-K next-token distribution to the student's.

Two forms (`DistillOptions.loss`):

- `topk`, as LinearPatch computes it: the student's logits are gathered at the teacher's K indices
  and log-softmaxed over those K, and the KL is taken against the teacher's top-K distribution
  (renormalized over the same K); mean over tokens. The student's head runs only on the
  teacher's K rows per token: K·C multiply-adds per token instead of V·C (SmolLM2: 49,152 / 50 ≈
  1,000× less head work), the gathered rows (chunk, K, C) bounded like the logits. It never sees
  the probability the student puts outside the K entries.
- `topk_tail`: the KL between the two distributions coarse-grained to K + 1 outcomes, the
  teacher's K entries and "anything else", each side from its full softmax: the student's head
  runs on the whole vocabulary (its log-sum-exp), so mass leaking to the tail is penalized. It
  is a lower bound of the full KL, equal to it when the teacher's top K hold all its mass.

With the whole vocabulary kept (K = V) both are the exact KL of the next-token distributions. The
LM head runs in chunks of tokens so that the logits never exist for the whole batch at once; with
`backward` the gradient reaches the final hidden states chunk by chunk and is then sent through the
student once. The cached teacher log-probabilities are normalized over the whole vocabulary
(log p at its top K), so the same cache serves both forms.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.distill.options import LOSSES
from ghosted_core.memory_parts import LOGITS_BUDGET
from ghosted_core.model.head import head_logits, softcapped

LOGIT_COPIES = 3  # per chunk: the head's fp32 logits, the log-softmax and its gradient
TAIL_COPIES = 4  # per chunk with `topk_tail`: the logits, their copy with the top K masked, and both gradients


def gathered_logits(model: PreTrainedModel, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 logits (N, K) of final hidden states (N, C) at vocabulary `indices` (N, K) only: hᵀ W[idx], soft-capped
    as `head_logits` would give them at those entries."""
    head = model.lm_head
    rows = head.weight[indices]  # (N, K, C), the head's rows the loss reads
    logits = (hidden.unsqueeze(1).to(rows.dtype) @ rows.transpose(1, 2)).squeeze(1)  # (N, K)
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[indices]
    return softcapped(model.config, logits.float())


def teacher_log_probs(logits: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's targets from its logits (N, V): the log-probabilities (over the whole vocabulary) of its top
    `kept` entries and their indices (N, K), or every entry's (indices None) when `kept` is the vocabulary."""
    log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
    if kept >= logits.shape[-1]:
        return log_probs, None
    values, indices = torch.topk(log_probs, kept, dim=-1)  # (N, K)
    return values, indices


def kl_sum(logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of KL(teacher ‖ student): the student's logits (N, K) at the entries of the teacher's log-probs
    (N, K) (K = V: the whole vocabulary)."""
    student = torch.log_softmax(logits, dim=-1)
    teacher = torch.log_softmax(log_probs, dim=-1)  # renormalized after the float16 rounding of the cache
    return (teacher.exp() * (teacher - student)).sum()


def tail_kl_sum(logits: torch.Tensor, indices: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of KL(teacher ‖ student) coarse-grained to the teacher's K entries plus the rest: the student's
    full logits (N, V), the teacher's entries (N, K) and their log-probabilities over the whole vocabulary (N, K)."""
    total = torch.logsumexp(logits, dim=-1, keepdim=True)  # (N, 1)
    picked = logits.gather(1, indices) - total  # (N, K) log q at the teacher's entries
    rest = torch.logsumexp(logits.scatter(1, indices, float("-inf")), dim=-1, keepdim=True) - total  # (N, 1)
    student = torch.cat([picked, rest], dim=-1)  # (N, K + 1)
    # the teacher's rest: 1 − Σ p (at least a float16 step, since the cached values are rounded), renormalized
    inside = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=0.0)  # (N, 1) log Σ p
    outside = torch.log((-torch.expm1(inside)).clamp(min=1e-6))  # (N, 1) log(1 − Σ p)
    teacher = torch.log_softmax(torch.cat([log_probs, outside], dim=-1), dim=-1)  # (N, K + 1)
    return (teacher.exp() * (teacher - student)).sum()


def chunk_tokens(vocab: int, copies: int = LOGIT_COPIES) -> int:
    """Tokens per LM-head chunk over the whole vocabulary. Memory: chunk · V · 4 B · copies ≤ LOGITS_BUDGET."""
    return max(1, LOGITS_BUDGET // (4 * copies * vocab))


def gathered_chunk_tokens(kept: int, width: int) -> int:
    """Tokens per chunk of gathered head rows. Memory: chunk · K · C · 4 B (the rows) ≤ LOGITS_BUDGET."""
    return max(1, LOGITS_BUDGET // (4 * kept * width))


def loss_chunk_tokens(vocab: int, kept: int, width: int, loss: str = "topk") -> int:
    """Tokens per LM-head chunk of `distill_loss`: over the whole vocabulary (K = V, or the tail form), or the
    gathered rows of the teacher's K entries."""
    if kept >= vocab:
        return chunk_tokens(vocab)
    return chunk_tokens(vocab, TAIL_COPIES) if loss == "topk_tail" else gathered_chunk_tokens(kept, width)


def distill_loss(model: PreTrainedModel, hidden: torch.Tensor, log_probs: torch.Tensor,
                 indices: torch.Tensor | None, backward: bool = False, loss: str = "topk") -> float:
    """Mean KL per token of the student's final hidden states (B, T, C) against the teacher's targets (B, T, K),
    in the form `loss` names (`LOSSES`; the same with the whole vocabulary).

    With `backward` the loss's gradient is accumulated into whatever `hidden` depends on (the student's
    trainable weights), one LM-head chunk at a time: memory one chunk's logits, not the batch's.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown distillation loss {loss!r}; use one of {LOSSES}")
    width = hidden.shape[-1]
    flat = hidden.detach().reshape(-1, width)  # (N, C)
    if backward:
        flat.requires_grad_(True)
    targets = log_probs.reshape(flat.shape[0], -1)
    where = None if indices is None else indices.reshape(flat.shape[0], -1)
    count = flat.shape[0]
    vocab = int(model.config.vocab_size)
    step = loss_chunk_tokens(vocab, vocab if where is None else targets.shape[1], width, loss)
    total = 0.0
    for lo in range(0, count, step):
        hi = min(lo + step, count)
        with torch.set_grad_enabled(backward):
            target = targets[lo:hi].float()  # (n, K) log p
            if where is None:
                logits = head_logits(model, flat[lo:hi])  # (n, V)
                value = kl_sum(logits, target.to(logits.device))
            elif loss == "topk_tail":
                logits = head_logits(model, flat[lo:hi])  # (n, V): the tail needs the whole log-sum-exp
                value = tail_kl_sum(logits, where[lo:hi].to(logits.device, torch.long), target.to(logits.device))
            else:
                logits = gathered_logits(model, flat[lo:hi], where[lo:hi].to(flat.device, torch.long))  # (n, K)
                value = kl_sum(logits, target.to(logits.device))
            loss_value = value  # Σ over the chunk's tokens
            if backward:
                (loss_value / count).backward()
        total += float(loss_value.detach())
    if backward:
        hidden.backward(flat.grad.view_as(hidden))
    return total / count


def full_vocabulary_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher ‖ student) per token from full logits (…, V) of both: the naive baseline's loss."""
    return nn.functional.kl_div(torch.log_softmax(student.float(), -1), torch.log_softmax(teacher.float(), -1),
                                log_target=True, reduction="sum") / student[..., 0].numel()
