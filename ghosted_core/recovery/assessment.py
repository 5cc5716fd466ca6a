"""How good a fit is: boundary errors from the statistics and held-out passes, and the fit's structure.

`assess` turns a `Fit` into the `FitReport` the CLI, the app and results.json show: relative
boundary errors (all tokens and ordinary tokens), the anti-symmetric share of M, its singular
values. `BoundaryMap` is a fit compacted to what applies it, for direct error passes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from ghosted_core.hadamard import hadamard_transform
from ghosted_core.plan import Boundary
from ghosted_core.statistics import BoundaryErrors, BoundaryStats, Moments, relative
from ghosted_core.recovery.operators import Fit, calibration_errors, squared_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Diagnostics:
    """The parts of a fit report that cost O(C³) and that no default view shows, each on request.

    The CLI's summary shows held-out errors and the anti-symmetric share; the app adds the
    singular values (its structure chart). Calibration-token errors (two C×C products from the
    statistics) fill in for held-out errors only when nothing is held out.
    """

    fit_errors: bool = True  # boundary errors on the calibration tokens, from the statistics
    singular_values: bool = True  # σ(M) as √eig(MᵀM): 8 s at C = 4096 on 2 cores


SHOWN = Diagnostics(fit_errors=False, singular_values=False)  # what the CLI summary needs: none of them


@dataclass(frozen=True)
class BoundaryMap:
    """What a fit does at its boundary, kept in the least memory that applies it: u ↦ u (I + A).

    A per-channel fit keeps its scale (C,) and basis; a full fit keeps A in float32 (4·C² B,
    half the float64 fit; applied in float64, added to I there). For direct error passes.
    """

    boundary: Boundary
    site: str  # "residual" (u = x_pre), "branch" (u = m) or "inner" (u = a, block s−1's down_proj input)
    update: torch.Tensor | None  # (C, C) A (inner: (I, C) B), float32; None with a scale or for the identity
    scale: torch.Tensor | None = None  # (C,) r in `basis`
    basis: str | None = None  # "channel" or "hadamard"
    stream_scale: float = 1.0  # an inner fit's upstream scalar s: the stream becomes s·(x + aB)

    @classmethod
    def of(cls, fit: Fit) -> BoundaryMap:
        if fit.scale is not None and fit.basis is not None:
            return cls(fit.boundary, fit.site, None, fit.scale, fit.basis)
        update = None if fit.update is None else fit.update.to(torch.float32)
        return cls(fit.boundary, fit.site, update, stream_scale=fit.upstream_scale or 1.0)

    def error_rows(self, x: torch.Tensor, m: torch.Tensor | None, delta: torch.Tensor,
                   a: torch.Tensor | None = None) -> torch.Tensor | None:
        """(T, C) u (I + A) − (u + Δ), float64; the identity gives −Δ (an inner fit: s·(x + aB) − (x + Δ)).
        None: a branch or inner map whose u was not captured here."""
        u = {"residual": x, "branch": m, "inner": a}[self.site]
        if self.update is None and self.scale is None:
            return -delta
        if u is None:
            return None
        if self.site == "inner":  # in place on the one new (T, C): the held-out pass holds x, Δ, a and this
            s = self.stream_scale
            return times_update(u, self.update).mul_(s).add_(x, alpha=s - 1).sub_(delta)
        if self.scale is not None:
            s = self.scale.to(u.device, u.dtype)
            if self.basis == "channel":
                return u * (s - 1) - delta
            return hadamard_transform(u) * s - hadamard_transform(u + delta)  # ‖·‖ is the same in the rotated basis
        return times_update(u, self.update).sub_(delta)


UPDATE_ROWS = 1024  # rows of a float32 update made float64 at a time by `times_update`


def times_update(u: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """u @ A in u's dtype (float64) for a float32 A (W, C), a block of UPDATE_ROWS rows of A converted at a time:
    memory T·C plus UPDATE_ROWS·C·8 B, never a float64 copy of the whole A (I·C·8 B for a refit: 470 MB at C = 4096)."""
    out = torch.zeros(u.shape[0], update.shape[1], dtype=u.dtype, device=u.device)  # (T, C)
    for lo in range(0, update.shape[0], UPDATE_ROWS):
        hi = min(lo + UPDATE_ROWS, update.shape[0])
        out.addmm_(u[:, lo:hi], update[lo:hi].to(u.device, u.dtype))
    return out


@dataclass(frozen=True)
class FitReport:
    """Numbers shown per boundary and operator."""

    operator: str
    boundary: str
    fit_error: float | None  # relative boundary error on calibration tokens, all tokens
    fit_error_ordinary: float | None  # … on calibration tokens that are not sinks
    heldout_error: float | None  # … on held-out sequences, all tokens
    heldout_error_ordinary: float | None  # … on held-out sequences, sinks left out
    antisym_fraction: float
    singular_values: tuple[float, ...]  # of M = W − I (or T − I), descending; empty for identity or C > 4096
    condition_number: float | None
    tokens_used: int
    sink_tokens: int
    sink_handling: str
    ridge: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    ridge_fallback: str | None = None  # why the fit used the relative ridge instead of the paper's ε (None: it did not)
    heldout_worse_than_pruning: bool = False  # held-out boundary error above 1: worse than plain pruning on unseen text
    sink_directions: int | None = None  # replaceme_keepsink: sink directions kept as identity

    @property
    def flags(self) -> tuple[str, ...]:
        """Short warnings to show next to the numbers."""
        flags = []
        if self.heldout_worse_than_pruning:
            flags.append(HELDOUT_FLAG)
        if self.ridge_fallback:
            flags.append("relative ridge (rank-deficient fit)")
        return tuple(flags)

    def to_json(self) -> dict:
        def clean(value):
            return None if isinstance(value, float) and not math.isfinite(value) else value
        return {key: clean(value) for key, value in self.__dict__.items()} | {
            "notes": list(self.notes), "singular_values": list(self.singular_values), "flags": list(self.flags)}


HELDOUT_FLAG = "worse than plain pruning on held-out calibration text"


def relative_error(fit: Fit, moments: Moments | None) -> float | None:
    """‖X_pre W − X_post‖ / ‖X_post − X_pre‖ over a token group (1 = no better than pruning)."""
    if moments is None or moments.tokens == 0 or float(moments.dd) == 0.0:
        return None
    return math.sqrt(squared_error(fit, moments) / float(moments.dd))


def antisymmetric_fraction(update: torch.Tensor | None) -> float:
    """‖(M − Mᵀ)/2‖_F / ‖M‖_F: the part no symmetric operator (LinearPatch) can represent."""
    if update is None:
        return 0.0
    if update.shape[0] != update.shape[1]:  # an I×C refit has no symmetric part to speak of
        return math.nan
    norm = float(torch.linalg.matrix_norm(update))
    if norm == 0:
        return 0.0
    # block by block (i ≤ j): each block meets its mirror image in cache; no C×C temporary (0.03 s against
    # 0.2 s for M − Mᵀ whole at C = 4096)
    width, block, squares = update.shape[0], 512, 0.0
    for i in range(0, width, block):
        for j in range(i, width, block):
            part = update[i:i + block, j:j + block] - update[j:j + block, i:i + block].T
            squares += (1.0 if i == j else 2.0) * float((part * part).sum())
    return math.sqrt(squares) / 2 / norm


def singular_values(update: torch.Tensor | None, max_width: int = 4096) -> tuple[float, ...]:
    """Singular values of the update, descending, for the app's structure chart (skipped for very
    wide models).

    Taken as √eig(MᵀM) in float64: a third of an SVD's time at C = 4096 (4.3 s against 12.8 s on
    2 cores), the largest cost of a fit before this. Each value is exact to about 1e-8·σ_max
    (round-off of MᵀM), more than a chart on a log axis can show. Memory: one C×C float64 product
    beside M (128 MiB at C = 4096), freed on return; time O(C³).
    """
    if update is None or max(update.shape) > max_width:
        return ()
    matrix = update.double()  # (R, C): MᵀM is C×C, also for an I×C refit
    eigenvalues = torch.linalg.eigvalsh(matrix.T @ matrix)  # ascending
    return tuple(eigenvalues.clamp(min=0).sqrt().flip(0).tolist())


def scale_singular_values(fit: Fit) -> tuple[float, ...]:
    """Singular values of B diag(r − 1) Bᵀ (B orthogonal): |r − 1| in descending order, no O(C³) SVD."""
    return tuple(torch.sort((fit.scale - 1).abs(), descending=True).values.tolist())


def assess(fit: Fit, stats: BoundaryStats, heldout: BoundaryErrors | None = None,
           detail: Diagnostics = Diagnostics()) -> FitReport:
    """Boundary errors of a fit (calibration tokens from the statistics; held-out tokens as
    measured by `recovery.heldout.measure_errors`, all and ordinary tokens) and its structure.

    `detail` says which O(C³) parts to compute (the rest stay None or empty); a per-channel
    fit's are O(C) and always computed. Time: the anti-symmetric share O(C²), each asked part O(C³).
    """
    cheap = fit.scale is not None or fit.update is None
    errors = calibration_errors(fit, stats) if detail.fit_errors or cheap else None
    held = None if heldout is None else heldout.relative
    if fit.scale is not None:
        values = scale_singular_values(fit)
    else:
        values = singular_values(fit.update) if detail.singular_values else ()
    return FitReport(
        operator=fit.operator,
        boundary=str(stats.boundary),
        fit_error=None if errors is None else relative(errors[0], stats.dd),
        fit_error_ordinary=None if errors is None else relative(errors[1], stats.ordinary.dd),
        heldout_error=held,
        heldout_error_ordinary=None if heldout is None else heldout.relative_ordinary,
        antisym_fraction=0.0 if fit.scale is not None else antisymmetric_fraction(fit.update),  # B diag(r) Bᵀ is symmetric
        singular_values=values,
        condition_number=fit.condition_number if math.isfinite(fit.condition_number) else None,
        tokens_used=fit.tokens_used,
        sink_tokens=fit.sink_tokens,
        sink_handling=fit.sink_handling,
        ridge=fit.ridge,
        notes=fit.notes + stats.notes,
        ridge_fallback=fit.ridge_fallback,
        heldout_worse_than_pruning=held is not None and held > 1.0,
        sink_directions=fit.sink_directions,
    )


# ---------------------------------------------------------------- modules
