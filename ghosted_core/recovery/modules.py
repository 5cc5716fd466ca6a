"""A fit as the `nn.Module`s a variant needs: a residual-stream operator, or ReplaceMe's branch replacement.

Operators are float32 modules on the device of the block they feed (the module classes live in
`model.modeling_ghosted`, shared with remote-code exports).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ghosted_core.calibration.capture import branch_module
from ghosted_core.model.loading import module_device
from ghosted_core.model.modeling_ghosted import ResidualLinear, ResidualScale  # shared with remote-code exports
from ghosted_core.recovery.operators import Fit

log = logging.getLogger(__name__)



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
