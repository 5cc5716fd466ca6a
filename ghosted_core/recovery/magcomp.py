"""Prune&Comp's magnitude compensation (arXiv 2507.18212): one scalar s per cut, from per-channel sums.

Removing blocks s…s+n−1 feeds h_s where the dense model fed h_{s+n}, whose magnitude is larger
(blocks add to the stream). The compensation scales the stream entering the cut by one scalar,
carried exactly by the weights upstream (`model.scaling.scale_before`; the stock fold is in
`export.fold`). No C×C statistic: the scalar comes from Σ_t |x_pre| and Σ_t |x_post| per channel,
which calibration keeps for `diag` anyway (`StatNeeds(channel=True)`, 10·C·8 B per boundary).

The forms (`MAGCOMP_FORMS`), over all calibration tokens or over ordinary tokens only (`_ordinary`,
sinks left out, as DESIGN §1 does for the least-squares fits):
- "global": Σ_{t,c} |x_post| / Σ_{t,c} |x_pre|, the ratio of mean magnitudes (issue 18's formula);
- "channel": mean over channels of Σ_t |x_post|_c / Σ_t |x_pre|_c, the reference code's mean of
  per-channel ratios. The reference also averages each channel's ratio over calibration windows;
  here the sums are pooled over all windows first (no per-window record is kept), and a channel
  whose Σ|x_pre| is 0 is left out instead of giving inf.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ghosted_core.errors import GhostedError
from ghosted_core.model.scaling import scale_before
from ghosted_core.plan import Boundary
from ghosted_core.statistics import BoundaryStats

log = logging.getLogger(__name__)

MAGCOMP_FORMS = ("global", "global_ordinary", "channel", "channel_ordinary")


def magnitude_scale(stats: BoundaryStats, form: str = "global") -> float:
    """The compensation scalar s of one boundary from its channel-basis sums (see the module docstring)."""
    if form not in MAGCOMP_FORMS:
        raise GhostedError(f"unknown magnitude-compensation form {form!r}; use one of {', '.join(MAGCOMP_FORMS)}")
    sums = stats.channel
    if sums is None:
        raise GhostedError(f"boundary {stats.boundary}: magcomp needs the per-channel sums, which were not collected "
                           f"(statistics asked for: {stats.needs.describe()})")
    rows = slice(0, 1) if form.endswith("_ordinary") else slice(None)
    pre, post = sums.abs_x[rows].sum(0), sums.abs_y[rows].sum(0)  # (C,) Σ_t |x_pre|, Σ_t |x_post|
    if form.startswith("global"):
        total = float(pre.sum())
        scale = float(post.sum()) / total if total > 0 else 1.0
    else:
        used = pre > 0
        scale = float((post[used] / pre[used]).mean()) if bool(used.any()) else 1.0
    if not torch.isfinite(torch.tensor(scale)) or scale <= 0:
        raise GhostedError(f"boundary {stats.boundary}: the magnitude ratio is {scale}; give more calibration text")
    return scale


def cut_index(start: int, removed: Sequence[int]) -> int:
    """The index, in a pruned view's layer list, of the first block after the cut whose first removed block is
    dense block `start` (the scale's site: blocks before it carry the scale)."""
    return start - sum(1 for j in set(removed) if j < start)


def compensate(model: PreTrainedModel, boundary: Boundary, removed: Sequence[int], scale: float) -> PreTrainedModel:
    """A view of the pruned `model` (blocks `removed` gone) with the stream entering `boundary`'s cut scaled by
    `scale`, carried by the embeddings and every writer upstream (what the stock export folds)."""
    return scale_before(model, cut_index(boundary.start, removed), scale)
