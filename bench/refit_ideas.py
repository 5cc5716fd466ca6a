"""Stock-foldable ideas measured beside the library's operators in bench/quality.py, that did not earn a place there.

Each function returns pruned variants that are stock checkpoints (every change lands in stock
weights), built on one setting's dense statistics and calibration batches:

- `magcomp_keepsink`: magcomp's scalar upstream of each cut, then ReplaceMe's sink-preserving map on
  block s−1's MLP output fitted for what it leaves (target X_post/s − X_pre); issue 18 asks whether
  the two folds combine. Its moments come from the refit's: m = a W_downᵀ, so mᵀm = W aᵀa Wᵀ and
  mᵀ(target) = W aᵀ(target); the sink count is the one replaceme_keepsink chose by held-out error.
- `magcomp_refit_down`: magcomp_refit, then a refit of the down_proj of the first block after each
  cut, fitted on the recovered model's own activations against the dense stream after that block
  (a second basis of I features, one block later). One more calibration pass per boundary.
- `joint_o_refit`: the refit fitted jointly on block s−1's o_proj input z and down_proj input a
  ([z, a] B ≈ Δ, zero on the sink rows' span), folded into both projections. Approximate: a change
  of o_proj changes what that block's MLP reads, which the joint fit ignores.
- `gemma_gains` (Gemma-3, whose refits do not fold): a per-channel gain t on block s−1's
  post_feedforward_layernorm output (least squares per channel on ordinary tokens), folded exactly
  into that norm's gain, (1 + γ') = t·(1 + γ); and, where a cut reaches the end, the final norm's
  gain refitted per channel on normalized streams.
Ridge and sink counts follow the library's refit (λ ∈ {0.1, 1}, k ∈ {0, 1, 2, 4}, chosen by held-out
boundary error on rows captured here). Memory: the captured rows of the calibration batches
(tokens × (I + C) float64 per boundary at these bench sizes); time: one capture pass each.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.calibration.capture import capture, down_projection, run_forward, unwrap
from ghosted_core.calibration.collect import sink_mask
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.linalg import principal_directions, projected_normal_equations
from ghosted_core.recovery.magcomp import cut_index, magnitude_scale
from ghosted_core.recovery.modules import branch_replacement, refit_replacement
from ghosted_core.recovery.operators import Fit, get_operator, solve_keeping
from ghosted_core.recovery.refit import refit_cross
from ghosted_core.run.fitting import assemble_variant, choose_fit
from ghosted_core.statistics import BoundaryStats

LAMBDAS = (0.1, 1.0)
COUNTS = (0, 1, 2, 4)


def _record(plan: PruningPlan, name: str) -> dict:
    return {"dense_layers": plan.num_layers, "removed_layers": list(plan.removed),
            "boundaries": [[b.start, b.end] for b in plan.boundaries], "operator": name, "sequential": False}


def _rows(model: PreTrainedModel, batches, heldout: bool, hooks: dict, residuals: dict, options,
          dense: PreTrainedModel | None = None, dense_residuals: dict | None = None) -> dict[str, torch.Tensor]:
    """float64 (tokens, ·) rows: `hooks` name → (module, "input" of its forward), `residuals` name → layer index of
    `model`, `dense_residuals` name → dense index; plus "sinks", the sink mask of the first two residuals."""
    out: dict[str, list[torch.Tensor]] = {}
    for batch in [b for b in batches if b.heldout == heldout]:
        seen_hooks: dict[str, torch.Tensor] = {}
        handles = [module.register_forward_pre_hook(lambda _m, args, key=key: seen_hooks.__setitem__(key, args[0]))
                   for key, module in hooks.items()]
        try:
            with capture(model, set(residuals.values())) as seen:
                run_forward(model, batch.input_ids)
        finally:
            for handle in handles:
                handle.remove()
        tensors = {key: seen[("residual", j)] for key, j in residuals.items()} | seen_hooks
        if dense is not None:
            with capture(dense, set(dense_residuals.values())) as seen_dense:
                run_forward(dense, batch.input_ids)
            tensors |= {key: seen_dense[("residual", j)] for key, j in dense_residuals.items()}
        first, second = (tensors[k] for k in ("x", "y"))
        valid = torch.ones(batch.input_ids.shape, dtype=torch.bool)
        tensors["sinks"] = sink_mask(first, second.to(first.device), valid.to(first.device), options)
        for key, value in tensors.items():
            out.setdefault(key, []).append(value.reshape(-1, *value.shape[2:]).double() if key != "sinks"
                                          else value.reshape(-1))
    return {key: torch.cat(values) for key, values in out.items()}


def _fit_rows(fit_rows: dict, held_rows: dict, feature: str, target) -> torch.Tensor:
    """The (λ, k) refit on captured rows with the lowest held-out boundary error: B (F, C) float64."""
    ordinary = ~fit_rows["sinks"]
    a, t = fit_rows[feature], target(fit_rows)
    gram, cross = a[ordinary].T @ a[ordinary], a[ordinary].T @ t[ordinary]
    directions = principal_directions(a[fit_rows["sinks"]], None, max(COUNTS), a.shape[1])
    held_a, held_t = held_rows[feature], target(held_rows)
    best, best_error = None, math.inf
    for k in sorted({min(k, directions.shape[1]) for k in COUNTS}):
        keep = directions[:, :k]
        pgp, rhs = projected_normal_equations(gram, cross, keep) if k else (gram, cross)
        for lam in LAMBDAS:
            regularized = pgp.clone()
            regularized.diagonal().add_(lam * float(torch.trace(gram)) / gram.shape[0])
            update = torch.linalg.solve(regularized, rhs)
            update -= keep @ (keep.T @ update)
            error = float(((held_a @ update - held_t) ** 2).sum())
            if error < best_error:
                best, best_error = update, error
    return best


def magcomp_keepsink(dense: PreTrainedModel, plan: PruningPlan, stats: list[BoundaryStats], batches,
                     options) -> PreTrainedModel | None:
    """magcomp + replaceme_keepsink in m space (see the module docstring); None where no boundary has a refit."""
    replacements, scales = {}, {}
    blocks = dense.model.layers
    for st in stats:
        if not st.has_inner:
            continue
        s = magnitude_scale(st, options.fit.magcomp_form)
        keep = choose_fit(dense, get_operator("replaceme_keepsink").fit(st, options.fit), batches, options)
        w = blocks[st.boundary.start - 1].mlp.down_proj.weight.double()  # (C, I)
        gram, cross = w @ st.ordinary.ata @ w.T, w @ refit_cross(st, s)  # (C, C) mᵀm, mᵀ(X_post/s − X_pre)
        rows = None if st.sinks.inner is None else st.sinks.inner @ w.T  # (k, C) the sinks' m
        directions = principal_directions(rows, None, keep.sink_directions or 0, st.width)
        update, *_ = solve_keeping(gram, cross, directions, st.ordinary.tokens, options.fit)
        fit = Fit("magcomp_keepsink", st.boundary, "branch", update)
        replacements[st.boundary.start - 1] = branch_replacement(fit, blocks[st.boundary.start - 1], architecture_of(dense.config))
        scales[st.boundary.start] = s
    if not replacements:
        return None
    return assemble_variant(dense, plan.removed, {}, replacements, scales, _record(plan, "magcomp_keepsink"))


def magcomp_refit_down(dense: PreTrainedModel, plan: PruningPlan, fits: list[Fit], batches,
                       options) -> PreTrainedModel | None:
    """`fits` (magcomp_refit's, chosen) plus a refit of the down_proj of the first block after each cut."""
    from ghosted_core.run.fitting import _realize

    patches, replacements, scales = _realize(dense, fits)
    starts = {b.start for b in plan.boundaries}
    added = False
    for boundary in plan.boundaries:
        j = boundary.end  # dense index of the first block after the cut
        if j >= plan.num_layers or j + 1 in starts:  # no block after the cut, or it already is the next cut's s−1
            continue
        view = assemble_variant(dense, plan.removed, patches, replacements, scales, _record(plan, "x"))
        i = cut_index(j + 1, plan.removed)  # view index of the block after j
        block = view.model.layers[i - 1]
        hooks = {"a": down_projection(view, block)}
        kwargs = dict(hooks=hooks, residuals={"x": i}, options=options.calibrate, dense=dense,
                      dense_residuals={"y": j + 1})
        fit_rows, held_rows = _rows(view, batches, False, **kwargs), _rows(view, batches, True, **kwargs)
        update = _fit_rows(fit_rows, held_rows, "a", lambda r: r["y"] - r["x"])
        replacements[j] = refit_replacement(Fit("down", boundary, "inner", update), unwrap(dense.model.layers[j]),
                                           architecture_of(dense.config))
        added = True
    if not added:
        return None
    return assemble_variant(dense, plan.removed, patches, replacements, scales, _record(plan, "magcomp_refit_down"))


def joint_o_refit(dense: PreTrainedModel, plan: PruningPlan, stats: list[BoundaryStats], batches,
                  options) -> PreTrainedModel | None:
    """[z, a] B ≈ Δ at block s−1 (o_proj and down_proj inputs), folded into both projections."""
    replacements = {}
    for st in stats:
        if not st.has_inner:
            continue
        block = dense.model.layers[st.boundary.start - 1]
        hooks = {"z": block.self_attn.o_proj, "a": block.mlp.down_proj}
        kwargs = dict(hooks=hooks, residuals={"x": st.boundary.start, "y": st.boundary.end}, options=options.calibrate)
        fit_rows, held_rows = _rows(dense, batches, False, **kwargs), _rows(dense, batches, True, **kwargs)
        for rows in (fit_rows, held_rows):
            rows["za"] = torch.cat([rows["z"], rows["a"]], 1)  # (tokens, Z + I)
        update = _fit_rows(fit_rows, held_rows, "za", lambda r: r["y"] - r["x"])
        width = fit_rows["z"].shape[1]
        o_proj = _changed_linear(block.self_attn.o_proj, update[:width])
        down = refit_replacement(Fit("joint", st.boundary, "inner", update[width:]), block, architecture_of(dense.config))
        replacements[st.boundary.start - 1] = {"self_attn.o_proj": o_proj, **down}
    if not replacements:
        return None
    return assemble_variant(dense, plan.removed, {}, replacements, {}, _record(plan, "joint_o_refit"))


def _changed_linear(linear: nn.Linear, update: torch.Tensor) -> nn.Linear:
    """A new Linear whose weight is W + updateᵀ (update (in, out)), bias shared."""
    new = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, device=linear.weight.device)
    new.weight = nn.Parameter((linear.weight.double() + update.T).to(linear.weight.dtype), requires_grad=False)
    if linear.bias is not None:
        new.bias = linear.bias
    return new


def _norm_with_gain(norm: nn.Module, factor: torch.Tensor, offset: float) -> nn.Module:
    """A copy of an RMSNorm (a C-vector) whose effective gain (offset + γ) is multiplied by `factor`."""
    new = copy.copy(norm)
    new._parameters = dict(norm._parameters)
    gain = offset + norm.weight.double()
    new.weight = nn.Parameter((gain * factor - offset).to(norm.weight.dtype), requires_grad=False)
    return new


def gemma_gains(dense: PreTrainedModel, plan: PruningPlan, stats: list[BoundaryStats], batches,
                options) -> PreTrainedModel | None:
    """Per-channel gains folded into Gemma-3's post_feedforward_layernorm before each cut (and the final norm
    where a cut reaches the end), fitted on ordinary tokens; None for other families."""
    if dense.config.model_type != "gemma3_text":
        return None
    offset = architecture_of(dense.config).norm_gain_offset  # Gemma's norms multiply by 1 + γ
    replacements, final = {}, None
    for st in stats:
        if st.boundary.start > 0 and st.ordinary.mtm is not None:
            m2 = st.ordinary.mtm.diagonal()  # (C,) Σ m_c² over ordinary tokens
            t = 1 + torch.where(m2 > 0, st.ordinary.mtd.diagonal() / m2.clamp_min(1e-30), torch.zeros_like(m2))
            norm = dense.model.layers[st.boundary.start - 1].post_feedforward_layernorm
            replacements[st.boundary.start - 1] = {"post_feedforward_layernorm": _norm_with_gain(norm, t, offset)}
        if st.boundary.end == plan.num_layers:
            kwargs = dict(hooks={}, residuals={"x": st.boundary.start, "y": st.boundary.end},
                          options=options.calibrate)
            rows = _rows(dense, batches, False, **kwargs)
            norm = dense.model.norm
            ordinary = ~rows["sinks"]
            x, y = (norm(rows[k][ordinary].to(norm.weight.dtype)).double() for k in ("x", "y"))  # (tokens, C)
            final = _norm_with_gain(norm, (x * y).sum(0) / (x * x).sum(0).clamp_min(1e-30), offset)
    if not replacements and final is None:
        return None
    model = assemble_variant(dense, plan.removed, {}, replacements, {}, _record(plan, "gemma_gains"))
    if final is not None:
        model.model._modules["norm"] = final
    return model
