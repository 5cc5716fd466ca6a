"""The teacher's targets, computed once per run and shared by every distilled variant (offline, as LinearPatch).

One pass of the dense model over the training and validation windows (calibration text only)
keeps, per token, its top-K next-token log-probabilities (float16) and their indices (int32),
or the whole vocabulary's log-probabilities where K is the vocabulary. The same pass keeps the
dense residual stream entering the blocks where students start to train, within a budget: a
student that shares the dense prefix up to there then runs only its own suffix at every step.

Memory: windows · T · K · 6 B of targets on the host (K = V: windows · T · V · 2 B), and
windows · T · C · dtype bytes per kept prefix index on the model's device. Time: one dense forward
per window, the LM head in chunks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ghosted_core.model.loading import final_norm
from ghosted_core.progress import track
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.distill.loss import chunk_tokens, teacher_log_probs
from ghosted_core.model.head import head_logits
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import input_device
from ghosted_core.memory_parts import dtype_bytes
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)

TARGET_BYTES = 2  # float16 log-probabilities
INDEX_BYTES = 4  # int32 vocabulary indices


def target_bytes(tokens: int, kept: int, vocab: int) -> int:
    """Host bytes of the cached targets for `tokens` tokens keeping `kept` entries each."""
    return tokens * kept * (TARGET_BYTES + (INDEX_BYTES if kept < vocab else 0))


@dataclass
class TeacherCache:
    """The dense model's targets for every distillation window, and dense prefix states where they fit."""

    train_ids: torch.Tensor  # (N, T) training windows, in the order steps read them
    val_ids: torch.Tensor  # (M, T) validation windows
    log_probs: torch.Tensor  # (N + M, T, K) float16, on the host
    indices: torch.Tensor | None  # (N + M, T, K) int32, None when K is the vocabulary
    kept: int  # K
    vocab: int
    prefix: dict[int, torch.Tensor] = field(default_factory=dict)  # dense block → (N + M, T, C) stream entering it
    seconds: float = 0.0

    @property
    def windows(self) -> int:
        return len(self.train_ids) + len(self.val_ids)

    def targets(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (log-probs, indices) of the windows at `rows` (train windows first, then validation)."""
        return self.log_probs[rows], None if self.indices is None else self.indices[rows]

    @property
    def nbytes(self) -> int:
        """Bytes of targets (host) and of prefix states (the model's device) together."""
        parts = [self.log_probs, *([] if self.indices is None else [self.indices]), *self.prefix.values()]
        return sum(t.numel() * t.element_size() for t in parts)

    def to_json(self) -> dict:
        return {"train_windows": len(self.train_ids), "val_windows": len(self.val_ids), "kept": self.kept,
                "vocabulary": self.vocab, "full_vocabulary": self.indices is None,
                "target_bytes": self.log_probs.numel() * TARGET_BYTES + (0 if self.indices is None else
                                                                         self.indices.numel() * INDEX_BYTES),
                "prefix_blocks": sorted(self.prefix), "seconds": round(self.seconds, 3)}


def prefix_bytes(windows: int, seqlen: int, width: int, item: int) -> int:
    """Bytes of one kept prefix index: every window's stream entering that block."""
    return windows * seqlen * width * item


def build_teacher(dense: PreTrainedModel, train_ids: torch.Tensor, val_ids: torch.Tensor, kept: int,
                  prefix_blocks: Iterable[int] = (), prefix_budget: int = 0, cache_budget: int | None = None,
                  batch_size: int = 2, quiet: bool = True, should_stop: StopCheck = None) -> TeacherCache:
    """One dense pass over the windows: their top-`kept` targets and, within `prefix_budget` bytes, the stream
    entering each of `prefix_blocks` (in the order given, as many as fit)."""
    started = time.perf_counter()
    vocab = int(dense.config.vocab_size)
    ids = torch.cat([train_ids, val_ids])  # (W, T)
    windows, seqlen = ids.shape
    needed = target_bytes(windows * seqlen, kept, vocab)
    if cache_budget is not None and needed > cache_budget:
        raise GhostedError(f"the teacher cache needs {needed / 2**30:.2f} GiB ({windows} windows × {seqlen} tokens × "
                           f"{kept} entries) but its budget is {cache_budget / 2**30:.2f} GiB; lower --distill_top_k "
                           "or the budget (--distill_tokens/--distill_steps)")
    layers = len(dense.model.layers)
    item = dtype_bytes(dense.dtype)
    keep: list[int] = []
    room = prefix_budget
    for block in dict.fromkeys(int(b) for b in prefix_blocks):
        size = prefix_bytes(windows, seqlen, dense.config.hidden_size, item)
        if 0 <= block < layers and size <= room:
            keep.append(block)
            room -= size
    device = input_device(dense)
    log_probs = torch.empty(windows, seqlen, kept, dtype=torch.float16)
    indices = torch.empty(windows, seqlen, kept, dtype=torch.int32) if kept < vocab else None
    prefix = {j: torch.empty(windows, seqlen, dense.config.hidden_size, dtype=dense.dtype, device=device) for j in keep}
    step = chunk_tokens(vocab)
    with torch.no_grad():
        for lo in track(range(0, windows, batch_size), "distill: teacher targets", unit="batches", quiet=quiet):
            check_stop(should_stop, "distill")
            hi = min(lo + batch_size, windows)
            with capture(dense, [*keep, layers]) as seen:  # stops at the final norm's input
                run_forward(dense, ids[lo:hi].to(device))
            for j in keep:
                prefix[j][lo:hi] = seen[("residual", j)]
            hidden = final_norm(dense)(seen[("residual", layers)]).reshape(-1, dense.config.hidden_size)  # (n, C)
            values, where = [], []
            for a in range(0, hidden.shape[0], step):
                target, index = teacher_log_probs(head_logits(dense, hidden[a:a + step]), kept)
                values.append(target.to("cpu", torch.float16))
                if index is not None:
                    where.append(index.to("cpu", torch.int32))
            log_probs[lo:hi] = torch.cat(values).view(hi - lo, seqlen, kept)
            if indices is not None:
                indices[lo:hi] = torch.cat(where).view(hi - lo, seqlen, kept)
    cache = TeacherCache(train_ids, val_ids, log_probs, indices, kept, vocab, prefix, time.perf_counter() - started)
    log.info("teacher targets for %d windows (top %d of %d) in %.1f s; dense prefix kept at blocks %s", windows, kept,
             vocab, cache.seconds, keep or "none")
    return cache


def training_rows(step: int, batch_size: int, windows: int) -> slice:
    """The rows of the cache (training windows) that step `step` reads; one epoch, in order."""
    lo = (step * batch_size) % max(windows, 1)
    return slice(lo, min(lo + batch_size, windows))


def validation_rows(cache: TeacherCache, batch_size: int) -> Sequence[slice]:
    """The rows of the validation windows, in batches."""
    first = len(cache.train_ids)
    return [slice(lo, min(lo + batch_size, cache.windows)) for lo in range(first, cache.windows, batch_size)]
