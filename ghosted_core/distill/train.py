"""One student's distillation: AdamW on a cosine schedule, validation on held-out windows, the best state kept.

The student runs only the part from its first trained block on with gradients: the blocks before
it run without (or not at all, where the teacher pass kept the dense stream there). Each step
reads the next training windows once (one epoch), validates every few steps on windows it never
trains on, stops early after `patience` validations without improvement, and ends with the
weights of its best validation (the closed-form start included: distillation never returns
something worse on validation than where it started).

Memory: the trained parameters × 20 B (fp32 weight, gradient, AdamW's two moments, the best copy),
the suffix's activations for one step's backward, one LM-head chunk's logits. Time per step: one
suffix forward and backward, the prefix forward where it is not cached.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ghosted_core.progress import track
from ghosted_core.distill.loss import distill_loss
from ghosted_core.distill.options import DistillOptions
from ghosted_core.distill.targets import Student
from ghosted_core.distill.teacher import TeacherCache, training_rows, validation_rows
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import input_device, shared_prefix
from ghosted_core.model.loading import module_device
from ghosted_core.model.side_inputs import stream_kwargs
from ghosted_core.model.surgery import slice_view
from ghosted_core.stopping import StopCheck, check_stop

log = logging.getLogger(__name__)


def learning_rate(step: int, steps: int, lr: float, min_lr_factor: float, warmup: int = 0) -> float:
    """The rate of step `step` (0-based) of `steps`: linear warm-up, then a cosine from lr down to lr / min_lr_factor."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    floor = lr / min_lr_factor
    span = max(steps - warmup - 1, 1)
    progress = min(1.0, (step - warmup) / span)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast_for(precision: str, device: torch.device, model_dtype: torch.dtype = torch.float32):
    """bf16 autocast on a GPU ("auto" or "bf16"), and on a CPU when asked or when the model itself is in bf16
    ("auto": the fp32 trainable copies then compute in the frozen blocks' dtype); nothing otherwise (fp32)."""
    if device.type == "cuda" and precision in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and (precision == "bf16" or precision == "auto" and model_dtype == torch.bfloat16):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class DistillReport:
    """What one distillation did (results.json's `distill` entry of a variant)."""

    variant: str
    base: str
    target: str
    description: str
    stock: bool  # the distilled variant exports as a stock checkpoint
    parameters: int
    trained: tuple[str, ...]  # module paths in the variant
    steps_planned: int
    batch_size: int
    seqlen: int
    lr: float
    min_lr_factor: float
    warmup: int
    weight_decay: float
    kept: int  # teacher entries per token (K)
    vocabulary: int
    loss_form: str  # `DistillOptions.loss`
    precision: str
    prefix: str  # where the frozen blocks before the first trained one come from
    corpus: str  # the calibration corpus's label
    loss: list[float] = field(default_factory=list)  # training KL per step
    val: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation KL)
    best_step: int = 0
    stopped: str = ""  # "budget", "early stop", or "" while it runs
    seconds: float = 0.0
    train_seconds: float = 0.0  # the steps alone (no validation)

    @property
    def steps(self) -> int:
        return len(self.loss)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seqlen

    @property
    def start_val(self) -> float | None:
        return self.val[0][1] if self.val else None

    @property
    def best_val(self) -> float | None:
        return min((v for _, v in self.val), default=None)

    def to_json(self) -> dict:
        return {
            "variant": self.variant, "base": self.base, "target": self.target, "description": self.description,
            "stock": self.stock, "parameters": self.parameters, "trained": list(self.trained),
            "steps": self.steps, "steps_planned": self.steps_planned, "tokens": self.tokens,
            "batch_size": self.batch_size, "seqlen": self.seqlen,
            "schedule": {"optimizer": "AdamW", "lr": self.lr, "min_lr": self.lr / self.min_lr_factor,
                         "warmup": self.warmup, "weight_decay": self.weight_decay, "shape": "cosine"},
            "loss": "KL(teacher ‖ student), full vocabulary" if self.kept >= self.vocabulary else
                    "KL(teacher ‖ student) on the teacher's top-K plus the rest of the vocabulary as one entry"
                    if self.loss_form == "topk_tail" else "KL(teacher ‖ student) on the teacher's top-K",
            "loss_form": self.loss_form,
            "top_k": self.kept, "vocabulary": self.vocabulary, "precision": self.precision, "prefix": self.prefix,
            "corpus": self.corpus, "loss_curve": [round(v, 6) for v in self.loss],
            "val_curve": [[s, round(v, 6)] for s, v in self.val], "start_val": self.start_val,
            "best_val": self.best_val, "best_step": self.best_step, "stopped": self.stopped,
            "seconds": round(self.seconds, 3),
            "seconds_per_step": round(self.train_seconds / self.steps, 4) if self.steps else None,
        }


class _Prefix:
    """The stream entering the student's first trained block, for rows of the teacher cache.

    From the teacher's dense prefix states when the student shares the dense blocks before it; else its own
    frozen blocks, run without gradients (validation rows computed once and kept, within `budget`).
    """

    def __init__(self, student: Student, dense: PreTrainedModel, cache: TeacherCache, budget: int):
        start = student.first_block
        self.device = input_device(dense)
        self.dense_states = cache.prefix.get(start) if start <= shared_prefix(dense, student.model) else None
        self.source = "dense states kept by the teacher pass" if self.dense_states is not None else \
            f"the student's own {start} frozen block(s), run without gradients" if start else "the embeddings"
        self.model = slice_view(student.model, dense, 0, start, normed=False)
        self.ids = torch.cat([cache.train_ids, cache.val_ids])
        self.kept: dict[int, torch.Tensor] = {}
        self.budget = budget

    def __call__(self, rows: slice, keep: bool = False) -> torch.Tensor:
        if self.dense_states is not None:
            return self.dense_states[rows]
        if rows.start in self.kept:
            return self.kept[rows.start]
        with torch.no_grad():
            h = self.model.model(input_ids=self.ids[rows].to(self.device), use_cache=False).last_hidden_state
        size = h.numel() * h.element_size()
        if keep and size <= self.budget:
            self.kept[rows.start] = h
            self.budget -= size
        return h  # (B, T, C)


def distill_student(student: Student, dense: PreTrainedModel, cache: TeacherCache, options: DistillOptions,
                    report: DistillReport, should_stop: StopCheck = None, quiet: bool = True) -> Iterator[DistillReport]:
    """Train `student` in place, yielding `report` after every validation; its weights end at the best validation."""
    if not student.parameters:
        raise GhostedError(f"{report.variant}: nothing to train")
    started = time.perf_counter()
    steps = report.steps_planned
    every = options.eval_every or max(1, steps // 8)
    device = module_device(student.model.model.layers[0]) if student.model.model.layers else input_device(dense)
    prefix = _Prefix(student, dense, cache, options.prefix_budget)
    report.prefix = prefix.source
    suffix = slice_view(student.model, dense, student.first_block, stream_input=True)
    optimizer = torch.optim.AdamW(student.parameters, lr=report.lr, weight_decay=options.weight_decay)
    best = [p.detach().clone() for p in student.parameters]  # memory: one copy of what trains

    def validate() -> float:
        total = count = 0.0
        for rows in validation_rows(cache, options.batch_size):
            with torch.no_grad(), autocast_for(options.precision, device, dense.dtype):
                out = suffix.model(inputs_embeds=prefix(rows, keep=True), use_cache=False,
                                   **stream_kwargs(suffix, prefix.ids[rows])).last_hidden_state
                log_probs, indices = cache.targets(rows)
                tokens = out.shape[0] * out.shape[1]
                total += distill_loss(student.model, out, log_probs, indices, loss=options.loss) * tokens
                count += tokens
        return total / count

    def checkpoint(done: int) -> bool:
        """Validate after `done` steps; True when the run should stop early."""
        value = validate()
        report.val.append((done, value))
        if value <= min(v for _, v in report.val):
            report.best_step = done
            for keep, p in zip(best, student.parameters):
                keep.copy_(p.detach())
        since = done - report.best_step
        return options.patience > 0 and since >= options.patience * every

    check_stop(should_stop, "distill")
    checkpoint(0)
    yield report
    for step in track(range(steps), f"distill {report.variant}", unit="steps", quiet=quiet):
        check_stop(should_stop, "distill")
        tick = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, report.lr, options.min_lr_factor, options.warmup)
        rows = training_rows(step, options.batch_size, len(cache.train_ids))
        with autocast_for(options.precision, device, dense.dtype):
            h = prefix(rows)
            out = suffix.model(inputs_embeds=h, use_cache=False,
                               **stream_kwargs(suffix, prefix.ids[rows])).last_hidden_state  # (B, T, C) normed
            if not out.requires_grad:
                raise RuntimeError(f"{report.variant}: the trained weights do not reach the output")
            log_probs, indices = cache.targets(rows)
            loss = distill_loss(student.model, out, log_probs, indices, backward=True, loss=options.loss)
        if options.grad_clip:
            torch.nn.utils.clip_grad_norm_(student.parameters, options.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out, h
        report.train_seconds += time.perf_counter() - tick
        report.loss.append(loss)
        last = step + 1 == steps
        if (step + 1) % every == 0 or last:
            stop = checkpoint(step + 1)
            report.seconds = time.perf_counter() - started
            if stop and not last:
                report.stopped = "early stop"
                break
            yield report
    with torch.no_grad():
        for keep, p in zip(best, student.parameters):
            p.copy_(keep)
    del optimizer, best
    report.stopped = report.stopped or "budget"
    report.seconds = time.perf_counter() - started
    log.info("distilled %s: %d steps, validation KL %.4f → %.4f (best at step %d), %.2f s per step", report.variant,
             report.steps, report.start_val, report.best_val, report.best_step,
             report.train_seconds / max(report.steps, 1))
    yield report
