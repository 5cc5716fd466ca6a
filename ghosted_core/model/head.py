"""The LM head as evaluation and training read it: float32 logits, soft-capped where the family caps them."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel


def softcapped(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """`logits` with the model's final soft-capping (Gemma-2: tanh(z / cap)·cap) where it has one."""
    softcap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits (N, V) of final hidden states (N, C), with the model's final soft-capping where it has one.
    Memory: N × V × 4 B (plus the head's own output in the model's dtype)."""
    return softcapped(model.config, model.lm_head(hidden).float())
