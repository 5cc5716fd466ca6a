"""What a variant's weights are, as a stock checkpoint (folded) or as its own module tree.

A variant is the dense model's kept blocks plus operator modules (see modeling_ghosted):
- a "patch" wraps a block (or the final norm) and maps the residual stream entering it,
  x ↦ x W. That does not fold into stock weights: every RMSNorm after it would see ‖xW‖
  instead of ‖x‖ (only a scalar or orthogonal W would, through a global change of basis).
- an "after" map follows a module's output. After the MLP of a Llama-style block it folds
  exactly into `down_proj`: that projection writes only to the residual stream, so
  y T = a (Tᵀ W_down)ᵀ + b T. After Gemma3's `post_feedforward_layernorm` it does not fold.

`stock_blockers` says why a variant cannot be a stock checkpoint (empty: it can);
`stock_tensors` yields its folded stock state dict block by block; `variant_tensors`
yields the variant's own state dict (keys as in its module tree) for remote-code exports.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.export.checkpoint import module_tensors
from ghosted_core.model.modeling_ghosted import OPERATOR_TYPES, PatchedBlock
from ghosted_core.architectures import architecture_of

Chunk = dict[str, torch.Tensor]


def _entry(path: str, kind: str, operator: nn.Module) -> dict:
    return {"path": path, "kind": kind, "type": type(operator).__name__, "width": int(operator.matrix().shape[0])}


def operator_layout(model: PreTrainedModel) -> list[dict]:
    """Where the variant's operator modules sit: boundary patches, and maps appended after a module."""
    layout = []
    for path, module in model.named_modules():
        if isinstance(module, PatchedBlock):
            layout.append(_entry(path, "patch", module.patch))
        elif isinstance(module, nn.Sequential) and len(module) == 2 and type(module[1]).__name__ in OPERATOR_TYPES:
            layout.append(_entry(path, "after", module[1]))
    return layout


def _folds_into_down_proj(model: PreTrainedModel, path: str) -> bool:
    wrapped = model.get_submodule(path)[0]
    return architecture_of(model.config).branch_folds_into_down_proj and path.rpartition(".")[2] == "mlp" \
        and isinstance(getattr(wrapped, "down_proj", None), nn.Linear)


def stock_blockers(model: PreTrainedModel) -> list[str]:
    """Why the variant cannot be saved as a stock checkpoint, one reason per operator (empty: it can)."""
    reasons = []
    for entry in operator_layout(model):
        width = entry["width"]
        if entry["kind"] == "patch":
            site = "the final norm" if entry["path"].endswith("norm") else \
                f"block {entry['path'].rpartition('.')[2]} of the pruned model"
            reasons.append(f"a {width}x{width} map on the residual stream entering {site} does not fold into stock "
                           "weights (every RMSNorm after it would see a different norm)")
        elif not _folds_into_down_proj(model, entry["path"]):
            reasons.append(f"the map after {entry['path']} does not fold: a norm sits between the MLP's down_proj "
                           "and the residual stream (Gemma3's post_feedforward_layernorm)")
    return reasons


def _fold_after_mlp(tensors: Chunk, path: str) -> Chunk:
    """Fold `path` = Sequential(mlp, operator) into the MLP's down_proj; keys become the stock ones."""
    weight = tensors.pop(f"{path}.1.weight", None)
    scale = tensors.pop(f"{path}.1.scale", None)
    transform = torch.diag(scale.double()) if scale is not None else weight.double()  # T (C, C)
    inner = f"{path}.0."
    folded = {(f"{path}." + key[len(inner):] if key.startswith(inner) else key): value for key, value in tensors.items()}
    down = folded[f"{path}.down_proj.weight"]  # (C, I)
    folded[f"{path}.down_proj.weight"] = (transform.T @ down.double()).to(down.dtype)  # Tᵀ W_down
    bias = folded.get(f"{path}.down_proj.bias")
    if bias is not None:
        folded[f"{path}.down_proj.bias"] = (bias.double() @ transform).to(bias.dtype)  # b T
    return folded


def _tied(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))


def _rest(model: PreTrainedModel) -> Chunk:
    """Everything outside the decoder blocks (embeddings, final norm, LM head unless tied)."""
    chunk = dict(module_tensors(model, skip=[model.model.layers]))
    if _tied(model):
        chunk.pop("lm_head.weight", None)  # transformers ties it back to the embeddings on load
    return chunk


def stock_tensors(model: PreTrainedModel) -> Iterator[Chunk]:
    """The stock state dict of a foldable variant, one decoder block per chunk, then the rest.

    Memory: one block's tensors at a time beyond the model (copied only if offloaded or on
    a GPU); folding costs one (C, C) @ (C, I) float64 product per folded boundary.
    """
    blockers = stock_blockers(model)
    if blockers:
        raise ValueError(f"variant does not fold into a stock checkpoint: {blockers[0]}")
    after = {entry["path"] for entry in operator_layout(model)}
    for i, block in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        chunk = dict(module_tensors(block))
        for path in sorted(p[len(prefix):] for p in after if p.startswith(prefix)):
            chunk = _fold_after_mlp(chunk, path)
        yield {prefix + key: value for key, value in chunk.items()}
    yield _rest(model)


def variant_tensors(model: PreTrainedModel) -> Iterator[Chunk]:
    """The variant's own state dict (keys as in its module tree), one block per chunk, then the rest."""
    for i, block in enumerate(model.model.layers):
        yield dict(module_tensors(block, f"model.layers.{i}."))
    yield _rest(model)
