"""Held-out boundary errors measured directly, once the fits exist: no held-out C×C moments.

The held-out sequences stream through the model once more (through the same calibration
pipeline as the statistics), or their rows come from the calibration pass that kept them
(`calibration.collect.HeldoutRows`: no pass); at each boundary every fit is applied to the token rows and
‖x_pre W − x_post‖² is summed over all tokens and over ordinary (non-sink) tokens. Memory:
one batch's rows (T·C·8 B, and T·I·8 B of the MLP intermediate for refits) per fit at a time, plus
the fits themselves; time O(T·C²) per fit (O(T·I·C) per refit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ghosted_core.calibration.collect import CalibrationBatch, CalibrationOptions, HeldoutRows, pipeline_name, \
    sink_mask, valid_mask
from ghosted_core.calibration.pipelines import get_pipeline
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.recovery.assessment import BoundaryMap
from ghosted_core.recovery.operators import Fit
from ghosted_core.statistics import STATS_DTYPE, BoundaryErrors


class _ErrorSums:
    """Running squared errors of one map: [all, ordinary] for the map and for plain pruning."""

    def __init__(self, target: BoundaryMap):
        self.target = target
        self.sums = torch.zeros(2, 2, dtype=STATS_DTYPE)  # rows: map error, ‖Δ‖²; columns: all, ordinary
        self.tokens = [0, 0]

    def add(self, x: torch.Tensor, m: torch.Tensor | None, d: torch.Tensor, ordinary: torch.Tensor,
            a: torch.Tensor | None = None) -> None:
        error = self.target.error_rows(x, m, d, a)  # (T, C), our own
        fit_sq = error.square_().sum(-1) if error is not None else torch.full_like(d[:, 0], float("nan"))
        per_token = torch.stack([fit_sq, torch.einsum("tc,tc->t", d, d)])  # (2, T), no (T, C) temporary
        self.sums[:, 0] += per_token.sum(-1).cpu()
        self.sums[:, 1] += per_token[:, ordinary].sum(-1).cpu()
        self.tokens[0] += int(ordinary.numel())
        self.tokens[1] += int((~ordinary).sum())

    def freeze(self) -> BoundaryErrors:
        s = self.sums.tolist()
        return BoundaryErrors(self.tokens[0], self.tokens[1], s[0][0], s[0][1], s[1][0], s[1][1])


def _rows(x_pre: torch.Tensor, x_post: torch.Tensor, branch: torch.Tensor | None, batch: CalibrationBatch,
          options: CalibrationOptions, device: torch.device, inner: torch.Tensor | None = None):
    """float64 (T, C) rows of the valid tokens (a: (T, I)) and their ordinary-token mask, on `device`."""
    x_post = x_post.to(x_pre.device)
    valid = valid_mask(batch).to(x_pre.device)
    ordinary = ~sink_mask(x_pre, x_post, valid, options)[valid]  # (T,)
    full = bool(valid.all())

    def pick(t: torch.Tensor) -> torch.Tensor:  # the valid rows: a (T, ·) view without padding, else a copy
        t = t.to(x_pre.device)
        return t.reshape(-1, t.shape[-1]) if full else t[valid]

    x = pick(x_pre).to(device, STATS_DTYPE)  # (T, C)
    d = pick(x_post).to(device, STATS_DTYPE, copy=True).sub_(x)  # (T, C), never the captured tensor itself
    m = None if branch is None else pick(branch).to(device, STATS_DTYPE)
    a = None if inner is None else pick(inner).to(device, STATS_DTYPE)  # (T, I): T·I·8 B, no model-dtype copy first
    return x, m, d, ordinary.to(device), a


def measure_errors(dense: PreTrainedModel, fits: Sequence[Fit | BoundaryMap], batches: Sequence[CalibrationBatch],
                   options: CalibrationOptions = CalibrationOptions(), source: PreTrainedModel | None = None,
                   source_start: int | None = None, kept: HeldoutRows | None = None) -> list[BoundaryErrors | None]:
    """Boundary errors of each fit on the held-out batches (None for all when there are none).

    Fits may be given as `BoundaryMap`s (what the pipeline keeps once the variants are built).
    Every fit's boundary comes from the dense model in one pass, fits of several variants and
    depths together, or from `kept` (the rows the calibration pass kept: no pass at all; the
    same activations, so the same errors). With `source` (the sequential fit: one fit), x_pre and
    m come from that model's layer `source_start` and x_post from the dense model.
    """
    held = [b for b in batches if b.heldout]
    if not held or not fits:
        return [None] * len(fits)
    sums = [_ErrorSums(f if isinstance(f, BoundaryMap) else BoundaryMap.of(f)) for f in fits]
    branches = any(f.site == "branch" for f in fits)
    inners = any(f.site == "inner" for f in fits)
    if source is not None:
        (only,) = sums
        boundary = only.target.boundary
        before = {source_start - 1} if boundary.start > 0 else set()
        for batch in held:
            with capture(dense, {boundary.end}) as target:
                run_forward(dense, batch.input_ids, batch.attention_mask)
            with capture(source, {source_start}, before if branches else (), inners=before if inners else ()) as seen:
                run_forward(source, batch.input_ids, batch.attention_mask)
            x_pre = seen[("residual", source_start)]
            only.add(*_rows(x_pre, target[("residual", boundary.end)], seen.get(("branch", source_start - 1)), batch,
                            options, x_pre.device, seen.get(("inner", source_start - 1))))
        return [only.freeze()]
    boundaries = list(dict.fromkeys(f.boundary for f in fits))
    by_boundary = {b: [s for s in sums if s.target.boundary == b] for b in boundaries}

    def consume(k: int, batch: CalibrationBatch, x_pre: torch.Tensor, x_post: torch.Tensor, branch, inner) -> None:
        device = x_pre.device if options.stats_device == "auto" else torch.device(options.stats_device)
        rows = _rows(x_pre, x_post, branch, batch, options, device, inner)
        for s in by_boundary[boundaries[k]]:
            s.add(*rows)

    if kept is not None and kept.covers(boundaries, branches, inners):
        for k, boundary in enumerate(boundaries):
            for batch, x_pre, x_post, branch, inner in kept.rows[boundary]:
                consume(k, batch, x_pre, x_post, branch, inner)
        return [s.freeze() for s in sums]
    compute = None if options.compute_device is None else torch.device(options.compute_device)
    get_pipeline(pipeline_name(options, dense)).run(dense, boundaries, branches, held, consume, compute, True, inners)
    return [s.freeze() for s in sums]
