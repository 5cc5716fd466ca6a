"""One streamed pass over calibration tokens → the statistics each boundary's operators asked for.

Steps, per batch of token windows:
1. A calibration pipeline (`calibration.pipelines`: `full` or `blocks`) brings each boundary
   the residual entering its first removed block (x_pre), the one entering its first surviving
   block (x_post) and, for the ReplaceMe family, the MLP branch output m of the block before.
2. Tokens are split into ordinary tokens and massive-activation "sink" tokens (norm far above
   the batch median, or a fixed position), each sink with the cap factor that brings it down to
   the sink threshold.
3. Each boundary's `BoundarySums` accumulates only what `StatNeeds` asks for (statistics.py):
   float64 ordinary-token moments, per-channel sums, and the sink tokens as rows. Memory is
   O(C²) per boundary whatever the number of tokens, and no other activation is kept.

Held-out sequences do not feed the statistics: once the fits exist, `recovery.heldout.measure_errors`
streams them once more and measures each fit's boundary error directly.

`collect_stats` does every boundary at once from the dense model (the paper's independent
fit); `collect_boundary_stats` takes the inputs of one boundary from another model (an
already pruned-and-recovered view) for the `sequential` fit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ghosted_core.progress import track
from ghosted_core.calibration.pipelines import CALIBRATION_PIPELINES, get_pipeline
from ghosted_core.architectures import architecture_of
from ghosted_core.calibration.capture import capture, inner_folds, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.memory import choose_pipeline
from ghosted_core.model.loading import model_placement
from ghosted_core.plan import Boundary
from ghosted_core.statistics import ALL_NEEDS, PRODUCT_DTYPES, BoundarySums, BoundaryStats, StatNeeds

log = logging.getLogger(__name__)

SINK_ROWS_PER_SEQUENCE = 4  # default sink-row capacity per calibration sequence (a sink at position 0, a few delimiters)
MIN_SINK_CAPACITY = 64
STATS_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CalibrationOptions:
    """How tokens are grouped while statistics stream in, and where they are summed."""

    sink_rule: str = "norm"  # "norm": ‖x‖ > sink_ratio · batch median; "position": the first sink_positions tokens; "none"
    sink_ratio: float = 10.0  # a token is a sink when its residual norm exceeds this multiple of the batch median
    sink_positions: int = 1  # for sink_rule="position"
    batch_size: int = 8  # sequences per forward pass
    quiet: bool = False  # hide progress bars
    sink_capacity: int | None = None  # sink rows kept per boundary (None: 4 per calibration sequence, at least 64)
    stats_device: str = "auto"  # where sums live: "auto" (where the activations arrive), "cpu", "cuda" or "cuda:N"
    products: str = "float64"  # "float32": per-batch products in fp32, added into float64 sums (GPUs with slow FP64)
    pipeline: str = "auto"  # calibration pipeline: "full", "blocks" (see calibration.pipelines) or "auto" (memory.choose_pipeline)
    compute_device: str | None = None  # "blocks": where each block runs (None: the first block's device)
    keep_heldout: bool = False  # the run keeps the held-out rows from the calibration pass (the memory plan decides)

    def __post_init__(self) -> None:
        if self.sink_rule not in {"norm", "position", "none"}:
            raise GhostedError(f"unknown sink rule {self.sink_rule!r}; use norm, position or none")
        if self.products not in PRODUCT_DTYPES:
            raise GhostedError(f"unknown product precision {self.products!r}; use float64 or float32")
        if self.pipeline != "auto" and self.pipeline not in CALIBRATION_PIPELINES:
            raise GhostedError(f"unknown calibration pipeline {self.pipeline!r}; use {' or '.join(CALIBRATION_PIPELINES)}")
        if self.stats_device.split(":")[0] not in STATS_DEVICES:
            raise GhostedError(f"unknown statistics device {self.stats_device!r}; use auto, cpu or cuda")
        if self.batch_size < 1:
            raise GhostedError(f"--batch_size must be at least 1 (sequences per calibration forward pass; got {self.batch_size})")
        if not math.isfinite(self.sink_ratio) or self.sink_ratio <= 1:
            raise GhostedError(f"--sink_ratio must be a finite number above 1 (a multiple of the median token norm; "
                               f"got {self.sink_ratio})")
        if self.sink_capacity is not None and self.sink_capacity < 0:
            raise GhostedError(f"--sink_capacity must be at least 0 (got {self.sink_capacity})")

    @property
    def sink_label(self) -> str:
        return self.sink_rule if self.sink_rule != "norm" else f"norm > {self.sink_ratio:g}x batch median"

    def capacity(self, sequences: int) -> int:
        """Sink rows kept per boundary for `sequences` calibration sequences."""
        if self.sink_capacity is not None:
            return self.sink_capacity
        return max(MIN_SINK_CAPACITY, SINK_ROWS_PER_SEQUENCE * sequences)


def sink_mask(x_pre: torch.Tensor, x_post: torch.Tensor, valid: torch.Tensor, options: CalibrationOptions) -> torch.Tensor:
    """(B, T) bool: massive-activation tokens, which would otherwise dominate XᵀX and XᵀΔ."""
    if options.sink_rule == "none":
        return torch.zeros_like(valid)
    if options.sink_rule == "position":
        positions = torch.arange(valid.shape[1], device=valid.device)
        return (positions < options.sink_positions).expand_as(valid) & valid
    return (sink_cap(x_pre, x_post, valid, options) < 1) & valid


def sink_cap(x_pre: torch.Tensor, x_post: torch.Tensor, valid: torch.Tensor, options: CalibrationOptions) -> torch.Tensor:
    """(B, T) factor ≤ 1 that brings each token's norm (of X_pre and of X_post) down to the sink threshold,
    sink_ratio × the batch median norm; 1 for tokens already below it."""
    cap = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
    for x in (x_pre, x_post):
        norms = x.float().norm(dim=-1)  # (B, T)
        threshold = options.sink_ratio * norms[valid].median()
        cap = torch.minimum(cap, threshold / norms.clamp_min(1e-30))
    return cap.clamp(max=1.0)


@dataclass(frozen=True)
class CalibrationBatch:
    """Token windows for one forward pass; `heldout` sequences only serve the held-out boundary errors."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token, 0 = padding
    heldout: bool


def make_batches(fit_ids: torch.Tensor, heldout_ids: torch.Tensor | None, batch_size: int) -> list[CalibrationBatch]:
    """Split fit and held-out windows into forward-pass batches (no padding: windows are full)."""
    batches = [CalibrationBatch(chunk, None, False) for chunk in fit_ids.split(batch_size)]
    if heldout_ids is not None and len(heldout_ids):
        batches += [CalibrationBatch(chunk, None, True) for chunk in heldout_ids.split(batch_size)]
    return batches


def valid_mask(batch: CalibrationBatch) -> torch.Tensor:
    if batch.attention_mask is None:
        return torch.ones(batch.input_ids.shape, dtype=torch.bool)
    return batch.attention_mask.bool()


def pipeline_name(options: CalibrationOptions, model: PreTrainedModel) -> str:
    """The pipeline that runs: as asked, or, for an "auto" no memory plan resolved, the plan's own rule
    (`memory.choose_pipeline`) for where `model` already is."""
    return choose_pipeline(options.pipeline, model_placement(model)[0], torch.cuda.is_available())


def resolve_stats_device(options: CalibrationOptions, arriving: torch.device) -> torch.device:
    """Where a boundary's sums live: as asked, or where its activations arrive ("auto")."""
    if options.stats_device == "auto":
        return arriving
    if options.stats_device.startswith("cuda") and not torch.cuda.is_available():
        raise GhostedError("--stats_device cuda asked for, but no CUDA GPU is visible; use --stats_device cpu or auto")
    return torch.device(options.stats_device)


class BoundaryAccumulator:
    """Sink detection plus the running sums of one boundary, created at its first batch."""

    def __init__(self, boundary: Boundary, options: CalibrationOptions, needs: StatNeeds = ALL_NEEDS,
                 sequences: int = 0):
        self.boundary = boundary
        self.options = options
        self.needs = needs
        self.capacity = options.capacity(sequences)
        self.sums: BoundarySums | None = None

    def add(self, x_pre: torch.Tensor, x_post: torch.Tensor, branch: torch.Tensor | None, valid: torch.Tensor,
            inner: torch.Tensor | None = None) -> None:
        """One batch: x_pre, x_post, branch (B, T, C), valid (B, T) bool (False = padding), inner (B, T, I)."""
        if self.sums is None:
            device = resolve_stats_device(self.options, x_pre.device)
            self.sums = BoundarySums(self.boundary, x_pre.shape[-1], device, self.needs, self.capacity,
                                     self.options.products)
        x_post = x_post.to(x_pre.device)
        valid = valid.to(x_pre.device)
        sinks = sink_mask(x_pre, x_post, valid, self.options)
        cap = sink_cap(x_pre, x_post, valid, self.options) if self.needs.sink_rows and sinks.any() \
            else torch.ones(valid.shape, device=valid.device)
        if valid.all():  # no padding: (B·T, C) views, no copy

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(-1, *t.shape[2:])
        else:

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t[valid]
        branch = None if branch is None else pick(branch.to(x_pre.device))
        inner = None if inner is None else pick(inner.to(x_pre.device))
        window = pick(torch.arange(valid.shape[0], device=valid.device)[:, None].expand(valid.shape))  # each row's window
        self.sums.add(pick(x_pre), pick(x_post), branch, pick(sinks), pick(cap), inner, window)

    def nbytes(self) -> int:
        return 0 if self.sums is None else self.sums.nbytes()

    def freeze(self) -> BoundaryStats:
        if self.sums is None or self.sums.tokens == [0, 0]:
            raise GhostedError("no calibration tokens reached the statistics; give more calibration text")
        return self.sums.freeze(self.options.sink_label)


class HeldoutRows:
    """The held-out batches' boundary activations, kept from the calibration pass, so that the held-out
    errors need no second pass over the model (`recovery.heldout.measure_errors`).

    Memory: held-out tokens × dtype bytes × (2·C, + C with the MLP branch, + I with the down_proj
    refit's intermediate) per boundary, where the activations arrive (references to the captured
    tensors; indices boundaries share are kept once).
    """

    def __init__(self) -> None:
        self.rows: dict[Boundary, list[tuple[CalibrationBatch, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                             torch.Tensor | None]]] = {}
        self.branch = False  # the MLP branch was captured
        self.inner = False  # the down_proj inputs were captured

    def add(self, boundary: Boundary, batch: CalibrationBatch, x_pre: torch.Tensor, x_post: torch.Tensor,
            branch: torch.Tensor | None, inner: torch.Tensor | None = None) -> None:
        self.rows.setdefault(boundary, []).append((batch, x_pre, x_post, branch, inner))

    def covers(self, boundaries: Sequence[Boundary], branch: bool, inner: bool = False) -> bool:
        """Whether every boundary's rows are here (with the branch and the intermediate where a fit needs them)."""
        return all(b in self.rows for b in boundaries) and (self.branch or not branch) and (self.inner or not inner)

    def nbytes(self) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for rows in self.rows.values() for _, *tensors in rows for t in tensors if t is not None}
        return sum(seen.values())


def family_needs(needs: StatNeeds, config) -> StatNeeds:
    """`needs` less what the model's family cannot give: branch statistics where no single module computes the MLP
    branch (the operators that read them are refused before any work there; a caller asking for every statistic
    gets the rest)."""
    if needs.branch and architecture_of(config).branch is None:
        return dataclasses.replace(needs, branch=False)
    return needs


def collect_stats(dense: PreTrainedModel, boundaries: Sequence[Boundary], batches: Sequence[CalibrationBatch],
                  options: CalibrationOptions = CalibrationOptions(), needs: StatNeeds = ALL_NEEDS,
                  accumulators: list[BoundaryAccumulator] | None = None,
                  heldout: HeldoutRows | None = None) -> list[BoundaryStats]:
    """Statistics for every boundary from one pass of the dense model (independent fit).

    `needs` (see `recovery.operators.needs_of`) says which statistics to keep. Held-out batches
    never feed the statistics: they are skipped (their errors are measured directly once the fits
    exist, with a pass of their own), or, given `heldout`, they join this pass and their boundary
    activations are kept there for that measurement. Statistics are strictly per boundary, so the
    boundaries of several plans can share one pass. `accumulators`, if given, receives the live
    accumulators (the memory bench reads their allocated bytes).
    """
    if not boundaries:
        return []
    needs = family_needs(needs, dense.config)
    fit_batches = [b for b in batches if not b.heldout]
    sequences = sum(len(b.input_ids) for b in fit_batches)
    live = [BoundaryAccumulator(b, options, needs, sequences) for b in boundaries]
    if accumulators is not None:
        accumulators.extend(live)
    if heldout is not None:
        heldout.branch, heldout.inner = needs.branch, needs.inner

    def consume(k: int, batch: CalibrationBatch, x_pre: torch.Tensor, x_post: torch.Tensor, branch, inner) -> None:
        if batch.heldout:
            heldout.add(boundaries[k], batch, x_pre, x_post, branch, inner)
        else:
            live[k].add(x_pre, x_post, branch, valid_mask(batch), inner)

    compute = None if options.compute_device is None else torch.device(options.compute_device)
    passed = fit_batches if heldout is None else list(batches)
    get_pipeline(pipeline_name(options, dense)).run(dense, list(boundaries), needs.branch, passed, consume, compute,
                                                    options.quiet, needs.inner)
    stats = [acc.freeze() for acc in live]
    for s in stats:
        for note in s.notes:
            log.warning(note)
    return stats


def collect_boundary_stats(source: PreTrainedModel, source_start: int, dense: PreTrainedModel, boundary: Boundary,
                           batches: Sequence[CalibrationBatch], options: CalibrationOptions = CalibrationOptions(),
                           needs: StatNeeds = ALL_NEEDS) -> BoundaryStats:
    """Statistics of one boundary with X_pre (and m) from `source` at its layer `source_start`
    and the target X_post from the dense model (the sequential fit; two `full` forwards per batch)."""
    needs = family_needs(needs, source.config)
    fit_batches = [b for b in batches if not b.heldout]
    acc = BoundaryAccumulator(boundary, options, needs, sum(len(b.input_ids) for b in fit_batches))
    before = {source_start - 1} if boundary.start > 0 else set()
    branches = before if needs.branch else set()
    inners = before if needs.inner and inner_folds(source) else set()
    for batch in track(fit_batches, f"calibrate {boundary} (sequential)", unit="batches", quiet=options.quiet):
        with capture(dense, {boundary.end}) as target:
            run_forward(dense, batch.input_ids, batch.attention_mask)
        with capture(source, {source_start}, branches, inners=inners) as seen:
            run_forward(source, batch.input_ids, batch.attention_mask)
        acc.add(seen[("residual", source_start)], target[("residual", boundary.end)],
                seen.get(("branch", source_start - 1)), valid_mask(batch), seen.get(("inner", source_start - 1)))
    return acc.freeze()
