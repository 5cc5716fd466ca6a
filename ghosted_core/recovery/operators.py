"""Recovery operators: a registry of fits from boundary statistics to a linear map.

Every operator is one decorated function `(stats, opts) -> Fit`. A fit is an update A (C×C,
float64) applied at one of two sites:
- "residual": the stream entering the first surviving block becomes x ↦ x (I + A);
- "branch": block s−1's MLP branch output becomes m ↦ m (I + A) (ReplaceMe), folded into
  its down projection where the architecture allows.
A residual fit that is a scalar s·I (`magcomp`, `Fit.upstream_scale`) is realized upstream instead:
the embeddings and every residual writer before the cut are scaled (`model.scaling`).
Each operator declares the statistics it needs (`StatNeeds`); `needs_of` unions them so the
calibration pass keeps nothing else. Fits are pure tensor maths (with their calibration errors
from the statistics, which some fits choose by); `recovery.modules` turns a fit into modules and
`recovery.assessment` measures it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard_factors, hadamard_transform
from ghosted_core.memory_parts import OperatorCost
from ghosted_core.plan import Boundary
from ghosted_core.recovery.linalg import RIDGE_FALLBACK, principal_directions, projected_normal_equations, solve_ridge
from ghosted_core.recovery.magcomp import MAGCOMP_FORMS, magnitude_scale
from ghosted_core.recovery.refit import refit_solutions, refit_squared_errors
from ghosted_core.registry import add, check_signature, lookup
from ghosted_core.statistics import ALL_NEEDS, BoundaryErrors, BoundaryStats, Moments, StatNeeds, relative

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class FitOptions:
    """Numerical choices of the least-squares fits."""

    epsilon: float = 1e-6  # the paper's absolute ridge: (XᵀX + εI) M = XᵀΔ
    ridge: str = "absolute"  # "absolute" (paper) or "relative": ε = ridge_lambda · tr(XᵀX) / C
    ridge_lambda: float = 1e-4  # relative ridge, also the fallback for rank-deficient fits
    max_condition: float = 1e12  # cond(XᵀX) above which an absolute-ridge fit falls back to the relative ridge
    sink_directions: tuple[int, ...] = (0, 1, 2, 3, 4)  # replaceme_keepsink: candidate counts k, chosen by held-out error
    # report cond(XᵀX) exactly (one eigendecomposition, O(C³): 7 s at C = 4096 on 2 cores); off, the fallback
    # test is a Cholesky of XᵀX − (λ_max / max_condition)·I, a third of the time, and no number is reported
    condition_number: bool = False
    magcomp_form: str = "global"  # magcomp's scalar: see recovery.magcomp.MAGCOMP_FORMS
    refit_lambdas: tuple[float, ...] = (0.1, 1.0)  # refit: relative ridges λ, chosen with the sink count by held-out error
    refit_sink_directions: tuple[int, ...] = (0, 1, 2, 4, 8)  # refit: candidate sink counts k of the intermediate a

    def __post_init__(self) -> None:
        if self.ridge not in {"absolute", "relative"}:
            raise GhostedError(f"unknown ridge {self.ridge!r}; use absolute or relative")
        if not self.sink_directions or min(self.sink_directions) < 0:
            raise GhostedError(f"sink direction counts must be ≥ 0 (got {self.sink_directions})")
        if not self.refit_lambdas or not all(math.isfinite(x) and x > 0 for x in self.refit_lambdas):
            raise GhostedError(f"refit ridges must be finite numbers above 0 (got {self.refit_lambdas})")
        if not self.refit_sink_directions or min(self.refit_sink_directions) < 0:
            raise GhostedError(f"refit sink direction counts must be ≥ 0 (got {self.refit_sink_directions})")
        if not math.isfinite(self.epsilon) or self.epsilon < 0:
            raise GhostedError(f"--epsilon must be a finite number ≥ 0 (got {self.epsilon})")
        if not math.isfinite(self.ridge_lambda) or self.ridge_lambda <= 0:
            raise GhostedError(f"--ridge_lambda must be a finite number above 0 (got {self.ridge_lambda})")
        if self.magcomp_form not in MAGCOMP_FORMS:
            raise GhostedError(f"unknown magcomp form {self.magcomp_form!r}; use one of {', '.join(MAGCOMP_FORMS)}")

    @property
    def refit_candidates(self) -> int:
        """The down_proj refit's (λ, sink count) candidates, chosen among by held-out error."""
        return len(set(self.refit_lambdas)) * len(set(self.refit_sink_directions))


@dataclass(frozen=True)
class Fit:
    """What one operator found at one boundary."""

    operator: str
    boundary: Boundary
    site: str  # "residual", "branch" or "inner" (the down_proj refit: B (I, C) on block s−1's down_proj input a)
    update: torch.Tensor | None  # (C, C) float64 A (inner: (I, C) B); None = identity (plain pruning)
    diagonal: bool = False  # A is diagonal: realized as a per-channel scale
    tokens_used: int = 0
    sink_tokens: int = 0  # massive-activation tokens treated specially (see sink_handling)
    sink_handling: str = "included"  # "included" (paper), "excluded" or "capped" (weight capped at the threshold norm)
    ridge: float = 0.0  # ε actually added to the Gram matrix
    condition_number: float = float("nan")  # of the Gram matrix the fit solved with
    notes: tuple[str, ...] = ()  # warnings and fallbacks, shown to the user
    scale: torch.Tensor | None = None  # (C,) per-channel scale r when W = B diag(r) Bᵀ (diag, rotate)
    basis: str | None = None  # the basis B of `scale`: "channel" (B = I) or "hadamard" (B = H)
    ridge_fallback: str | None = None  # why the fit switched to the relative ridge (None: it did not)
    sink_directions: int | None = None  # replaceme_keepsink: sink MLP-output directions on which T = I
    # alternatives of this fit (e.g. each k of replaceme_keepsink); the pipeline keeps the one with the lowest
    # held-out boundary error (`choose_by_heldout`). Memory: one C×C float64 update each, until chosen.
    candidates: tuple[Fit, ...] = ()
    # the map is the scalar s·I, carried by the writers upstream of the cut (model.scaling), not a patch at the cut;
    # with an inner fit, the stream entering the cut is s·(x_pre + aB)
    upstream_scale: float | None = None
    ridge_lambda: float | None = None  # refit: the relative ridge λ of this candidate

    @property
    def label(self) -> str:
        """What tells this fit from the other candidates of its operator ("k 2", "λ 0.1, k 2")."""
        k = f"k {self.sink_directions}"
        return k if self.ridge_lambda is None else f"λ {self.ridge_lambda:g}, {k}"


@dataclass(frozen=True)
class OperatorSpec:
    name: str
    fit: Callable[[BoundaryStats, FitOptions], Fit]
    paper: str
    description: str
    needs: StatNeeds = ALL_NEEDS  # statistics the fit (and its error report) reads
    stock: bool = False  # its variants fold into a stock checkpoint (plain pruning, maps on the MLP branch)
    fold: str = ""  # how its variants fold into stock weights (the export's reason)
    cost: OperatorCost = OperatorCost()  # what its fit works in and its variant keeps (the memory plan)
    # what of the block it must find in the model's family (`Architecture.refusal`): "scale" (a scale on every
    # residual writer, blocks that read the stream through a norm), "branch" (a module computing the MLP branch),
    # "down_proj" (one MLP output projection)
    requires: tuple[str, ...] = ()


OPERATORS: dict[str, OperatorSpec] = {}
REQUIREMENTS = ("writers", "scale", "branch", "mlp", "down_proj")


def register_operator(name: str, *, paper: str, description: str, cost: OperatorCost, needs: StatNeeds = ALL_NEEDS,
                      stock: bool = False, fold: str = "", requires: tuple[str, ...] = ()):
    """Add `fn(stats: BoundaryStats, opts: FitOptions) -> Fit` to OPERATORS; checked at import.

    `needs` names the statistics the fit reads; calibration keeps only the union over the
    requested operators (an operator that does not say gets every statistic). `stock`: the
    operator's variants fold into a stock checkpoint (see `export.fold`), as `fold` says. `cost` (required:
    an entry without it fails at import): the C×C matrices its fit works in and what its variant keeps,
    which the memory plan counts (`memory_parts.fit_bytes`, `kept_bytes`). `requires`: the parts of a block it
    acts on (see `OperatorSpec.requires`); a family without them is refused before any work.
    """
    if not isinstance(cost, OperatorCost):
        raise TypeError(f"operator {name}: cost must be an OperatorCost, not {type(cost).__name__}")

    def decorator(fn):
        check_signature(fn, f"operator {name}", {"stats": BoundaryStats, "opts": FitOptions}, Fit)
        unknown = set(requires) - set(REQUIREMENTS)
        if unknown:
            raise TypeError(f"operator {name}: unknown requirement(s) {sorted(unknown)}; known: {REQUIREMENTS}")
        add(OPERATORS, name, OperatorSpec(name, fn, paper, description, needs, stock, fold, cost, tuple(requires)),
            "operator")
        return fn

    return decorator


def get_operator(name: str) -> OperatorSpec:
    return lookup(OPERATORS, name, "operator")


def needs_of(operators: Iterable[str]) -> StatNeeds:
    """The statistics a set of operators needs: the union of what each declares."""
    needs = StatNeeds()
    for name in operators:
        needs = needs | get_operator(name).needs
    return needs


# ---------------------------------------------------------------- shared maths (ridge solves: recovery.linalg)


def _least_squares_fit(name: str, stats: BoundaryStats, tokens: str, opts: FitOptions, site: str = "residual",
                       sink_handling: str = "included") -> Fit:
    """The unconstrained optimum (XᵀX + εI) M = XᵀΔ (or with m at the branch site) on a token set.

    Memory at fit time: the assembled Gram and cross matrices (2·C²·8 B for "all"/"capped"),
    a regularized copy and the solution; time O(C³).
    """
    equations = stats.normal_equations(tokens, site)
    update, eps, cond, notes = solve_ridge(equations.gram, equations.cross, equations.tokens, opts)
    sinks = stats.sinks.tokens if sink_handling != "included" else 0
    return Fit(name, stats.boundary, site, update, tokens_used=equations.tokens, sink_tokens=sinks,
               sink_handling=sink_handling, ridge=eps, condition_number=cond, notes=notes,
               ridge_fallback=next((n for n in notes if n.startswith(RIDGE_FALLBACK)), None))


# ---------------------------------------------------------------- the operators


@register_operator("none", paper="plain pruning", description="no recovery: W = I", needs=StatNeeds(), stock=True,
                   fold="plain pruning: the kept blocks are unchanged", cost=OperatorCost())
def fit_none(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return Fit("none", stats.boundary, "residual", None, tokens_used=stats.tokens)


def _channel_sums(stats: BoundaryStats, basis: str):
    sums = stats.channel if basis == "channel" else stats.rotated
    if sums is None and basis == "hadamard" and hadamard_factors(stats.width) is None:
        hadamard_transform(torch.zeros(1, stats.width))  # raises the user-facing explanation
    if sums is None:
        raise GhostedError(f"boundary {stats.boundary}: the {basis}-basis sums were not collected "
                           f"(statistics asked for: {stats.needs.describe()}); pass the operator's needs to collect_stats")
    return sums


def _diag_fit(name: str, stats: BoundaryStats, per_window: bool) -> Fit:
    sums = _channel_sums(stats, "channel")
    scale = sums.window_mean_ratio() if per_window else sums.pooled_ratio()  # (C,) over all tokens
    return Fit(name, stats.boundary, "residual", torch.diag(scale - 1.0), diagonal=True, tokens_used=stats.tokens,
               scale=scale, basis="channel")


def _rotate_fit(name: str, stats: BoundaryStats, per_window: bool) -> Fit:
    sums = _channel_sums(stats, "hadamard")
    scale = sums.window_mean_ratio() if per_window else sums.pooled_ratio()  # (C,) over all tokens, rotated basis
    eye = torch.eye(stats.width, dtype=scale.dtype, device=scale.device)
    rot = hadamard_transform(eye)  # (C, C) H, built once here, not cached
    update = (rot * scale) @ rot.T  # H diag(r) Hᵀ
    update.diagonal().sub_(1.0)
    return Fit(name, stats.boundary, "residual", update, tokens_used=stats.tokens, scale=scale, basis="hadamard")


@register_operator("diag", paper="LinearPatch-D",
                   description="per-channel scale mean|X_post| / mean|X_pre|, the ratio averaged over calibration "
                               "windows as the authors' code does (symmetric)",
                   needs=StatNeeds(channel=True), cost=OperatorCost(1, "scale"))
def fit_diag(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _diag_fit("diag", stats, per_window=True)


@register_operator("diag_pooled", paper="LinearPatch-D, pooled (this project)",
                   description="per-channel scale Σ|X_post| / Σ|X_pre| pooled over every calibration token (symmetric)",
                   needs=StatNeeds(channel=True), cost=OperatorCost(1, "scale"))
def fit_diag_pooled(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _diag_fit("diag_pooled", stats, per_window=False)


@register_operator("rotate", paper="LinearPatch-R",
                   description="per-channel scale in a Hadamard-rotated basis, H diag(r) Hᵀ, with the authors' H and "
                               "their per-window average of the ratio (symmetric)",
                   needs=StatNeeds(rotated=True), cost=OperatorCost(4, "rotated"))
def fit_rotate(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _rotate_fit("rotate", stats, per_window=True)


@register_operator("rotate_pooled", paper="LinearPatch-R, pooled (this project)",
                   description="H diag(r) Hᵀ with r = Σ|X_post H| / Σ|X_pre H| pooled over every calibration token "
                               "(symmetric)",
                   needs=StatNeeds(rotated=True), cost=OperatorCost(4, "rotated"))
def fit_rotate_pooled(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _rotate_fit("rotate_pooled", stats, per_window=False)


@register_operator("magcomp", paper="Prune&Comp (arXiv 2507.18212)",
                   description="one scalar s = mean|X_post| / mean|X_pre| on the stream entering the cut, folded into "
                               "the embeddings and every residual writer before it (no C×C statistic)",
                   needs=StatNeeds(channel=True), stock=True,
                   fold="the magnitude scale is folded into the embeddings and the o_proj/down_proj (Gemma3: the "
                        "post-norm gains) of every block before each cut, the final norm's gain divided by it where "
                        "the embeddings are tied (exact up to the RMSNorm ε)",
                   cost=OperatorCost(1, "scale"), requires=("scale",))
def fit_magcomp(stats: BoundaryStats, opts: FitOptions) -> Fit:
    s = magnitude_scale(stats, opts.magcomp_form)
    scale = torch.full((stats.width,), s, dtype=torch.float64)  # (C,) s·1: errors and reports read it like diag's
    note = f"magnitude scale s = {s:.4f} ({opts.magcomp_form})"
    if stats.boundary.start == 0:
        note += "; the cut starts at block 0, so only the embeddings carry it"
    return Fit("magcomp", stats.boundary, "residual", torch.diag(scale - 1.0), diagonal=True, tokens_used=stats.tokens,
               notes=(note,), scale=scale, basis="channel", upstream_scale=s)


LEAST_SQUARES = StatNeeds(residual=True)


@register_operator("ghost", paper="Ghosted Layers",
                   description="least-squares optimum W = I + M, (XᵀX + εI) M = XᵀΔ over all calibration tokens",
                   needs=LEAST_SQUARES, cost=OperatorCost(5, "matrix"))
def fit_ghost(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost", stats, "all", opts)


@register_operator("ghost_capped", paper="Ghosted Layers, sink-aware (this project)",
                   description="ghost with each massive-activation (attention-sink) token scaled down to the sink "
                               "threshold norm: sinks still constrain W but no longer dominate XᵀX",
                   needs=LEAST_SQUARES, cost=OperatorCost(5, "matrix"))
def fit_ghost_capped(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost_capped", stats, "capped", opts, sink_handling="capped")


@register_operator("ghost_nosink", paper="Ghosted Layers, sink-free (this project)",
                   description="ghost fit on ordinary tokens only: massive-activation tokens left out of the statistics",
                   needs=LEAST_SQUARES, cost=OperatorCost(3, "matrix"))
def fit_ghost_nosink(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _least_squares_fit("ghost_nosink", stats, "ordinary", opts, sink_handling="excluded")


BRANCH = StatNeeds(branch=True)
REPLACEME_FOLD = ("the map on the MLP output of the block before each cut is folded into that block's down_proj "
                  "(exact: the projection writes only to the residual stream)")


def _unrecovered_branch(name: str, stats: BoundaryStats) -> Fit | None:
    """ReplaceMe's family needs block s−1: a boundary at block 0 stays unrecovered (None: the fit can run)."""
    if stats.boundary.start > 0:
        return None
    note = f"ReplaceMe needs the block before the boundary; boundary {stats.boundary} starts at block 0 and is left unrecovered"
    log.warning(note)
    return Fit(name, stats.boundary, "branch", None, tokens_used=stats.tokens, notes=(note,))


@register_operator("replaceme", paper="ReplaceMe-LS",
                   description="least-squares map on block s−1's MLP output, folded into its down projection",
                   needs=BRANCH, stock=True, fold=REPLACEME_FOLD, cost=OperatorCost(5, "branch"), requires=("branch",))
def fit_replaceme(stats: BoundaryStats, opts: FitOptions) -> Fit:
    # m T ≈ Δ + m  ⇔  T = I + A with (mᵀm + εI) A = mᵀΔ
    return _unrecovered_branch("replaceme", stats) or _least_squares_fit("replaceme", stats, "all", opts, site="branch")


def sink_directions(stats: BoundaryStats, count: int) -> torch.Tensor:
    """(C, k) top directions of the sink tokens' MLP outputs m (kept rows, plus spilled moments)."""
    sinks = stats.sinks
    spilled = None if sinks.spill is None else sinks.spill.mtm
    return principal_directions(sinks.branch, spilled, count, stats.width)


def solve_keeping(gram: torch.Tensor, cross: torch.Tensor, keep: torch.Tensor, tokens: int,
                  opts: FitOptions) -> tuple[torch.Tensor, float, float, tuple[str, ...]]:
    """A = P B minimizing ‖m P B − Δ‖² + ε‖B‖², P = I − UUᵀ, U = `keep` (C, k) orthonormal.

    Then T = I + A is the identity on the directions U (u T = u) and the least-squares optimum
    on the rest. In the basis [Q U] with Q spanning range(P), the normal equations are
    (QᵀGQ + εI) B̃ = QᵀR, A = Q B̃: the same solution as (PGP + c·UUᵀ + εI) A = P R (any c > 0
    makes the U block invertible and its right-hand side is 0, so UᵀA = 0), which needs no Q
    (`linalg.projected_normal_equations`). Memory: four C×C float64 matrices beyond the statistics (PGP, PR, the regularized copy, A);
    time O(C²·k) plus one solve and one condition number, O(C³).
    """
    if keep.shape[1] == 0:
        return solve_ridge(gram, cross, tokens, opts)
    pgp, rhs = projected_normal_equations(gram, cross, keep)  # (C, C) each
    update, eps, cond, notes = solve_ridge(pgp, rhs, tokens, opts)
    update -= keep @ (keep.T @ update)  # exactly 0 on U (it already is up to rounding)
    return update, eps, cond, notes


def candidate_note(best: Fit, errors: dict[str, float | None], where: str) -> str:
    """Which candidate was kept and every candidate's boundary error (k: sink directions held as identity)."""
    table = ", ".join(f"{label}: {'-' if e is None else f'{e:.3f}'}" for label, e in errors.items())
    ridge = "" if best.ridge_lambda is None else f"ridge λ {best.ridge_lambda:g} and "
    return (f"kept {ridge}{best.sink_directions} sink direction(s) as identity (boundary error on {where} tokens "
            f"by candidate: {table})")


def choose_by_calibration(candidates: list[Fit], stats: BoundaryStats) -> Fit:
    """The candidate with the lowest calibration boundary error (all tokens), carrying every candidate for the
    held-out choice (`choose_by_heldout`) and a note of their errors."""
    errors = {}
    for candidate in candidates:
        squared = calibration_errors(candidate, stats)
        errors[candidate.label] = None if squared is None else relative(squared[0], stats.dd)
    best = min(candidates, key=lambda f: math.inf if errors[f.label] is None else errors[f.label])
    note = candidate_note(best, errors, "calibration")
    log.info("%s at %s: %s", best.operator, stats.boundary, note)
    return replace(best, notes=(*best.notes, note), candidates=tuple(candidates) if len(candidates) > 1 else ())


@register_operator("replaceme_keepsink", paper="ReplaceMe-LS, sink-preserving (this project)",
                   description="ReplaceMe fitted on ordinary tokens with T = I on the sink tokens' top MLP-output "
                               "directions (their number chosen by held-out error); folded into block s−1's down "
                               "projection", needs=BRANCH, stock=True, fold=REPLACEME_FOLD,
                   cost=OperatorCost(5, "branch", candidates=True), requires=("branch",))
def fit_replaceme_keepsink(stats: BoundaryStats, opts: FitOptions) -> Fit:
    """The sink token's MLP output is massive; any T ≠ I on it breaks the sink for every block after.

    Fit on ordinary tokens only, T = I + P·B with P = I − UUᵀ, U the top-k directions of the
    sink tokens' MLP outputs. One candidate per k in `opts.sink_directions`; the fit returned is
    the best on calibration tokens (all of them), and carries every candidate so that the
    pipeline keeps the one with the lowest held-out boundary error (`choose_by_heldout`).
    Memory O(C²) per candidate; time one SVD of the sink rows plus one O(C³) solve per k.
    """
    name = "replaceme_keepsink"
    unrecovered = _unrecovered_branch(name, stats)
    if unrecovered is not None:
        return unrecovered
    ordinary = stats.token_set("ordinary", "branch")
    directions = sink_directions(stats, max(opts.sink_directions))
    candidates = []
    for k in sorted({min(k, directions.shape[1]) for k in opts.sink_directions}):
        update, eps, cond, notes = solve_keeping(ordinary.mtm, ordinary.mtd, directions[:, :k], ordinary.tokens, opts)
        candidates.append(Fit(name, stats.boundary, "branch", update, tokens_used=ordinary.tokens,
                              sink_tokens=stats.sinks.tokens, sink_handling="identity", ridge=eps,
                              condition_number=cond, notes=notes, sink_directions=k,
                              ridge_fallback=next((n for n in notes if n.startswith(RIDGE_FALLBACK)), None)))
    return choose_by_calibration(candidates, stats)


REFIT_FOLD = ("the change of the block before each cut's down_proj is added to its weight (exact: the projection "
              "writes only to the residual stream)")


def _refit(name: str, stats: BoundaryStats, opts: FitOptions, scale: float | None) -> Fit:
    """The down_proj refit at one boundary (see recovery.refit), with every (λ, k) candidate for the held-out
    choice; where it cannot apply (a cut at block 0, a norm after the MLP), only the scale (or nothing)."""
    if not stats.has_inner:
        why = "the cut starts at block 0" if stats.boundary.start == 0 else \
            "no one down_proj writes the stream in this family (a norm after the MLP, as Gemma's and OLMo's " \
            "post_feedforward_layernorm, or experts)"
        note = f"{name}: no down_proj refit at boundary {stats.boundary}: {why}"
        log.warning(note)
        if scale is None:
            return Fit(name, stats.boundary, "inner", None, tokens_used=stats.tokens, notes=(note,))
        ones = torch.full((stats.width,), scale, dtype=torch.float64)  # (C,) the scale alone, as magcomp
        return Fit(name, stats.boundary, "residual", torch.diag(ones - 1.0), diagonal=True, tokens_used=stats.tokens,
                   notes=(note,), scale=ones, basis="channel", upstream_scale=scale)
    solutions = refit_solutions(stats, scale, opts.refit_lambdas, opts.refit_sink_directions)
    note = () if scale is None else (f"magnitude scale s = {scale:.4f} ({opts.magcomp_form})",)
    candidates = [Fit(name, stats.boundary, "inner", sol.update, tokens_used=stats.ordinary.tokens,
                      sink_tokens=stats.sinks.tokens, sink_handling="identity", ridge=sol.epsilon, notes=note,
                      sink_directions=sol.sink_directions, ridge_lambda=sol.ridge_lambda, upstream_scale=scale)
                  for sol in solutions]
    return choose_by_calibration(candidates, stats)


INNER = StatNeeds(inner=True)


@register_operator("refit", paper="down_proj refit, sink-preserving (this project)",
                   description="the change B of block s−1's down_proj fitted on its intermediate activations (I "
                               "features), zero on the sink tokens' span, relative ridge; ridge and sink count "
                               "chosen by held-out error; folded into that down_proj", needs=INNER, stock=True,
                   fold=REFIT_FOLD, cost=OperatorCost(0, "refit", refit=True), requires=("down_proj",))
def fit_refit(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _refit("refit", stats, opts, None)


@register_operator("magcomp_refit", paper="Prune&Comp's magnitude compensation + down_proj refit (this project)",
                   description="magcomp's scalar upstream of the cut, then the down_proj refit fitted for what it "
                               "leaves (target X_post/s − X_pre); both folded",
                   needs=StatNeeds(channel=True, inner=True, inner_stream=True), stock=True,
                   fold=f"{REFIT_FOLD}, and the magnitude scale into the embeddings and every residual writer "
                        "before each cut (the final norm's gain divided by it where the head is tied)",
                   cost=OperatorCost(1, "refit", refit=True), requires=("scale",))
def fit_magcomp_refit(stats: BoundaryStats, opts: FitOptions) -> Fit:
    return _refit("magcomp_refit", stats, opts, magnitude_scale(stats, opts.magcomp_form))


def choose_by_heldout(fit: Fit, errors: list[BoundaryErrors | None]) -> Fit:
    """The candidate of `fit` with the lowest held-out boundary error (all tokens), `errors` in
    the order of `fit.candidates`; `fit` itself when there are none or nothing was held out."""
    if not fit.candidates or any(e is None or e.relative is None for e in errors):
        return replace(fit, candidates=())
    by_label = {c.label: e.relative for c, e in zip(fit.candidates, errors)}
    best = min(zip(fit.candidates, errors), key=lambda pair: pair[1].relative)[0]
    note = candidate_note(best, by_label, "held-out")
    log.info("%s at %s: %s", fit.operator, fit.boundary, note)
    return replace(best, notes=(*best.notes, note), candidates=())


# ---------------------------------------------------------------- assessment


def squared_error(fit: Fit, moments: Moments) -> float:
    """‖U(I + A) − (U + Δ)‖² = tr(AᵀUᵀUA) − 2 tr(AᵀUᵀΔ) + ‖Δ‖², U = X_pre or m, from the moments alone."""
    if fit.update is None:
        return float(moments.dd)
    gram, cross = (moments.xtx, moments.xtd) if fit.site == "residual" else (moments.mtm, moments.mtd)
    a = fit.update.to(gram.device)
    value = (gram @ a * a).sum() - 2 * (a * cross).sum() + moments.dd
    return max(float(value), 0.0)


def calibration_errors(fit: Fit, stats: BoundaryStats) -> tuple[float, float] | None:
    """(Σ‖x W − y‖² over all calibration tokens, … over ordinary tokens), from the statistics alone.

    A per-channel fit reads its basis' sums (no C×C); a full fit the ordinary moments plus the
    sink rows, applied directly (O(k·C²)). None when the statistics needed were not collected.
    """
    if fit.update is None:
        return stats.dd, stats.ordinary.dd
    if fit.site == "inner":
        return refit_squared_errors(stats, fit.update, fit.upstream_scale) if stats.has_inner else None
    if fit.basis is not None and fit.scale is not None:
        sums = stats.channel if fit.basis == "channel" else stats.rotated
        if sums is None:
            return None
        return sums.scale_error(fit.scale), sums.scale_error(fit.scale, slice(0, 1))
    residual = fit.site == "residual"
    if (stats.ordinary.xtx if residual else stats.ordinary.mtm) is None:
        return None
    ordinary = squared_error(fit, stats.ordinary)
    sinks = stats.sinks
    a = fit.update.to(sinks.delta.device)
    rows = sinks.x_pre if residual else sinks.branch
    sink = 0.0
    if rows is not None and sinks.kept:
        sink = float(((rows @ a - sinks.delta) ** 2).sum())  # (k, C): ‖U A − Δ‖² on the kept rows
    if sinks.spill is not None:
        sink += squared_error(fit, sinks.spill)
    return ordinary + sink, ordinary
