"""A fit as the `nn.Module`s a variant needs: a residual-stream operator, or ReplaceMe's branch replacement.

Operators are float32 modules on the device of the block they feed (the module classes live in
`model.modeling_ghosted`, shared with remote-code exports).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

from ghosted_core.architectures import Architecture
from ghosted_core.calibration.capture import branch_module
from ghosted_core.model.loading import module_device
from ghosted_core.model.modeling_ghosted import ResidualLinear, ResidualScale  # shared with remote-code exports
from ghosted_core.recovery.operators import Fit

log = logging.getLogger(__name__)


def residual_module(fit: Fit, device: torch.device) -> nn.Module:
    """The boundary module realizing a residual-site fit."""
    if fit.diagonal:
        return ResidualScale(torch.diagonal(fit.update) + 1.0).to(device)
    weight = fit.update.to(torch.float32, copy=True)  # (C, C): I + M rounded once, as float32 of the float64 sum
    weight.diagonal().copy_(1.0 + torch.diagonal(fit.update))
    return ResidualLinear(weight).to(device)


def _folded_linear(down: nn.Linear, update: torch.Tensor) -> nn.Linear:
    """y = a W_downᵀ + b  →  y T = a (Tᵀ W_down)ᵀ + b T, with T = I + A: Tᵀ W_down = W_down + Aᵀ W_down.
    Memory: the weight in float64 and the product (2·C·I·8 B) beside A; T itself is never formed."""
    update = update.to(down.weight.device)  # (C, C) A
    dense = down.weight.to(torch.float64)  # (C, I)
    weight = torch.addmm(dense, update.T, dense)  # (C, I)
    del dense
    folded = nn.Linear(down.in_features, down.out_features, bias=down.bias is not None,
                       device="meta", dtype=down.weight.dtype)  # no weights of its own until assigned
    folded.weight = nn.Parameter(weight.to(down.weight.dtype), requires_grad=False)
    if down.bias is not None:
        bias = down.bias.to(torch.float64)  # (C,)
        folded.bias = nn.Parameter(torch.addmv(bias, update.T, bias).to(down.bias.dtype), requires_grad=False)
    return folded


def _folded_experts(experts: nn.Module, update: torch.Tensor, transposed: bool) -> nn.Module:
    """Fused experts whose weighted sum is the MLP output, with T = I + A after it folded into every expert's down
    projection: (E, C, I) W_e ↦ W_e + Aᵀ W_e, or, stored (E, I, C) and applied x @ W, W_e ↦ W_e + W_e A; a bias
    (E, C) b_e ↦ b_e + b_e A. A view: the other expert weights are shared. Memory: E·C·I·8 B in float64 while
    computed, then one copy in the model's dtype."""
    from ghosted_core.model.surgery import shallow_view

    down = experts.down_proj
    a = update.to(down.device)  # (C, C)
    w = down.detach().to(torch.float64)
    changed = w + (w @ a if transposed else a.T @ w)  # (E, I, C) or (E, C, I)
    view = shallow_view(experts)
    view.down_proj = nn.Parameter(changed.to(down.dtype), requires_grad=False)
    bias = getattr(experts, "down_proj_bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.detach().to(torch.float64)  # (E, C)
        view.down_proj_bias = nn.Parameter((b + b @ a).to(bias.dtype), requires_grad=False)
    return view


def _foldable(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return module.weight.device.type != "meta"
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.Tensor) and down.ndim == 3 and down.device.type != "meta"


def branch_replacement(fit: Fit, block: nn.Module, arch: Architecture) -> dict[str, nn.Module]:
    """Submodule replacements inside block s−1 realizing a branch-site fit (ReplaceMe).

    The MLP output is a sum of what its writers produce (a down_proj; or every expert and a shared expert, each
    linear in its down projection), so a map T after it folds into each of them (zero inference cost) when it is
    added to the residual as is. It is an explicit C×C map after the branch where a norm follows the MLP (Gemma,
    OLMo) or the weights are offloaded.
    """
    target = branch_module(block, arch)
    writers = [w for w in arch.writers_under(arch.branch) if _has(block, w)] if arch.branch_folds else []
    if writers and all(_foldable(block.get_submodule(w)) for w in writers):
        out = {}
        for path in writers:
            module = block.get_submodule(path)
            out[path] = _folded_linear(module, fit.update) if isinstance(module, nn.Linear) else \
                _folded_experts(module, fit.update, arch.experts_transposed)
        return out
    transform = torch.eye(fit.update.shape[0], dtype=torch.float64, device=fit.update.device) + fit.update  # T (C, C)
    name = next(n for n, m in block.named_children() if m is target)
    return {name: nn.Sequential(target, ResidualLinear(transform).to(module_device(target)))}


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def refit_replacement(fit: Fit, block: nn.Module, arch: Architecture) -> dict[str, nn.Module]:
    """Block s−1's down_proj with the refit's change added: W_down' = W_down + Bᵀ (a new stock Linear).

    Memory: one I×C weight in the model's dtype (the dense one is shared, not changed); an offloaded
    down_proj is read from its offload once, and the new one lives on its execution device.
    """
    down = block.get_submodule(arch.down_proj)
    offloaded = has_offloaded_params(down)
    with align_module_device(down, torch.device("cpu")) if offloaded else contextlib.nullcontext():
        weight = down.weight.detach()  # (C, I)
        bias = None if down.bias is None else down.bias.detach()
        device = module_device(down) if offloaded else weight.device
        changed = weight.to(torch.float64) + fit.update.to(weight.device, torch.float64).T  # (C, I)
        refit = nn.Linear(down.in_features, down.out_features, bias=bias is not None, device="meta",
                          dtype=weight.dtype)  # no weights of its own until assigned
        refit.weight = nn.Parameter(changed.to(device, weight.dtype), requires_grad=False)
        if bias is not None:
            refit.bias = nn.Parameter(bias.to(device), requires_grad=False)
    return {arch.down_proj: refit}
