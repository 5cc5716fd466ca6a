"""A low-rank change of a stock linear layer, kept beside the shared weight until an export merges it.

Distillation can "heal" a pruned model with low-rank changes of the kept blocks' projections, as the
layer-pruning papers do with LoRA. `LowRankLinear` wraps the dense model's own `nn.Linear` (shared,
never changed) and adds x ↦ (x Aᵀ) Bᵀ · scale: the view copies no weight, and an export folds the
change into a stock weight W' = W + scale · B A (`merged_weight`), so the model stays stock.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LowRankLinear(nn.Module):
    """y = base(x) + scale · (x Aᵀ) Bᵀ, with A (r, in) and B (out, r) in float32; `base` is shared.

    B starts at zero, so the wrapped layer computes exactly what `base` does until B is trained.
    Memory: r·(in + out) float32 parameters; time: two thin matmuls beside the base one.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None, generator: torch.Generator | None = None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be at least 1 (got {rank})")
        self.base = base
        device = base.weight.device
        bound = 1.0 / math.sqrt(base.in_features)  # A ~ U(−1/√in, 1/√in): Kaiming-uniform's bound for a = √5
        a = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        self.lora_a = nn.Parameter(a.to(device))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=device))  # (out, r)
        self.scale = float(alpha if alpha is not None else rank) / rank

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (what code reading `.weight` of a projection expects, e.g. its dtype and device)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T  # (…, out)
        return self.base(x) + (delta * self.scale).to(x.dtype)

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (the base's, as read for an export) plus the change, in its dtype: W + scale · B A."""
        b, a = (factor.detach().to(weight.device).double() for factor in (self.lora_b, self.lora_a))
        return (weight.double() + (b @ a) * self.scale).to(weight.dtype)  # on the weight's device (meta: no data)

    def extra_repr(self) -> str:
        return f"rank={self.lora_a.shape[0]}, scale={self.scale:g}"
