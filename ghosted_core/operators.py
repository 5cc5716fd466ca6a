"""Recovery operators: a registry of fits from boundary statistics to a linear map.

Every operator is one decorated function `(stats, opts) -> Fit`. A fit is an update A (C×C,
float64) applied at one of two sites:
- "residual": the stream entering the first surviving block becomes x ↦ x (I + A);
- "branch": block s−1's MLP branch output becomes m ↦ m (I + A) (ReplaceMe), folded into
  its down projection where the architecture allows.
Fits are pure tensor maths; `realize` turns a fit into the `nn.Module`s a variant needs, and
`assess` measures it from the same statistics (errors on fit and held-out tokens).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ghosted_core.calibration import BoundaryStats, Moments, branch_module
from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard
from ghosted_core.modeling_ghosted import ResidualLinear, ResidualScale  # shared with remote-code exports
from ghosted_core.plan import Boundary
from ghosted_core.registry import add, check_signature, lookup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitOptions:
    """Numerical choices of the least-squares fits."""

    epsilon: float = 1e-6  # the paper's absolute ridge: (XᵀX + εI) M = XᵀΔ
    ridge: str = "absolute"  # "absolute" (paper) or "relative": ε = ridge_lambda · tr(XᵀX) / C
    ridge_lambda: float = 1e-4  # relative ridge, also the fallback for rank-deficient fits
    max_condition: float = 1e12  # cond(XᵀX) above which an absolute-ridge fit falls back to the relative ridge
    sink_directions: tuple[int, ...] = (0, 1, 2, 3, 4)  # replaceme_keepsink: candidate counts k, chosen by held-out error

    def __post_init__(self) -> None:
        if self.ridge not in {"absolute", "relative"}:
            raise GhostedError(f"unknown ridge {self.ridge!r}; use absolute or relative")
        if not self.sink_directions or min(self.sink_directions) < 0:
            raise GhostedError(f"sink direction counts must be ≥ 0 (got {self.sink_directions})")


@dataclass(frozen=True)
class Fit:
    """What one operator found at one boundary."""

    operator: str
    boundary: Boundary
    site: str  # "residual" or "branch"
    update: torch.Tensor | None  # (C, C) float64 A; None = identity (plain pruning)
    diagonal: bool = False  # A is diagonal: realized as a per-channel scale
    tokens_used: int = 0
    sink_tokens: int = 0  # massive-activation tokens treated specially (see sink_handling)
    sink_handling: str = "included"  # "included" (paper), "excluded" or "capped" (weight capped at the threshold norm)
    ridge: float = 0.0  # ε actually added to the Gram matrix
    condition_number: float = float("nan")  # of the Gram matrix the fit solved with
    notes: tuple[str, ...] = ()  # warnings and fallbacks, shown to the user
    sink_directions: int | None = None  # replaceme_keepsink: sink MLP-output directions on which T = I


@dataclass(frozen=True)
class OperatorSpec:
    name: str
    fit: Callable[[BoundaryStats, FitOptions], Fit]
    paper: str
    description: str
    stock: bool = False  # its variants fold into a stock checkpoint (plain pruning, maps on the MLP branch)


OPERATORS: dict[str, OperatorSpec] = {}


def register_operator(name: str, *, paper: str, description: str, stock: bool = False):
    """Add `fn(stats: BoundaryStats, opts: FitOptions) -> Fit` to OPERATORS; checked at import.

    `stock`: the operator's variants fold into a stock checkpoint (see `fold`)."""

    def decorator(fn):
        check_signature(fn, f"operator {name}", {"stats": BoundaryStats, "opts": FitOptions}, Fit)
        add(OPERATORS, name, OperatorSpec(name, fn, paper, description, stock), "operator")
        return fn

    return decorator


def get_operator(name: str) -> OperatorSpec:
    return lookup(OPERATORS, name, "operator")


# ---------------------------------------------------------------- shared maths


def condition_number(gram: torch.Tensor) -> float:
    """λ_max / λ_min of a symmetric PSD matrix (inf when singular)."""
    eig = torch.linalg.eigvalsh(gram)
    low, high = float(eig[0]), float(eig[-1])
    return math.inf if low <= high * 1e-18 else high / low


def solve_ridge(gram: torch.Tensor, cross: torch.Tensor, tokens: int, opts: FitOptions) -> tuple[torch.Tensor, float, float, tuple[str, ...]]:
    """(A, ε, cond, notes) with (gram + εI) A = cross; falls back to a relative ridge when the
    fit is rank-deficient (fewer tokens than channels) or ill-conditioned, never NaN."""
    width = gram.shape[0]
    cond = condition_number(gram)
    relative = opts.ridge_lambda * float(torch.trace(gram)) / width
    notes: tuple[str, ...] = ()
    if opts.ridge == "relative":
        eps = relative
    elif tokens < width or cond > opts.max_condition:
        eps = relative
        reason = f"{tokens} tokens < {width} channels" if tokens < width else f"cond(XᵀX) = {cond:.2g}"
        notes = (f"rank-deficient fit ({reason}): used a relative ridge ε = {opts.ridge_lambda:g}·tr(XᵀX)/C "
                 f"= {eps:.3g} instead of ε = {opts.epsilon:g}",)
        log.warning(notes[0])
    else:
        eps = opts.epsilon
    if not math.isfinite(eps) or eps <= 0:
        eps = opts.epsilon
    eye = torch.eye(width, dtype=gram.dtype, device=gram.device)
    update = torch.linalg.solve(gram + eps * eye, cross)
    if not torch.isfinite(update).all():
        raise GhostedError("the least-squares fit produced non-finite values; use more calibration text or --ridge relative")
    return update, eps, cond, notes


def _least_squares_fit(name: str, stats: BoundaryStats, moments: Moments, opts: FitOptions,
                       sink_handling: str = "included") -> Fit:
    """The unconstrained optimum: (XᵀX + εI) M = XᵀΔ on the given tokens."""
    update, eps, cond, notes = solve_ridge(moments.xtx, moments.xtd, moments.tokens, opts)
    sinks = stats.fit_sink.tokens if sink_handling != "included" else 0
    return Fit(name, stats.boundary, "residual", update, tokens_used=moments.tokens, sink_tokens=sinks,
               sink_handling=sink_handling, ridge=eps, condition_number=cond, notes=notes)


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Per-channel numerator/denominator, 1 where the denominator vanishes."""
    safe = denominator > 0
    return torch.where(safe, numerator / torch.where(safe, denominator, 1.0), torch.ones_like(numerator))


# ---------------------------------------------------------------- the operators


@register_operator("none", paper="plain pruning", description="no recovery: W = I", stock=True)
def fit_none(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return Fit("none", stats.boundary, "residual", None, tokens_used=stats.fit.tokens)


@register_operator("diag", paper="LinearPatch-D", description="per-channel scale mean|X_post| / mean|X_pre| (symmetric)")
def fit_diag(stats: BoundaryStats, opts: FitOptions) -> Fit:
    moments = stats.fit
    scale = _ratio(moments.abs_post, moments.abs_pre)  # (C,)
    return Fit("diag", stats.boundary, "residual", torch.diag(scale - 1.0), diagonal=True, tokens_used=moments.tokens)


@register_operator("rotate", paper="LinearPatch-R",
                   description="per-channel scale in a Hadamard-rotated basis: H diag(r) Hᵀ (symmetric)")
def fit_rotate(stats: BoundaryStats, opts: FitOptions) -> Fit:
    moments = stats.fit
    if moments.abs_pre_rot is None:
        hadamard(stats.width)  # raises the user-facing explanation
    rot = torch.from_numpy(hadamard(stats.width).copy()).to(moments.abs_pre.device)  # (C, C)
    scale = _ratio(moments.abs_post_rot, moments.abs_pre_rot)  # (C,)
    weight = (rot * scale) @ rot.T  # H diag(r) Hᵀ
    eye = torch.eye(stats.width, dtype=weight.dtype, device=weight.device)
    return Fit("rotate", stats.boundary, "residual", weight - eye, tokens_used=moments.tokens)


@register_operator("ghost", paper="Ghosted Layers",
                   description="least-squares optimum W = I + M, (XᵀX + εI) M = XᵀΔ over all calibration tokens")
def fit_ghost(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost", stats, stats.fit, opts)


@register_operator("ghost_capped", paper="Ghosted Layers, sink-aware (this project)",
                   description="ghost with each massive-activation (attention-sink) token scaled down to the sink "
                               "threshold norm: sinks still constrain W but no longer dominate XᵀX")
def fit_ghost_capped(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost_capped", stats, stats.fit_ordinary + stats.fit_sink_capped, opts, "capped")


@register_operator("ghost_nosink", paper="Ghosted Layers, sink-free (this project)",
                   description="ghost fit on ordinary tokens only: massive-activation tokens left out of the statistics")
def fit_ghost_nosink(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost_nosink", stats, stats.fit_ordinary, opts, "excluded")


def _unrecovered_branch(name: str, stats: BoundaryStats) -> Fit:
    note = f"ReplaceMe needs the block before the boundary; boundary {stats.boundary} starts at block 0 and is left unrecovered"
    log.warning(note)
    return Fit(name, stats.boundary, "branch", None, tokens_used=stats.fit.tokens, notes=(note,))


def _branch_fit(name: str, stats: BoundaryStats, moments: Moments, opts: FitOptions, sink_handling: str = "included") -> Fit:
    """ReplaceMe's least squares on the given tokens: m T ≈ Δ + m ⇔ T = I + A, (mᵀm + εI) A = mᵀΔ."""
    if not stats.has_branch:
        return _unrecovered_branch(name, stats)
    update, eps, cond, notes = solve_ridge(moments.mtm, moments.mtd, moments.tokens, opts)
    sinks = stats.fit_sink.tokens if sink_handling != "included" else 0
    return Fit(name, stats.boundary, "branch", update, tokens_used=moments.tokens, sink_tokens=sinks,
               sink_handling=sink_handling, ridge=eps, condition_number=cond, notes=notes)


@register_operator("replaceme", paper="ReplaceMe-LS",
                   description="least-squares map on block s−1's MLP output, folded into its down projection",
                   stock=True)
def fit_replaceme(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _branch_fit("replaceme", stats, stats.fit, opts)


@register_operator("replaceme_capped", paper="ReplaceMe-LS, sink-capped (this project)",
                   description="ReplaceMe with each attention-sink token scaled down to the sink threshold norm, "
                               "folded into block s−1's down projection", stock=True)
def fit_replaceme_capped(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _branch_fit("replaceme_capped", stats, stats.fit_ordinary + stats.fit_sink_capped, opts, "capped")


def sink_branch_gram(stats: BoundaryStats) -> torch.Tensor:
    """(C, C) Σ mᵀm over the sink tokens' MLP outputs: the only place the sink-preserving fit reads
    the sink group. With sink tokens kept as rows (the statistics restructure of issue 9) this
    line becomes `rows.T @ rows` of those rows (or an SVD of the (k, C) rows, O(k²·C))."""
    return stats.fit_sink.mtm


def heldout_branch(stats: BoundaryStats) -> Moments | None:
    """Moments of the held-out sequences (all tokens) that choose the number of sink directions."""
    return stats.heldout


def sink_directions(gram: torch.Tensor, count: int) -> torch.Tensor:
    """(C, k) orthonormal top eigenvectors of a sink group's mᵀm, k ≤ count, only those with weight.

    Time O(C³) (one symmetric eigendecomposition), memory 2·C²·8 B.
    """
    values, vectors = torch.linalg.eigh(gram)  # ascending
    order = values.flip(0)
    useful = int((order > order[0].clamp_min(0) * 1e-9).sum()) if float(order[0]) > 0 else 0
    return vectors.flip(1)[:, : min(count, useful)]


def solve_keeping(gram: torch.Tensor, cross: torch.Tensor, keep: torch.Tensor, tokens: int,
                  opts: FitOptions) -> tuple[torch.Tensor, float, float, tuple[str, ...]]:
    """A = P B minimizing ‖m P B − Δ‖² + ε‖B‖², P = I − UUᵀ, U = `keep` (C, k) orthonormal.

    Then T = I + A is the identity on the directions U (u T = u) and the least-squares optimum
    on the rest. In the basis [Q U] with Q spanning range(P), the normal equations are
    (QᵀGQ + εI) B̃ = QᵀR, A = Q B̃: the same solution as (PGP + c·UUᵀ + εI) A = P R (any c > 0
    makes the U block invertible and its right-hand side is 0, so UᵀA = 0), which needs no Q.
    Memory: three C×C float64 matrices beyond the statistics; time O(C²·k) plus one solve, O(C³).
    """
    if keep.shape[1] == 0:
        return solve_ridge(gram, cross, tokens, opts)
    gu = gram @ keep  # (C, k) G U
    pgp = gram - keep @ gu.T - gu @ keep.T + keep @ (keep.T @ gu) @ keep.T  # (C, C) P G P
    pgp += (float(torch.trace(gram)) / gram.shape[0]) * (keep @ keep.T)  # c·UUᵀ: U block invertible
    rhs = cross - keep @ (keep.T @ cross)  # (C, C) P R
    update, eps, cond, notes = solve_ridge(pgp, rhs, tokens, opts)
    update -= keep @ (keep.T @ update)  # exactly 0 on U (it already is up to rounding)
    return update, eps, cond, notes


@register_operator("replaceme_keepsink", paper="ReplaceMe-LS, sink-preserving (this project)",
                   description="ReplaceMe fitted on ordinary tokens with T = I on the sink tokens' top MLP-output "
                               "directions (their number chosen by held-out error); folded into block s−1's down "
                               "projection", stock=True)
def fit_replaceme_keepsink(stats: BoundaryStats, opts: FitOptions) -> Fit:
    """The sink token's MLP output is massive; any T ≠ I on it breaks the sink for every block after.

    Fit on ordinary tokens only, T = I + P·B with P = I − UUᵀ, U the top-k eigenvectors of the
    sink group's mᵀm; k from `opts.sink_directions` with the lowest held-out boundary error
    (all tokens; calibration tokens when nothing is held out). Memory O(C²); time one
    eigendecomposition plus one solve per candidate k, O((K+1)·C³).
    """
    name = "replaceme_keepsink"
    if not stats.has_branch:
        return _unrecovered_branch(name, stats)
    ordinary = stats.fit_ordinary
    directions = sink_directions(sink_branch_gram(stats), max(opts.sink_directions))
    judge = heldout_branch(stats)
    where = "held-out" if judge is not None and judge.tokens else "calibration"
    judge = judge if where == "held-out" else stats.fit
    candidates = sorted({min(k, directions.shape[1]) for k in opts.sink_directions})
    best = None
    errors = {}
    for k in candidates:
        update, eps, cond, notes = solve_keeping(ordinary.mtm, ordinary.mtd, directions[:, :k], ordinary.tokens, opts)
        fit = Fit(name, stats.boundary, "branch", update, tokens_used=ordinary.tokens, sink_tokens=stats.fit_sink.tokens,
                  sink_handling="identity", ridge=eps, condition_number=cond, notes=notes)
        errors[k] = relative_error(fit, judge)
        if best is None or (errors[k] or 0.0) < (errors[best[0]] or 0.0):
            best = (k, fit)
    k, fit = best
    table = ", ".join(f"{j}: {e:.3f}" if e is not None else f"{j}: -" for j, e in errors.items())
    note = f"kept {k} sink direction(s) as identity (boundary error on {where} tokens by count: {table})"
    log.info("%s at %s: %s", name, stats.boundary, note)
    return replace(fit, notes=(*fit.notes, note), sink_directions=k)


# ---------------------------------------------------------------- assessment


def squared_error(fit: Fit, moments: Moments) -> float:
    """‖U(I + A) − (U + Δ)‖² = tr(AᵀUᵀUA) − 2 tr(AᵀUᵀΔ) + ‖Δ‖², U = X_pre or m, from the moments alone."""
    if fit.update is None:
        return float(moments.dd)
    gram, cross = (moments.xtx, moments.xtd) if fit.site == "residual" else (moments.mtm, moments.mtd)
    a = fit.update.to(gram.device)
    value = (gram @ a * a).sum() - 2 * (a * cross).sum() + moments.dd
    return max(float(value), 0.0)


def relative_error(fit: Fit, moments: Moments | None) -> float | None:
    """‖X_pre W − X_post‖ / ‖X_post − X_pre‖ over a token group (1 = no better than pruning)."""
    if moments is None or moments.tokens == 0 or float(moments.dd) == 0.0:
        return None
    return math.sqrt(squared_error(fit, moments) / float(moments.dd))


def antisymmetric_fraction(update: torch.Tensor | None) -> float:
    """‖(M − Mᵀ)/2‖_F / ‖M‖_F: the part no symmetric operator (LinearPatch) can represent."""
    if update is None:
        return 0.0
    norm = float(torch.linalg.matrix_norm(update))
    return 0.0 if norm == 0 else float(torch.linalg.matrix_norm((update - update.T) / 2)) / norm


def singular_values(update: torch.Tensor | None, max_width: int = 4096) -> tuple[float, ...]:
    """Singular values of the update, for the app's structure chart (skipped for very wide models)."""
    if update is None or update.shape[0] > max_width:
        return ()
    return tuple(torch.linalg.svdvals(update).tolist())


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
    sink_directions: int | None = None  # replaceme_keepsink: sink directions kept as identity (chosen by held-out error)

    def to_json(self) -> dict:
        def clean(value):
            return None if isinstance(value, float) and not math.isfinite(value) else value
        return {key: clean(value) for key, value in self.__dict__.items()} | {
            "notes": list(self.notes), "singular_values": list(self.singular_values)}


def assess(fit: Fit, stats: BoundaryStats) -> FitReport:
    """Boundary errors of a fit (calibration and held-out, all and ordinary tokens) and its structure."""
    return FitReport(
        operator=fit.operator,
        boundary=str(stats.boundary),
        fit_error=relative_error(fit, stats.fit),
        fit_error_ordinary=relative_error(fit, stats.fit_ordinary),
        heldout_error=relative_error(fit, stats.heldout),
        heldout_error_ordinary=relative_error(fit, stats.heldout_ordinary),
        antisym_fraction=antisymmetric_fraction(fit.update),
        singular_values=singular_values(fit.update),
        condition_number=fit.condition_number if math.isfinite(fit.condition_number) else None,
        tokens_used=fit.tokens_used,
        sink_tokens=fit.sink_tokens,
        sink_handling=fit.sink_handling,
        ridge=fit.ridge,
        notes=fit.notes,
        sink_directions=fit.sink_directions,
    )


# ---------------------------------------------------------------- modules


def module_device(module: nn.Module) -> torch.device:
    """Where a module computes: its execution device under accelerate, else its first tensor's device."""
    hook = getattr(module, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def residual_module(fit: Fit, device: torch.device) -> nn.Module:
    """The boundary module realizing a residual-site fit."""
    eye = torch.eye(fit.update.shape[0], dtype=fit.update.dtype, device=fit.update.device)
    if fit.diagonal:
        return ResidualScale(torch.diagonal(fit.update) + 1.0).to(device)
    return ResidualLinear(eye + fit.update).to(device)


def branch_replacement(fit: Fit, block: nn.Module) -> dict[str, nn.Module]:
    """Submodule replacements inside block s−1 realizing a branch-site fit (ReplaceMe).

    Folded into `mlp.down_proj` (zero inference cost) when the MLP output is added to the
    residual as is; applied as an explicit C×C map after the branch where a norm follows
    the MLP (Gemma3) or the weights are offloaded.
    """
    transform = torch.eye(fit.update.shape[0], dtype=torch.float64, device=fit.update.device) + fit.update  # T (C, C)
    target = branch_module(block)
    down = getattr(getattr(block, "mlp", None), "down_proj", None)
    if target is block.mlp and isinstance(down, nn.Linear) and down.weight.device.type != "meta":
        # y = a W_downᵀ + b  →  y T = a (Tᵀ W_down)ᵀ + b T
        weight = transform.T.to(down.weight.device) @ down.weight.to(torch.float64)  # (C, I)
        folded = nn.Linear(down.in_features, down.out_features, bias=down.bias is not None,
                           device=down.weight.device, dtype=down.weight.dtype)
        folded.weight = nn.Parameter(weight.to(down.weight.dtype), requires_grad=False)
        if down.bias is not None:
            bias = down.bias.to(torch.float64) @ transform.to(down.bias.device)
            folded.bias = nn.Parameter(bias.to(down.bias.dtype), requires_grad=False)
        return {"mlp.down_proj": folded}
    name = next(n for n, m in block.named_children() if m is target)
    return {name: nn.Sequential(target, ResidualLinear(transform).to(module_device(target)))}
