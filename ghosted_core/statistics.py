"""Boundary statistics proportional to what was asked: records, accumulators and their byte counts.

What a boundary keeps depends on `StatNeeds`, the union of what the requested operators
declare (see `recovery.operators.needs_of`):
- ordinary-token moments in float64: XᵀX and XᵀΔ only for least-squares residual fits,
  mᵀm and mᵀΔ only for the ReplaceMe family (memory 2·C²·8 B per pair, whatever the tokens);
  aᵀa (I×I) and aᵀΔ (I×C) only for the down_proj refit, a = the input of block s−1's down_proj
  (I = intermediate size; memory (I² + I·C)·8 B, 1.6 GB + 0.5 GB at I = 14336, C = 4096), and
  aᵀX_pre (I×C) when the refit also compensates the magnitude;
- per-channel sums (|x|, |y|, x², x·y, y², C each) in the channel basis for diag and in the
  Hadamard basis for rotate, for ordinary and sink tokens (they give both the fit and its error),
  and, per basis, the sum over calibration windows of each window's own ratio Σ|x_post| / Σ|x_pre|
  (C) with the window count: LinearPatch's rule averages per-window ratios (layer_select.py
  `get_scale_params`), which pooled sums cannot give afterwards;
- the massive-activation ("sink") tokens as rows: x_pre, Δ and (for the ReplaceMe family) m,
  (for the refit) a, float64, with each row's cap factor, in buffers of a fixed capacity (memory
  capacity·C·8 B per kind, capacity·I·8 B for a). Sinks beyond the capacity spill into C×C sink
  moments (and an I×I Gram of their a rows), allocated then, with a note.
The all-token fit (paper ghost), the capped fit and the sink-free fit are all derived at fit
time from the ordinary moments plus the sink rows; nothing else is C×C.

`statistics_bytes` is the formula the memory plan adds up; `BoundarySums.nbytes` is what was
actually allocated, and a test holds one against the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard_factors, hadamard_transform
from ghosted_core.products import add_gram, add_product, symmetrize
from ghosted_core.plan import Boundary

STATS_DTYPE = torch.float64  # every statistic is summed in float64, whatever the model's dtype
STATS_ITEM = 8  # bytes per float64 entry
PRODUCT_DTYPES = {"float64": torch.float64, "float32": torch.float32}
DEFAULT_SINK_CAPACITY = 256  # sink rows kept per boundary when the caller does not size it


@dataclass(frozen=True)
class StatNeeds:
    """Which statistics a boundary accumulates; the union over the requested operators."""

    residual: bool = False  # ordinary XᵀX, XᵀΔ (least-squares fits on the residual stream: ghost family)
    branch: bool = False  # ordinary mᵀm, mᵀΔ, m = block s−1's MLP output (ReplaceMe family)
    channel: bool = False  # per-channel sums in the channel basis (diag)
    rotated: bool = False  # per-channel sums in the Hadamard basis (rotate)
    inner: bool = False  # ordinary aᵀa (I×I), aᵀΔ (I×C), a = block s−1's down_proj input, + sink rows of a (the refit)
    inner_stream: bool = False  # ordinary aᵀX_pre (I×C): a refit that also scales the stream (magcomp_refit)

    def __or__(self, other: StatNeeds) -> StatNeeds:
        return StatNeeds(**{f.name: getattr(self, f.name) or getattr(other, f.name) for f in fields(self)})

    @property
    def sink_rows(self) -> bool:
        """Rows are kept for the C×C (and I×C) fits; per-channel sums split sinks off without rows."""
        return self.residual or self.branch or self.inner

    def describe(self) -> str:
        return ", ".join(f.name for f in fields(self) if getattr(self, f.name)) or "token counts only"


ALL_NEEDS = StatNeeds(True, True, True, True, True, True)


def statistics_bytes(width: int, needs: StatNeeds, sink_capacity: int, branch: bool = True, inner_width: int = 0) -> int:
    """Bytes one boundary's accumulator allocates (the formula the memory plan adds up).

    `branch`: whether this boundary has a block before it (ReplaceMe and refit statistics exist only then).
    `inner_width`: I, the intermediate size whose down_proj the refit changes (0: the refit's statistics are
    not collected, e.g. where a norm follows the MLP). Spilled sink moments (allocated only past the
    capacity) are not counted: the run notes them.
    """
    c, i = width, inner_width if needs.inner and branch else 0
    with_branch = needs.branch and branch
    matrices = 2 * needs.residual + 2 * with_branch  # (C, C) each
    bases = needs.channel + (needs.rotated and hadamard_factors(c) is not None)
    vectors = (5 * 2 + 1) * bases  # (C,) each: five sums × (ordinary, sinks), and the per-window ratio sum
    inner = i * i + i * c * (1 + needs.inner_stream) if i else 0  # aᵀa (I, I), aᵀΔ and aᵀX_pre (I, C)
    rows = 0
    if needs.sink_rows:
        kinds = 2 + with_branch  # x_pre, Δ (and m): (capacity, C) each
        rows = sink_capacity * (kinds * c + i + 1)  # + a (capacity, I) + the cap factor per row
    scalars = 2 + bases  # ‖Δ‖² of ordinary and sink tokens, a window count per basis
    return STATS_ITEM * (matrices * c * c + vectors * c + inner + rows + scalars)


# ---------------------------------------------------------------- frozen records


@dataclass(frozen=True)
class Moments:
    """Second moments over one set of tokens (float64; rows are tokens, C columns). None: not accumulated."""

    tokens: int
    dd: float  # ‖Δ‖²_F, Δ = X_post − X_pre
    xtx: torch.Tensor | None = None  # (C, C) X_preᵀ X_pre
    xtd: torch.Tensor | None = None  # (C, C) X_preᵀ Δ
    mtm: torch.Tensor | None = None  # (C, C) mᵀm, m = MLP branch output of block s−1
    mtd: torch.Tensor | None = None  # (C, C) mᵀΔ
    ata: torch.Tensor | None = None  # (I, I) aᵀa, a = block s−1's down_proj input
    atd: torch.Tensor | None = None  # (I, C) aᵀΔ
    atx: torch.Tensor | None = None  # (I, C) aᵀX_pre

    def __add__(self, other: Moments) -> Moments:
        def add(a, b):
            return a if b is None else b if a is None else a + b
        return Moments(self.tokens + other.tokens, self.dd + other.dd,
                       *(add(getattr(self, n), getattr(other, n)) for n in MOMENT_MATRICES))


MOMENT_MATRICES = ("xtx", "xtd", "mtm", "mtd", "ata", "atd", "atx")


@dataclass(frozen=True)
class ChannelSums:
    """Per-channel sums in one basis (channel or Hadamard); row 0 = ordinary tokens, row 1 = sinks."""

    abs_x: torch.Tensor  # (2, C) Σ_t |x_pre|
    abs_y: torch.Tensor  # (2, C) Σ_t |x_post|
    sq_x: torch.Tensor  # (2, C) Σ_t x_pre²
    xy: torch.Tensor  # (2, C) Σ_t x_pre·x_post
    sq_y: torch.Tensor  # (2, C) Σ_t x_post²
    window_ratio: torch.Tensor  # (C,) Σ over windows w of Σ_{t∈w} |x_post| / Σ_{t∈w} |x_pre| (all tokens; 1 where 0/0)
    windows: torch.Tensor  # () windows in window_ratio

    def __add__(self, other: ChannelSums) -> ChannelSums:
        return ChannelSums(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def pooled_ratio(self) -> torch.Tensor:
        """(C,) Σ_t |x_post| / Σ_t |x_pre| over every token (1 where the denominator vanishes)."""
        return ratio(self.abs_y.sum(0), self.abs_x.sum(0))

    def window_mean_ratio(self) -> torch.Tensor:
        """(C,) the mean over windows of each window's ratio: LinearPatch's rule (pooled when no window was seen)."""
        count = float(self.windows)
        return self.window_ratio / count if count > 0 else self.pooled_ratio()

    def scale_error(self, scale: torch.Tensor, groups: slice = slice(None)) -> float:
        """‖x diag(s) − y‖² summed over the token groups (Σ_c s²·x² − 2s·xy + y²)."""
        s = scale.to(self.sq_x.device)
        total = (s * s * self.sq_x[groups] - 2 * s * self.xy[groups] + self.sq_y[groups]).sum()
        return max(float(total), 0.0)


@dataclass(frozen=True)
class SinkRows:
    """The massive-activation tokens of one boundary, kept as rows (float64).

    The names other fits build on: `x_pre` (k, C), `delta` (k, C) = X_post − X_pre, `branch`
    (k, C) the MLP branch output m of block s−1 (None without ReplaceMe statistics or at s = 0),
    `cap` (k,) the factor ≤ 1 that brings each row down to its batch's sink threshold norm,
    `inner` (k, I) block s−1's down_proj input a (None without refit statistics).
    `tokens` counts every sink seen; those beyond the capacity are in `spill` (uncapped sums;
    of the a rows only aᵀa) and `spill_capped` (the same rows scaled by their cap), None when
    nothing spilled.
    """

    x_pre: torch.Tensor  # (k, C)
    delta: torch.Tensor  # (k, C)
    branch: torch.Tensor | None  # (k, C)
    cap: torch.Tensor  # (k,)
    tokens: int  # k + spilled
    dd: float  # ‖Δ‖² over every sink token, kept or spilled
    spill: Moments | None = None
    spill_capped: Moments | None = None
    inner: torch.Tensor | None = None  # (k, I)

    @property
    def kept(self) -> int:
        return int(self.x_pre.shape[0])

    def moments(self, capped: bool, residual: bool, branch: bool) -> Moments:
        """The sinks' moments (kept rows + spill), each row scaled by its cap when `capped`."""
        weight = (self.cap if capped else torch.ones_like(self.cap)).unsqueeze(1)  # (k, 1)
        x, d = self.x_pre * weight, self.delta * weight  # (k, C): scaling x, y and m together reweights a token
        m = None if self.branch is None else self.branch * weight
        rows = Moments(self.kept, float((d * d).sum()),
                       x.T @ x if residual else None, x.T @ d if residual else None,
                       m.T @ m if branch and m is not None else None, m.T @ d if branch and m is not None else None)
        spilled = self.spill_capped if capped else self.spill
        return rows if spilled is None else rows + replace(spilled, ata=None)

    @property
    def inner_spill(self) -> torch.Tensor | None:
        """(I, I) aᵀa of the sinks that spilled past the kept rows (None: none spilled, or no refit statistics)."""
        return None if self.spill is None else self.spill.ata

    def merged(self, other: SinkRows) -> SinkRows:
        def cat(a, b):
            return None if a is None or b is None else torch.cat([a, b])

        def add(a, b):
            return a if b is None else b if a is None else a + b
        return SinkRows(cat(self.x_pre, other.x_pre), cat(self.delta, other.delta), cat(self.branch, other.branch),
                        cat(self.cap, other.cap), self.tokens + other.tokens, self.dd + other.dd,
                        add(self.spill, other.spill), add(self.spill_capped, other.spill_capped),
                        cat(self.inner, other.inner))


@dataclass(frozen=True)
class NormalEquations:
    """gram · A = cross for one token set and site, assembled at fit time."""

    gram: torch.Tensor  # (C, C) XᵀX (or mᵀm)
    cross: torch.Tensor  # (C, C) XᵀΔ (or mᵀΔ)
    tokens: int


TOKEN_SETS = ("all", "capped", "ordinary")


@dataclass(frozen=True)
class BoundaryStats:
    """What one boundary's calibration tokens left behind, proportional to `needs`."""

    boundary: Boundary
    needs: StatNeeds
    width: int
    ordinary: Moments  # tokens that are not sinks
    sinks: SinkRows  # massive-activation tokens as rows (see SinkRows for the names)
    channel: ChannelSums | None  # channel basis (diag)
    rotated: ChannelSums | None  # Hadamard basis (rotate); None when not asked or no Hadamard exists for C
    sink_rule: str  # how sinks were found, for reports
    notes: tuple[str, ...] = ()  # e.g. sinks that spilled past the row capacity

    @property
    def tokens(self) -> int:
        """All calibration tokens (what the paper's fit uses)."""
        return self.ordinary.tokens + self.sinks.tokens

    @property
    def has_branch(self) -> bool:
        return self.boundary.start > 0 and self.ordinary.mtm is not None

    @property
    def has_inner(self) -> bool:
        """The refit's statistics were collected (a block before the cut whose down_proj writes to the stream)."""
        return self.boundary.start > 0 and self.ordinary.ata is not None

    @property
    def dd(self) -> float:
        return self.ordinary.dd + self.sinks.dd

    def token_set(self, which: str, site: str = "residual") -> Moments:
        """Moments over "all" tokens, "capped" (sinks scaled to the threshold) or "ordinary" tokens.

        Memory: "all" and "capped" allocate two new C×C matrices per site; "ordinary" none.
        """
        if which not in TOKEN_SETS:
            raise ValueError(f"token set {which!r}; use one of {TOKEN_SETS}")
        residual, branch = site == "residual", site == "branch"
        missing = (residual and self.ordinary.xtx is None) or (branch and self.ordinary.mtm is None)
        if missing:
            raise GhostedError(f"boundary {self.boundary}: the {site} moments were not collected "
                               f"(statistics asked for: {self.needs.describe()}); pass the operator's needs to collect_stats")
        if which == "ordinary":
            return self.ordinary
        sinks = self.sinks.moments(which == "capped", residual, branch)
        keep = {"xtx": residual, "xtd": residual, "mtm": branch, "mtd": branch}
        base = replace(self.ordinary, **{name: None for name, wanted in keep.items() if not wanted},
                       ata=None, atd=None, atx=None)
        return base + sinks

    @property
    def fit(self) -> Moments:
        """All calibration tokens, every C×C moment that was collected (allocates them anew)."""
        sinks = self.sinks.moments(False, self.ordinary.xtx is not None, self.ordinary.mtm is not None)
        return replace(self.ordinary, ata=None, atd=None, atx=None) + sinks

    @property
    def fit_ordinary(self) -> Moments:
        return self.ordinary

    def normal_equations(self, which: str, site: str = "residual") -> NormalEquations:
        moments = self.token_set(which, site)
        if site == "residual":
            return NormalEquations(moments.xtx, moments.xtd, moments.tokens)
        return NormalEquations(moments.mtm, moments.mtd, moments.tokens)

    def merged(self, other: BoundaryStats) -> BoundaryStats:
        """The statistics of both token sets (sums add and rows concatenate: calibration can grow in steps)."""
        def add(a, b):
            return None if a is None or b is None else a + b
        return replace(self, ordinary=self.ordinary + other.ordinary, sinks=self.sinks.merged(other.sinks),
                       channel=add(self.channel, other.channel), rotated=add(self.rotated, other.rotated),
                       notes=tuple(dict.fromkeys(self.notes + other.notes)))

    def nbytes(self) -> int:
        """Bytes held by this record's tensors."""
        total = 0
        for value in (*vars(self.ordinary).values(), *vars(self.sinks).values(), self.channel, self.rotated):
            total += _tensor_bytes(value)
        return total


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (Moments, ChannelSums)):
        return sum(_tensor_bytes(v) for v in vars(value).values())
    return 0


# ---------------------------------------------------------------- the running sums


def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Per-channel numerator/denominator, 1 where the denominator vanishes."""
    safe = denominator > 0
    return torch.where(safe, numerator / torch.where(safe, denominator, 1.0), torch.ones_like(numerator))


class _ChannelSum:
    """Running per-channel sums in one basis; (2, C) per kind, row 0 ordinary, row 1 sinks; and the
    per-window ratios, whose |x| sums are held per window of the current batch until `end_batch`."""

    def __init__(self, width: int, device: torch.device, rotate: bool):
        self.rotate = rotate
        self.sums = {f.name: torch.zeros(2, width, dtype=STATS_DTYPE, device=device) for f in fields(ChannelSums)
                     if f.name not in ("window_ratio", "windows")}
        self.window_ratio = torch.zeros(width, dtype=STATS_DTYPE, device=device)
        self.windows = torch.zeros((), dtype=STATS_DTYPE, device=device)
        self.pending: torch.Tensor | None = None  # (2, B, C) this batch's Σ|x|, Σ|y| per window: B·C·16 B

    def add(self, x: torch.Tensor, y: torch.Tensor, group: int, window: torch.Tensor, windows: int) -> None:
        """x, y (T, C) of one token group; window (T,) each row's window in the batch, of `windows`."""
        if self.rotate:  # O(T·C·log C): the fast transform, never a C×C Hadamard matrix
            x, y = hadamard_transform(x), hadamard_transform(y)
        s = self.sums
        abs_x, abs_y = x.abs(), y.abs()  # (T, C)
        s["abs_x"][group] += abs_x.sum(0)
        s["abs_y"][group] += abs_y.sum(0)
        s["sq_x"][group] += (x * x).sum(0)
        s["xy"][group] += (x * y).sum(0)
        s["sq_y"][group] += (y * y).sum(0)
        if self.pending is None:
            self.pending = torch.zeros(2, windows, x.shape[1], dtype=STATS_DTYPE, device=x.device)
        self.pending[0].index_add_(0, window, abs_x)
        self.pending[1].index_add_(0, window, abs_y)

    def end_batch(self) -> None:
        """Add each window of the batch that had tokens to the per-window ratio sum."""
        if self.pending is None:
            return
        per_x, per_y = self.pending  # (B, C)
        seen = (per_x > 0).any(1) | (per_y > 0).any(1)  # (B,) windows with at least one token
        self.window_ratio += ratio(per_y[seen], per_x[seen]).sum(0)
        self.windows += int(seen.sum())
        self.pending = None

    def tensors(self) -> list[torch.Tensor]:
        return [*self.sums.values(), self.window_ratio, self.windows]

    def freeze(self) -> ChannelSums:
        return ChannelSums(**self.sums, window_ratio=self.window_ratio, windows=self.windows)


class _InnerSum:
    """Running refit sums over block s−1's down_proj input a (I features), allocated at the first batch
    that brings a: ordinary aᵀa (I, I), aᵀΔ (I, C), optionally aᵀX_pre (I, C), and the sink rows of a
    (capacity, I); sinks past the capacity add to an I×I Gram of their own (allocated then)."""

    def __init__(self, width: int, inner: int, capacity: int, stream: bool, device: torch.device,
                 product: torch.dtype):
        def zeros(*shape):
            return torch.zeros(*shape, dtype=STATS_DTYPE, device=device)
        self.product = product
        self.ata, self.atd = zeros(inner, inner), zeros(inner, width)  # memory: (I² + I·C)·8 B
        self.atx = zeros(inner, width) if stream else None  # memory: I·C·8 B
        self.rows = zeros(capacity, inner)  # memory: capacity·I·8 B
        self.spill: torch.Tensor | None = None  # (I, I), only once sinks spill

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.ata, self.atd, self.atx, self.rows, self.spill]

    def add_ordinary(self, a: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> None:
        """a (T, I), x, d (T, C): O(T·I²) time per batch."""
        ap = a.to(self.product)  # (T, I)
        add_gram(self.ata, ap)  # the upper block triangle: mirrored by `BoundarySums.freeze`
        add_product(self.atd, ap, d.to(self.product))
        if self.atx is not None:
            add_product(self.atx, ap, x.to(self.product))

    def add_spill(self, a: torch.Tensor) -> None:
        gram = a.T @ a  # (I, I)
        self.spill = gram if self.spill is None else self.spill + gram


class BoundarySums:
    """The mutable float64 accumulator of one boundary; `freeze` gives its `BoundaryStats`.

    Allocates everything up front (`statistics_bytes` says how much): memory does not grow with
    the token count. Per batch, time is O(T·C²) per C×C pair (the Gram's half of it: `products.add_gram`)
    and O(T·C·log C) for the sums.
    """

    def __init__(self, boundary: Boundary, width: int, device: torch.device, needs: StatNeeds,
                 sink_capacity: int = DEFAULT_SINK_CAPACITY, product_dtype: str = "float64"):
        if product_dtype not in PRODUCT_DTYPES:
            raise GhostedError(f"unknown product dtype {product_dtype!r}; use float64 or float32")
        self.boundary, self.width, self.device, self.needs = boundary, width, device, needs
        self.capacity = sink_capacity
        self.product = PRODUCT_DTYPES[product_dtype]
        self.with_branch = needs.branch and boundary.start > 0

        def zeros(*shape):
            return torch.zeros(*shape, dtype=STATS_DTYPE, device=device)
        c = width
        # memory: 8·C² B per matrix, 2 per pair (residual, branch), whatever the token count
        self.xtx = zeros(c, c) if needs.residual else None
        self.xtd = zeros(c, c) if needs.residual else None
        self.mtm = zeros(c, c) if self.with_branch else None
        self.mtd = zeros(c, c) if self.with_branch else None
        self.tokens = [0, 0]  # ordinary, sinks
        self.dd = zeros(2)
        self.channel = _ChannelSum(c, device, rotate=False) if needs.channel else None
        rotatable = needs.rotated and hadamard_factors(c) is not None
        self.rotated = _ChannelSum(c, device, rotate=True) if rotatable else None
        # sink rows: capacity·C·8 B per kind (x_pre, Δ, m), capacity·8 B for the caps
        rows = self.capacity if needs.sink_rows else 0
        self.rows_x = zeros(rows, c)
        self.rows_d = zeros(rows, c)
        self.rows_m = zeros(rows, c) if self.with_branch and rows else None
        self.rows_cap = zeros(rows)
        self.kept = 0
        self.spill: Moments | None = None
        self.spill_capped: Moments | None = None
        self.with_inner = needs.inner and boundary.start > 0
        self.inner: _InnerSum | None = None  # the refit's sums, once a batch brings block s−1's down_proj input

    def nbytes(self) -> int:
        """Bytes allocated now (equals `statistics_bytes` until sinks spill)."""
        tensors = [self.xtx, self.xtd, self.mtm, self.mtd, self.dd, self.rows_x, self.rows_d, self.rows_m,
                   self.rows_cap] + ([] if self.inner is None else self.inner.tensors())
        total = sum(_tensor_bytes(t) for t in tensors)
        for sums in (self.channel, self.rotated):
            total += 0 if sums is None else sum(_tensor_bytes(t) for t in sums.tensors())
        return total + _tensor_bytes(self.spill) + _tensor_bytes(self.spill_capped)

    def _products(self, x: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        """Ordinary-token C×C products, computed in the product dtype and summed in float64."""
        xp, dp = x.to(self.product), d.to(self.product)  # (T, C)
        if self.xtx is not None:
            add_gram(self.xtx, xp)  # Grams: the upper block triangle, mirrored by `freeze`
            add_product(self.xtd, xp, dp)
        if self.mtm is not None and m is not None:
            mp = m.to(self.product)  # (T, C)
            add_gram(self.mtm, mp)
            add_product(self.mtd, mp, dp)

    def add(self, x_pre: torch.Tensor, x_post: torch.Tensor, branch: torch.Tensor | None,
            sinks: torch.Tensor, cap: torch.Tensor, inner: torch.Tensor | None = None,
            window: torch.Tensor | None = None) -> None:
        """One batch of valid tokens: x_pre, x_post, branch (T, C), sinks (T,) bool, cap (T,) factor ≤ 1,
        inner (T, I) block s−1's down_proj input (None: not captured), window (T,) each token's
        calibration window within the batch (None: the batch is one window)."""
        x = x_pre.to(self.device, STATS_DTYPE)  # (T, C) float64: T·C·8 B per working copy
        d = x_post.to(self.device, STATS_DTYPE) - x  # (T, C)
        m = branch.to(self.device, STATS_DTYPE) if branch is not None and self.with_branch else None  # (T, C)
        a = inner.to(self.device, STATS_DTYPE) if inner is not None and self.with_inner else None  # (T, I): T·I·8 B
        if a is not None and self.inner is None:
            self.inner = _InnerSum(self.width, a.shape[-1], self.capacity, self.needs.inner_stream, self.device,
                                   self.product)
        sinks = sinks.to(self.device)
        ordinary = ~sinks
        window = torch.zeros(len(x), dtype=torch.long, device=self.device) if window is None else window.to(self.device)
        windows = int(window.max()) + 1 if len(window) else 0
        for group, mask in ((0, ordinary), (1, sinks)):
            count = int(mask.sum())
            self.tokens[group] += count
            if count == 0:
                continue
            xg, dg = (x, d) if count == len(mask) else (x[mask], d[mask])  # (n, C): a copy only for a split
            flat = dg.reshape(-1)
            self.dd[group] += torch.dot(flat, flat)
            for sums in (self.channel, self.rotated):
                if sums is not None:
                    sums.add(xg, xg + dg, group, window if count == len(mask) else window[mask], windows)
        for sums in (self.channel, self.rotated):
            if sums is not None:
                sums.end_batch()
        if ordinary.all():
            self._products(x, d, m)
            if a is not None:
                self.inner.add_ordinary(a, x, d)
        elif ordinary.any():
            self._products(x[ordinary], d[ordinary], None if m is None else m[ordinary])
            if a is not None:
                self.inner.add_ordinary(a[ordinary], x[ordinary], d[ordinary])
        if sinks.any() and self.needs.sink_rows:
            self._keep_rows(x[sinks], d[sinks], None if m is None else m[sinks], cap.to(self.device)[sinks],
                            None if a is None else a[sinks])

    def _keep_rows(self, x: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, cap: torch.Tensor,
                   a: torch.Tensor | None = None) -> None:
        room = self.capacity - self.kept
        take = min(room, x.shape[0])
        if a is not None and take < x.shape[0]:
            self.inner.add_spill(a[take:])
        if take:
            end = self.kept + take
            self.rows_x[self.kept:end] = x[:take]
            self.rows_d[self.kept:end] = d[:take]
            if self.rows_m is not None:
                self.rows_m[self.kept:end] = m[:take]
            if a is not None:
                self.inner.rows[self.kept:end] = a[:take]
            self.rows_cap[self.kept:end] = cap[:take].to(STATS_DTYPE)
            self.kept = end
        if take < x.shape[0]:  # past the capacity: fold the rest into C×C sink moments (allocated once)
            over = SinkRows(x[take:], d[take:], None if m is None else m[take:], cap[take:].to(STATS_DTYPE),
                            x.shape[0] - take, 0.0)
            residual, branch = self.needs.residual, self.rows_m is not None
            plain, capped = over.moments(False, residual, branch), over.moments(True, residual, False)
            self.spill = plain if self.spill is None else self.spill + plain
            self.spill_capped = capped if self.spill_capped is None else self.spill_capped + capped

    def freeze(self, sink_rule: str) -> BoundaryStats:
        for gram in (self.xtx, self.mtm, None if self.inner is None else self.inner.ata):
            if gram is not None:
                symmetrize(gram)
        k = self.kept
        spilled = self.tokens[1] - k if self.needs.sink_rows else 0
        notes = ()
        if self.spill is not None:
            extra = (4 * self.needs.residual + 2 * (self.rows_m is not None)) * self.width**2 * STATS_ITEM
            notes = (f"{self.tokens[1]} sink tokens exceeded the {self.capacity} kept rows at boundary {self.boundary}: "
                     f"{spilled} were folded into C×C sink moments ({extra / 2**20:.0f} MiB more than planned); "
                     "raise the sink capacity or use a stricter sink rule",)
        inner = self.inner
        spill = self.spill
        if inner is not None and inner.spill is not None:  # the spilled a rows' Gram rides with the spilled moments
            spill = replace(spill or Moments(0, 0.0), ata=inner.spill)
        sinks = SinkRows(self.rows_x[:k].clone(), self.rows_d[:k].clone(),
                         None if self.rows_m is None else self.rows_m[:k].clone(), self.rows_cap[:k].clone(),
                         self.tokens[1], float(self.dd[1]), spill, self.spill_capped,
                         None if inner is None else inner.rows[:k].clone())
        ordinary = Moments(self.tokens[0], float(self.dd[0]), self.xtx, self.xtd, self.mtm, self.mtd,
                           *((None, None, None) if inner is None else (inner.ata, inner.atd, inner.atx)))
        return BoundaryStats(self.boundary, self.needs, self.width, ordinary, sinks,
                             None if self.channel is None else self.channel.freeze(),
                             None if self.rotated is None else self.rotated.freeze(), sink_rule, notes)


def relative(value: float, reference: float) -> float | None:
    """sqrt(value / reference), None when the reference vanishes."""
    if reference <= 0 or not math.isfinite(reference) or not math.isfinite(value):
        return None
    return math.sqrt(max(value, 0.0) / reference)


__all__ = ["ALL_NEEDS", "BoundaryStats", "BoundaryErrors", "BoundarySums", "ChannelSums", "Moments", "NormalEquations", "SinkRows",
           "StatNeeds", "statistics_bytes"]


@dataclass(frozen=True)
class BoundaryErrors:
    """Squared boundary errors of one fit measured directly on token rows (e.g. held-out sequences)."""

    tokens: int
    sink_tokens: int
    error: float  # Σ_t ‖x_t W − y_t‖² over all tokens
    error_ordinary: float  # … over tokens that are not sinks
    dd: float  # Σ_t ‖y_t − x_t‖² (what plain pruning leaves), all tokens
    dd_ordinary: float

    @property
    def relative(self) -> float | None:
        """‖X W − Y‖ / ‖Y − X‖ over all tokens (1 = no better than plain pruning)."""
        return relative(self.error, self.dd)

    @property
    def relative_ordinary(self) -> float | None:
        return relative(self.error_ordinary, self.dd_ordinary)
