"""A pruned causal LM with training-free boundary operators (Ghosted Layers), for plain transformers.

This file is self-contained on purpose: it imports only torch and transformers. Ghosted
Layers Studio copies it verbatim into every `remote_code` export as `modeling_ghosted.py`,
and `config.json` points at it through `auto_map`, so
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` rebuilds the model
without ghosted_core installed. The library itself imports the same classes, so the
in-memory variants and the exported ones run the same code.

A variant is a stock model with fewer blocks plus small operator modules:
- "patch": x ↦ x W applied to the residual stream entering a block (or the final norm),
  wrapping that module (`PatchedBlock`);
- "after": m ↦ m T applied to a module's output (ReplaceMe's map on the MLP branch where
  it cannot be folded into `down_proj`), as `nn.Sequential(module, operator)`.
`config.ghosted_layout` lists them ({"path", "kind", "type", "width"}). A map on the whole
residual stream does not fold into stock weights (every RMSNorm after it would see ‖xW‖
instead of ‖x‖), which is why these variants need this file.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualLinear(nn.Module):
    """x ↦ x W on the residual stream at a boundary (W = I + M), applied in the model's dtype.

    W is kept in float32 (saved, reloaded and cast from there); the product runs in x's dtype,
    like every other linear layer of the model (a bf16 GEMM accumulates in fp32 and rounds once,
    and the identity part of W is exact in bf16). The input is moved to the operator's device,
    which is that of the block it feeds.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float32), requires_grad=False)  # (C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.device) @ self.weight.to(x.dtype)  # (…, C); the cast is a no-op in fp32

    def matrix(self) -> torch.Tensor:
        return self.weight.detach()


class ResidualScale(nn.Module):
    """x ↦ x diag(s): a per-channel scale (LinearPatch-D), kept in float32 and applied in x's dtype."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.scale = nn.Parameter(scale.to(torch.float32), requires_grad=False)  # (C,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.scale.device) * self.scale.to(x.dtype)

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.scale.detach())


class PatchedBlock(nn.Module):
    """Apply a boundary operator to the incoming residual stream, then run the wrapped module."""

    def __init__(self, patch: nn.Module, inner: nn.Module):
        super().__init__()
        self.patch = patch
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        return self.inner(self.patch(hidden_states), *args, **kwargs)


OPERATOR_TYPES = {cls.__name__: cls for cls in (ResidualLinear, ResidualScale)}


def empty_operator(kind: str, width: int) -> nn.Module:
    """An operator of type `kind` (a name in OPERATOR_TYPES) and width C, to be filled from a checkpoint."""
    if kind not in OPERATOR_TYPES:
        raise ValueError(f"unknown Ghosted Layers operator type {kind!r}; known: {', '.join(OPERATOR_TYPES)}")
    return OPERATOR_TYPES[kind](torch.ones(width) if kind == "ResidualScale" else torch.eye(width))


def insert_operators(model: nn.Module, layout: list[dict]) -> None:
    """Wrap the modules named in `layout` with their (empty) operators, in place."""
    for entry in layout:
        parent_path, _, name = entry["path"].rpartition(".")
        parent = model.get_submodule(parent_path)
        original = getattr(parent, name)
        operator = empty_operator(entry["type"], int(entry["width"]))
        wrapped = PatchedBlock(operator, original) if entry["kind"] == "patch" else nn.Sequential(original, operator)
        setattr(parent, name, wrapped)


def operator_paths(layout: list[dict]) -> set[str]:
    """Module paths of the operators themselves (kept in float32 whatever dtype the model loads in)."""
    return {entry["path"] + (".patch" if entry["kind"] == "patch" else ".1") for entry in layout}


class _GhostedMixin:
    """Builds the stock model, then inserts the operators listed in `config.ghosted_layout`."""

    def __init__(self, config):
        super().__init__(config)
        layout = list(getattr(self.config, "ghosted_layout", None) or [])
        insert_operators(self, layout)
        # operators compute in float32 (they are C×C maps on a residual stream that may be bf16)
        self._keep_in_fp32_modules_strict = set(self._keep_in_fp32_modules_strict or ()) | operator_paths(layout)


PREFIX = "Ghosted"


def _family(base_config: type, base_model: type) -> tuple[type, type]:
    """The config and model classes of one architecture's Ghosted variant (stock classes, subclassed)."""
    config_name, model_name = PREFIX + base_config.__name__, PREFIX + base_model.__name__
    config_cls = type(config_name, (base_config,), {"model_type": f"ghosted_{base_config.model_type}",
                                                    "__module__": __name__, "__qualname__": config_name})
    model_cls = type(model_name, (_GhostedMixin, base_model),
                     {"config_class": config_cls, "_no_split_modules": [*(base_model._no_split_modules or ()), "PatchedBlock"],
                      "__module__": __name__, "__qualname__": model_name})
    return config_cls, model_cls


_CLASSES: dict[str, tuple[type, type]] = {}  # stock model_type -> (config class, model class), built once each


def ghosted_classes(model_type: str) -> tuple[type, type]:
    """The Ghosted config and model classes wrapping whatever causal-LM classes transformers maps `model_type` to
    (a stock type such as "llama", or its Ghosted name "ghosted_llama"): no class is written per family."""
    import transformers.models.auto.modeling_auto as auto

    from transformers import CONFIG_MAPPING

    stock = model_type.removeprefix("ghosted_")
    if stock not in _CLASSES:
        base_config = CONFIG_MAPPING[stock]  # KeyError: a model type this transformers does not know
        base_model = auto.MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
        _CLASSES[stock] = _family(base_config, base_model)
    return _CLASSES[stock]


def __getattr__(name: str) -> type:
    """`GhostedLlamaConfig`, `GhostedLlamaForCausalLM`, …: the names an export's `auto_map` points at, built from
    the stock class of the same name (transformers reads them with getattr on this module)."""
    import transformers

    stock = getattr(transformers, name.removeprefix(PREFIX), None) if name.startswith(PREFIX) else None
    config_cls = getattr(stock, "config_class", stock)
    if stock is None or not isinstance(getattr(config_cls, "model_type", None), str):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    config_out, model_out = ghosted_classes(config_cls.model_type)
    return config_out if stock is config_cls else model_out
