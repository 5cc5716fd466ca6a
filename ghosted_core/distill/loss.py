"""The distillation loss: KL from the teacher's cached top-K next-token distribution to the student's.

As LinearPatch computes it: the student's logits are gathered at the teacher's K indices and
log-softmaxed over those K, and the KL is taken against the teacher's top-K distribution
(softmaxed over the same K); mean over tokens. With the whole vocabulary kept (K = V) it is
the exact KL of the next-token distributions. The LM head runs in chunks of tokens so that the
logits never exist for the whole batch at once; with `backward` the gradient reaches the final
hidden states chunk by chunk and is then sent through the student once.

With K < V the student's LM head runs only on the teacher's K rows per token (the logits the loss
reads): K·C multiply-adds per token instead of V·C (SmolLM2: 49,152 / 50 ≈ 1,000× less head work),
the gathered rows (chunk, K, C) bounded like the logits.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.memory_parts import LOGITS_BUDGET

LOGIT_COPIES = 3  # per chunk: the head's fp32 logits, the log-softmax and its gradient


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits (N, V) of final hidden states (N, C), with the model's final soft-capping where it has one."""
    logits = model.lm_head(hidden).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def gathered_logits(model: PreTrainedModel, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 logits (N, K) of final hidden states (N, C) at vocabulary `indices` (N, K) only: hᵀ W[idx], soft-capped
    as `head_logits` would give them at those entries."""
    head = model.lm_head
    rows = head.weight[indices]  # (N, K, C), the head's rows the loss reads
    logits = (hidden.unsqueeze(1).to(rows.dtype) @ rows.transpose(1, 2)).squeeze(1)  # (N, K)
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[indices]
    logits = logits.float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def teacher_log_probs(logits: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's targets from its logits (N, V): the log-softmax over its top `kept` entries and their indices
    (N, K), or over the whole vocabulary (indices None) when `kept` is the vocabulary."""
    if kept >= logits.shape[-1]:
        return torch.log_softmax(logits, dim=-1), None
    values, indices = torch.topk(logits, kept, dim=-1)  # (N, K)
    return torch.log_softmax(values, dim=-1), indices


def kl_sum(logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of KL(teacher ‖ student): the student's logits (N, K) at the entries of the teacher's log-probs
    (N, K) (K = V: the whole vocabulary)."""
    student = torch.log_softmax(logits, dim=-1)
    teacher = torch.log_softmax(log_probs, dim=-1)  # renormalized after the float16 rounding of the cache
    return (teacher.exp() * (teacher - student)).sum()


def chunk_tokens(vocab: int) -> int:
    """Tokens per LM-head chunk over the whole vocabulary. Memory: chunk · V · 4 B · LOGIT_COPIES ≤ LOGITS_BUDGET."""
    return max(1, LOGITS_BUDGET // (4 * LOGIT_COPIES * vocab))


def gathered_chunk_tokens(kept: int, width: int) -> int:
    """Tokens per chunk of gathered head rows. Memory: chunk · K · C · 4 B (the rows) ≤ LOGITS_BUDGET."""
    return max(1, LOGITS_BUDGET // (4 * kept * width))


def distill_loss(model: PreTrainedModel, hidden: torch.Tensor, log_probs: torch.Tensor,
                 indices: torch.Tensor | None, backward: bool = False) -> float:
    """Mean KL per token of the student's final hidden states (B, T, C) against the teacher's targets (B, T, K).

    With `backward` the loss's gradient is accumulated into whatever `hidden` depends on (the student's
    trainable weights), one LM-head chunk at a time: memory one chunk's logits, not the batch's.
    """
    width = hidden.shape[-1]
    flat = hidden.detach().reshape(-1, width)  # (N, C)
    if backward:
        flat.requires_grad_(True)
    targets = log_probs.reshape(flat.shape[0], -1)
    where = None if indices is None else indices.reshape(flat.shape[0], -1)
    count = flat.shape[0]
    step = chunk_tokens(model.config.vocab_size) if where is None else gathered_chunk_tokens(targets.shape[1], width)
    total = 0.0
    for lo in range(0, count, step):
        hi = min(lo + step, count)
        with torch.set_grad_enabled(backward):
            if where is None:
                logits = head_logits(model, flat[lo:hi])  # (n, V)
            else:
                logits = gathered_logits(model, flat[lo:hi], where[lo:hi].to(flat.device, torch.long))  # (n, K)
            loss = kl_sum(logits, targets[lo:hi].to(logits.device, torch.float32))
            if backward:
                (loss / count).backward()
        total += float(loss.detach())
    if backward:
        hidden.backward(flat.grad.view_as(hidden))
    return total / count


def full_vocabulary_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher ‖ student) per token from full logits (…, V) of both: the naive baseline's loss."""
    return nn.functional.kl_div(torch.log_softmax(student.float(), -1), torch.log_softmax(teacher.float(), -1),
                                log_target=True, reduction="sum") / student[..., 0].numel()
