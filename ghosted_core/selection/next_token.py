"""Next-token scores of candidate models from their final residual states: summed NLL, its cheap lower bound,
or summed KL to the dense model.

Shared by `sleb` (NLL and its bound), `kl` and `swap_kl` (KL(p_dense ‖ p_candidate), the direction
both papers use). The final norm and the LM head run on token chunks, so the logits never exceed
`memory_parts.LOGITS_BUDGET`; logits are taken in float32 (float64 for a float64 model), sums in float64.

Positions: NLL sums −log q(x_t+1 | x≤t) over t = 0 … T−2 (every target of the window; the first
token is never a target), KL sums over every position t = 0 … T−1 (each is a next-token
distribution). Padding (attention_mask 0) is left out of both.

The lower bound: for any vocabulary subset S holding the target, logsumexp over S ≤ logsumexp over
the whole vocabulary, so lse_S(z) − z_target ≤ −log q(target). It costs |S|/V of the head, and it
lets `sleb` skip the full head for candidates that provably cannot win (`vocabulary_subset`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from ghosted_core.memory_parts import LOGITS_BUDGET
from ghosted_core.model.head import softcapped
from ghosted_core.model.loading import final_norm
from ghosted_core.selection.suffixes import Work


def _logits(model: PreTrainedModel, h: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor | None] | None = None
            ) -> torch.Tensor:
    """Logits of final residual states h (N, C), before the final norm → (N, V), or (N, |S|) for a vocabulary
    subset's head rows `rows` = (weight (|S|, C), bias), sliced once by `_subset_head`."""
    x = final_norm(model)(h)
    logits = model.lm_head(x) if rows is None else torch.nn.functional.linear(x, *rows)
    return softcapped(model.config, logits.to(torch.promote_types(logits.dtype, torch.float32)))


def _subset_head(model: PreTrainedModel, subset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's rows of a vocabulary subset, copied once per call of `nll_sums` (memory: |S| × C in the
    model's dtype), not once per chunk and candidate."""
    head = model.lm_head
    rows = subset.to(head.weight.device)
    return head.weight[rows], None if head.bias is None else head.bias[rows]


def _chunks(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, targets: bool, width: int,
            copies: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """(positions, kept (B·t,) bool) per chunk of positions, sized so `copies` (B·t) × width float32 blocks fit."""
    batch, length = input_ids.shape
    valid = torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    mask = valid[:, :-1] & valid[:, 1:] if targets else valid  # NLL: position t has target t+1
    step = max(1, LOGITS_BUDGET // (copies * 4 * width * batch))
    span = mask.shape[1]
    for lo in range(0, span, step):
        where = slice(lo, min(lo + step, span))
        keep = mask[:, where].reshape(-1)
        if keep.any():
            yield where, keep


def _rows(h: torch.Tensor, where: slice, keep: torch.Tensor) -> torch.Tensor:
    return h[:, where].reshape(-1, h.shape[-1])[keep.to(h.device)]  # (rows, C)


def count_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, targets: bool = True) -> int:
    """How many positions `nll_sums` (targets) or `kl_sums` (not) sum over."""
    return sum(int(keep.sum()) for _, keep in _chunks(input_ids, attention_mask, targets, 1, 1))


def nll_sums(model: PreTrainedModel, finals: Sequence[torch.Tensor], input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, subset: torch.Tensor | None = None,
             work: Work | None = None) -> list[float]:
    """Per candidate (final states (B, T, C)): the summed NLL of the window's targets; with `subset` (sorted
    vocabulary ids holding every target), its lower bound from the logits of those rows only.

    Time: one head (or |subset|/V of one) per candidate per token; memory: one chunk of logits.
    """
    width = model.lm_head.out_features if subset is None else len(subset)
    rows = None if subset is None else _subset_head(model, subset)
    sums = [0.0] * len(finals)
    for where, keep in _chunks(input_ids, attention_mask, True, width, 2):
        target = input_ids[:, 1:][:, where].reshape(-1)[keep]
        column = target if subset is None else torch.searchsorted(subset.cpu(), target)
        for k, h in enumerate(finals):
            z = _logits(model, _rows(h, where, keep), rows)  # (rows, width)
            picked = z.gather(1, column.to(z.device)[:, None])[:, 0]
            sums[k] += float((torch.logsumexp(z, dim=-1) - picked).double().sum())
    if work is not None:
        work.head_runs += input_ids.shape[0] * len(finals) * width / model.lm_head.out_features
    return sums


def kl_sums(model: PreTrainedModel, finals: Sequence[torch.Tensor], reference: torch.Tensor,
            attention_mask: torch.Tensor | None = None, work: Work | None = None) -> list[float]:
    """Per candidate: Σ over positions of KL(p_reference ‖ p_candidate), `reference` the dense final states (B, T, C).

    Time: one head per candidate plus one for the reference, per token; memory: one chunk of logits (three copies).
    """
    ids = torch.zeros(reference.shape[:2], dtype=torch.long)
    sums = [0.0] * len(finals)
    for where, keep in _chunks(ids, attention_mask, False, model.lm_head.out_features, 3):
        logp = torch.log_softmax(_logits(model, _rows(reference, where, keep)), dim=-1)  # (rows, V)
        p = logp.exp()
        for k, h in enumerate(finals):
            logq = torch.log_softmax(_logits(model, _rows(h, where, keep)), dim=-1).to(logp.device)
            sums[k] += float((p * (logp - logq)).sum(-1).double().sum())
    if work is not None:
        work.head_runs += reference.shape[0] * (len(finals) + 1)
    return sums


def vocabulary_subset(model: PreTrainedModel, finals: Sequence[torch.Tensor], input_ids: Sequence[torch.Tensor],
                      top: int = 32, work: Work | None = None) -> torch.Tensor:
    """Sorted vocabulary ids: every target of the windows and each position's `top` tokens under the given final
    states (the dense model's), for `nll_sums(subset=…)`. Time: one head per window; memory: one chunk of logits."""
    chosen = [torch.cat([ids.reshape(-1) for ids in input_ids]).cpu()]
    for h, ids in zip(finals, input_ids):
        for where, keep in _chunks(ids, None, False, model.lm_head.out_features, 2):
            z = _logits(model, _rows(h, where, keep))
            chosen.append(z.topk(min(top, z.shape[-1]), dim=-1).indices.reshape(-1).cpu())
        if work is not None:
            work.head_runs += ids.shape[0]
    return torch.unique(torch.cat(chosen))
