"""One streamed pass over calibration tokens → the statistics every boundary operator needs.

Steps, per batch of token windows:
1. `capture` hooks the residual stream entering the blocks we need (and the MLP branch
   output of the block before each boundary, for ReplaceMe), and stops the forward pass
   right after the last of them: nothing downstream is computed.
2. Tokens are split into ordinary tokens and massive-activation "sink" tokens (norm far
   above the batch median, or a fixed position), and into fit and held-out sequences.
3. Each group accumulates float64 moments (XᵀX, XᵀΔ, ‖Δ‖², per-channel abs sums, …): memory
   is O(C²) per boundary whatever the number of tokens, and no activation is kept.

`collect_stats` does it for every boundary at once from the dense model (the paper's
independent fit); `collect_boundary_stats` takes the inputs of one boundary from another
model (an already pruned-and-recovered view) for the `sequential` fit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard, hadamard_factors
from ghosted_core.plan import Boundary
from ghosted_core.surgery import unwrap

log = logging.getLogger(__name__)

STATS_DTYPE = torch.float64  # every statistic is accumulated in float64, whatever the model's dtype


# ---------------------------------------------------------------- hooks: the only place they live


class _StopForward(Exception):
    """Raised by a capture hook once everything needed was seen: ends the forward early."""


def branch_module(block: nn.Module) -> nn.Module:
    """The module whose output is the MLP branch added to the residual (ReplaceMe regresses it).

    Gemma3 normalizes the MLP output (`post_feedforward_layernorm`) before adding it.
    """
    block = unwrap(block)
    post_norm = getattr(block, "post_feedforward_layernorm", None)
    return block.mlp if post_norm is None else post_norm


@contextlib.contextmanager
def capture(model: PreTrainedModel, residuals: Iterable[int], branches: Iterable[int] = (),
            on_tensor: Callable[[tuple[str, int], torch.Tensor], None] | None = None) -> Iterator[dict]:
    """Hook `model` to record residual streams and MLP branch outputs during `run_forward`.

    `residuals`: layer-list indices whose incoming residual (as the block sees it, after any
    boundary operator) is wanted; index len(layers) means the input of the final norm.
    `branches`: layer-list indices whose MLP branch output is wanted. Tensors go to
    `on_tensor(key, tensor)` if given, else into the yielded dict under ("residual", j) /
    ("branch", j). Hooks fire only in the thread that opened the context (other users of a
    shared model are not disturbed) and are removed on exit, whatever happens.
    """
    residuals, branches = sorted(set(residuals)), sorted(set(branches))
    layers = model.model.layers
    store: dict[tuple[str, int], torch.Tensor] = {}
    sink = on_tensor or store.__setitem__
    owner = threading.get_ident()
    last = max([*residuals, *(j + 1 for j in branches)], default=-1)
    handles = []

    def residual_hook(j: int):
        def hook(_module, args, kwargs):
            if threading.get_ident() != owner:
                return None
            sink(("residual", j), (args[0] if args else kwargs["hidden_states"]).detach())
            if j == last:
                raise _StopForward
            return None
        return hook

    def branch_hook(j: int):
        def hook(_module, _args, output):
            if threading.get_ident() == owner:
                sink(("branch", j), (output[0] if isinstance(output, tuple) else output).detach())
        return hook

    try:
        for j in residuals:
            target = unwrap(layers[j]) if j < len(layers) else unwrap(model.model.norm)
            handles.append(target.register_forward_pre_hook(residual_hook(j), with_kwargs=True))
        for j in branches:
            handles.append(branch_module(layers[j]).register_forward_hook(branch_hook(j)))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def run_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """A cache-free forward of the base model (no LM head) that ends early at a capture's last hook."""
    device = model.model.embed_tokens.weight.device
    if device.type == "meta":  # offloaded embeddings: accelerate moves inputs itself
        device = input_ids.device
    with torch.no_grad():
        try:
            model.model(input_ids=input_ids.to(device),
                        attention_mask=None if attention_mask is None else attention_mask.to(device),
                        use_cache=False)
        except _StopForward:
            pass


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Moments:
    """Sums over one set of tokens at one boundary (float64; rows are tokens, C columns)."""

    tokens: int
    xtx: torch.Tensor  # (C, C) X_preᵀ X_pre
    xtd: torch.Tensor  # (C, C) X_preᵀ Δ,  Δ = X_post − X_pre
    dd: torch.Tensor  # () ‖Δ‖²_F
    abs_pre: torch.Tensor  # (C,) Σ_t |X_pre|
    abs_post: torch.Tensor  # (C,) Σ_t |X_post|
    abs_pre_rot: torch.Tensor | None  # (C,) Σ_t |X_pre H|   (None: no Hadamard for this C)
    abs_post_rot: torch.Tensor | None  # (C,) Σ_t |X_post H|
    mtm: torch.Tensor | None  # (C, C) mᵀm, m = MLP branch output of block s−1 (None at s = 0)
    mtd: torch.Tensor | None  # (C, C) mᵀΔ

    def __add__(self, other: Moments) -> Moments:
        def add(a, b):
            return None if a is None or b is None else a + b
        return Moments(**{f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


class _MomentSum:
    """Mutable float64 accumulator behind a `Moments`."""

    def __init__(self, width: int, device: torch.device, rotation: torch.Tensor | None, with_branch: bool):
        def zeros(*shape):
            return torch.zeros(*shape, dtype=STATS_DTYPE, device=device)
        self.rotation = rotation
        self.tokens = 0
        self.xtx, self.xtd, self.dd = zeros(width, width), zeros(width, width), zeros(())
        self.abs_pre, self.abs_post = zeros(width), zeros(width)
        self.abs_pre_rot = zeros(width) if rotation is not None else None
        self.abs_post_rot = zeros(width) if rotation is not None else None
        self.mtm = zeros(width, width) if with_branch else None
        self.mtd = zeros(width, width) if with_branch else None

    def add(self, x_pre: torch.Tensor, x_post: torch.Tensor, branch: torch.Tensor | None) -> None:
        x = x_pre.to(STATS_DTYPE)  # (T, C)
        delta = x_post.to(STATS_DTYPE) - x  # (T, C)
        self.tokens += x.shape[0]
        self.xtx += x.T @ x
        self.xtd += x.T @ delta
        self.dd += (delta * delta).sum()
        self.abs_pre += x.abs().sum(0)
        self.abs_post += (x + delta).abs().sum(0)
        if self.rotation is not None:
            self.abs_pre_rot += (x @ self.rotation).abs().sum(0)
            self.abs_post_rot += ((x + delta) @ self.rotation).abs().sum(0)
        if self.mtm is not None and branch is not None:
            m = branch.to(STATS_DTYPE)  # (T, C)
            self.mtm += m.T @ m
            self.mtd += m.T @ delta

    def freeze(self) -> Moments:
        return Moments(**{f.name: getattr(self, f.name) for f in fields(Moments)})


@dataclass(frozen=True)
class BoundaryStats:
    """Everything the operators need at one boundary, split by token group."""

    boundary: Boundary
    fit_ordinary: Moments  # calibration tokens that are not sinks
    fit_sink: Moments  # calibration tokens flagged as massive activations
    fit_sink_capped: Moments  # the same sink tokens, each scaled down to the sink threshold norm
    heldout_ordinary: Moments | None  # held-out sequences (None when none were held out)
    heldout_sink: Moments | None
    sink_rule: str  # how sinks were found, for reports

    @property
    def fit(self) -> Moments:
        """All calibration tokens (what the paper's fit uses)."""
        return self.fit_ordinary + self.fit_sink

    @property
    def heldout(self) -> Moments | None:
        if self.heldout_ordinary is None:
            return None
        return self.heldout_ordinary + self.heldout_sink

    @property
    def has_branch(self) -> bool:
        return self.fit_ordinary.mtm is not None

    def merged(self, other: BoundaryStats) -> BoundaryStats:
        """The statistics of both token sets (sums are additive: calibration can grow in steps)."""
        def add(a: Moments | None, b: Moments | None) -> Moments | None:
            return b if a is None else a if b is None else a + b
        return BoundaryStats(self.boundary, self.fit_ordinary + other.fit_ordinary, self.fit_sink + other.fit_sink,
                             self.fit_sink_capped + other.fit_sink_capped,
                             add(self.heldout_ordinary, other.heldout_ordinary), add(self.heldout_sink, other.heldout_sink),
                             self.sink_rule)

    @property
    def width(self) -> int:
        return self.fit_ordinary.xtx.shape[0]


@dataclass(frozen=True)
class CalibrationOptions:
    """How tokens are grouped while statistics stream in."""

    sink_rule: str = "norm"  # "norm": ‖x‖ > sink_ratio · batch median; "position": the first sink_positions tokens; "none"
    sink_ratio: float = 10.0  # a token is a sink when its residual norm exceeds this multiple of the batch median
    sink_positions: int = 1  # for sink_rule="position"
    batch_size: int = 8  # sequences per forward pass
    quiet: bool = False  # hide progress bars

    def __post_init__(self) -> None:
        if self.sink_rule not in {"norm", "position", "none"}:
            raise GhostedError(f"unknown sink rule {self.sink_rule!r}; use norm, position or none")


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
    """Token windows for one forward pass; `heldout` sequences only feed the held-out moments."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) 1 = real token, 0 = padding
    heldout: bool


def make_batches(fit_ids: torch.Tensor, heldout_ids: torch.Tensor | None, batch_size: int) -> list[CalibrationBatch]:
    """Split fit and held-out windows into forward-pass batches (no padding: windows are full)."""
    batches = [CalibrationBatch(chunk, None, False) for chunk in fit_ids.split(batch_size)]
    if heldout_ids is not None and len(heldout_ids):
        batches += [CalibrationBatch(chunk, None, True) for chunk in heldout_ids.split(batch_size)]
    return batches


class BoundaryAccumulator:
    """The token groups of one boundary: fit/held-out × ordinary/sink, plus capped sinks (fit only)."""

    def __init__(self, boundary: Boundary, options: CalibrationOptions):
        self.boundary = boundary
        self.options = options
        self.groups: dict[tuple[bool, str], _MomentSum] = {}

    def _group(self, heldout: bool, kind: str, like: torch.Tensor) -> _MomentSum:
        if (heldout, kind) not in self.groups:
            width = like.shape[-1]
            rotation = None
            if hadamard_factors(width) is not None:
                rotation = torch.from_numpy(hadamard(width).copy()).to(like.device)
            kinds = ("ordinary", "sink") if heldout else ("ordinary", "sink", "sink_capped")
            for name in kinds:  # the groups of a split exist together, even when one stays empty
                self.groups[(heldout, name)] = _MomentSum(width, like.device, rotation, self.boundary.start > 0)
        return self.groups[(heldout, kind)]

    def add(self, x_pre: torch.Tensor, x_post: torch.Tensor, branch: torch.Tensor | None,
            valid: torch.Tensor, heldout: bool) -> None:
        x_post = x_post.to(x_pre.device)
        valid = valid.to(x_pre.device)
        branch = None if branch is None else branch.to(x_pre.device)
        sinks = sink_mask(x_pre, x_post, valid, self.options)

        def rows(mask: torch.Tensor, scale: torch.Tensor | None = None):
            picked = [x_pre[mask], x_post[mask], None if branch is None else branch[mask]]
            if scale is not None:  # scaling a token's x, x_post and m together reweights it in every fit
                factor = scale[mask].unsqueeze(-1).to(x_pre.dtype)  # (k, 1)
                picked = [None if t is None else t * factor for t in picked]
            return picked

        self._group(heldout, "ordinary", x_pre).add(*rows(valid & ~sinks))
        self._group(heldout, "sink", x_pre).add(*rows(sinks))
        if not heldout:
            cap = sink_cap(x_pre, x_post, valid, self.options)
            self._group(heldout, "sink_capped", x_pre).add(*rows(sinks, cap))

    def freeze(self) -> BoundaryStats:
        if (False, "ordinary") not in self.groups:
            raise GhostedError("no calibration tokens reached the statistics; give more calibration text")
        held = (True, "ordinary") in self.groups
        return BoundaryStats(
            boundary=self.boundary,
            fit_ordinary=self.groups[(False, "ordinary")].freeze(),
            fit_sink=self.groups[(False, "sink")].freeze(),
            fit_sink_capped=self.groups[(False, "sink_capped")].freeze(),
            heldout_ordinary=self.groups[(True, "ordinary")].freeze() if held else None,
            heldout_sink=self.groups[(True, "sink")].freeze() if held else None,
            sink_rule=self.options.sink_rule if self.options.sink_rule != "norm"
            else f"norm > {self.options.sink_ratio:g}x batch median",
        )


def _valid_mask(batch: CalibrationBatch) -> torch.Tensor:
    if batch.attention_mask is None:
        return torch.ones(batch.input_ids.shape, dtype=torch.bool)
    return batch.attention_mask.bool()


def collect_stats(dense: PreTrainedModel, boundaries: Sequence[Boundary], batches: Sequence[CalibrationBatch],
                  options: CalibrationOptions = CalibrationOptions()) -> list[BoundaryStats]:
    """Statistics for every boundary from one pass of the dense model (independent fit)."""
    if not boundaries:
        return []
    accumulators = [BoundaryAccumulator(b, options) for b in boundaries]
    residuals = {j for b in boundaries for j in (b.start, b.end)}
    branches = {b.start - 1 for b in boundaries if b.start > 0}
    for batch in tqdm(batches, desc="calibrate", disable=options.quiet, leave=False):
        with capture(dense, residuals, branches) as seen:
            run_forward(dense, batch.input_ids, batch.attention_mask)
        valid = _valid_mask(batch)
        for acc in accumulators:
            b = acc.boundary
            acc.add(seen[("residual", b.start)], seen[("residual", b.end)], seen.get(("branch", b.start - 1)),
                    valid, batch.heldout)
    return [acc.freeze() for acc in accumulators]


def collect_boundary_stats(source: PreTrainedModel, source_start: int, dense: PreTrainedModel, boundary: Boundary,
                           batches: Sequence[CalibrationBatch],
                           options: CalibrationOptions = CalibrationOptions()) -> BoundaryStats:
    """Statistics of one boundary with X_pre (and m) from `source` at its layer `source_start`
    and the target X_post from the dense model (the sequential fit)."""
    acc = BoundaryAccumulator(boundary, options)
    branches = {source_start - 1} if boundary.start > 0 else set()
    for batch in tqdm(batches, desc=f"calibrate {boundary} (sequential)", disable=options.quiet, leave=False):
        with capture(dense, {boundary.end}) as target:
            run_forward(dense, batch.input_ids, batch.attention_mask)
        with capture(source, {source_start}, branches) as seen:
            run_forward(source, batch.input_ids, batch.attention_mask)
        acc.add(seen[("residual", source_start)], target[("residual", boundary.end)],
                seen.get(("branch", source_start - 1)), _valid_mask(batch), batch.heldout)
    return acc.freeze()
