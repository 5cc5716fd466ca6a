"""The LM head as evaluation and training read it: float32 logits, scaled or soft-capped where the family does."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel


def softcapped(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """`logits` as the model's own head finishes them: divided by Granite's `logits_scaling`, soft-capped where
    the family caps them (Gemma-2: tanh(z / cap)·cap). Both are config scalars, read wherever a family sets them."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling and scaling != 1:
        logits = logits / scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits (N, V) of final hidden states (N, C), finished as the model's own head does (`softcapped`).
    Memory: N × V × 4 B (plus the head's own output in the model's dtype)."""
    return softcapped(model.config, model.lm_head(hidden).float())
