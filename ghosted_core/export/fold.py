"""What a variant's weights are, as a stock checkpoint (folded) or as its own module tree.

A variant is the dense model's kept blocks plus operator modules (see modeling_ghosted):
- a "patch" wraps a block (or the final norm) and maps the residual stream entering it,
  x ↦ x W. That does not fold into stock weights: every RMSNorm after it would see ‖xW‖
  instead of ‖x‖ (only a scalar or orthogonal W would, through a global change of basis).
- an "after" map follows a module's output. After the MLP of a Llama-style block it folds
  exactly into `down_proj`: that projection writes only to the residual stream, so
  y T = a (Tᵀ W_down)ᵀ + b T. After Gemma3's `post_feedforward_layernorm` it does not fold.
- upstream scales (magcomp, `model.scaling`) always fold, in both formats: a scaled writer's
  weight and bias times s (a norm's gain: (o + γ)·s − o, o = `norm_gain_offset`), the stream
  scale of block 0 into the embeddings, and, where the LM head is tied to them, the final
  norm's gain divided by it, so the logits stay as they were.

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
from ghosted_core.model.low_rank import LowRankLinear
from ghosted_core.model.modeling_ghosted import OPERATOR_TYPES, PatchedBlock
from ghosted_core.model.scaling import ScaledOutput, StreamScale, stream_scale
from ghosted_core.architectures import architecture_of
from ghosted_core.model.loading import final_norm, final_norm_name

Chunk = dict[str, torch.Tensor]


def _entry(path: str, kind: str, operator: nn.Module) -> dict:
    return {"path": path, "kind": kind, "type": type(operator).__name__, "width": int(operator.matrix().shape[0])}


def _is_stream_scale(module: nn.Module) -> bool:
    return isinstance(module, PatchedBlock) and isinstance(module.patch, StreamScale)


def _layout(model: PreTrainedModel) -> list[tuple[str, dict]]:
    """(path in the view, layout entry) per operator module; entry paths are those of the folded tree, where
    upstream scales are not operators and leave no wrapper (a scaled writer sits inside an after-map, never
    around one, so only block 0's stream scale moves paths)."""
    scaled = [path for path, module in model.named_modules() if _is_stream_scale(module)]

    def folded(path: str) -> str:
        for outer in scaled:
            if path.startswith(f"{outer}.inner"):
                return outer + path[len(f"{outer}.inner"):]
        return path

    layout = []
    for path, module in model.named_modules():
        if _is_stream_scale(module):
            continue
        if isinstance(module, PatchedBlock):
            layout.append((path, _entry(folded(path), "patch", module.patch)))
        elif isinstance(module, nn.Sequential) and len(module) == 2 and type(module[1]).__name__ in OPERATOR_TYPES:
            layout.append((path, _entry(folded(path), "after", module[1])))
    return layout


def operator_layout(model: PreTrainedModel) -> list[dict]:
    """Where the variant's operator modules sit: boundary patches, and maps appended after a module."""
    return [entry for _path, entry in _layout(model)]


EXPERT_OUTPUTS = ("down_proj", "down_proj_bias")  # fused experts' tensors that their output is linear in
SLAB_BYTES = 64 * 2**20  # the float64 transient of a fold: a slab of rows, not the tensor


def in_float64_slabs(value: torch.Tensor, fn) -> torch.Tensor:
    """`fn` applied in float64 and rounded to `value`'s dtype, a slab of leading rows at a time (each element's
    result is what the whole tensor at once gives): the transient is SLAB_BYTES, not 8 bytes per element of a
    vocabulary's embeddings (1.5 GiB at 49,152 × 4,096) or of a block's fused experts."""
    if value.ndim == 0:
        return fn(value.double()).to(value.dtype)
    out = torch.empty_like(value)
    rows = max(1, SLAB_BYTES // max(1, 8 * value[0].numel()))
    for start in range(0, value.shape[0], rows):
        out[start:start + rows] = fn(value[start:start + rows].double()).to(value.dtype)
    return out


def _writer_kind(module: nn.Module) -> str:
    """How a scaled writer's tensors carry the scale: every one (a linear), the down projection (fused experts),
    or the gain (a norm)."""
    if isinstance(module, (nn.Linear, LowRankLinear)):
        return "linear"
    down = getattr(module, "down_proj", None)
    return "experts" if isinstance(down, torch.Tensor) and down.ndim == 3 else "norm"


def fold_scales(module: nn.Module, chunk: Chunk, offset: float) -> tuple[Chunk, float]:
    """`chunk` (module_tensors of `module`, keys relative to it) with every `ScaledOutput` under `module` folded
    into its inner weights, and a block-0 `StreamScale` wrapper stripped; also returns that stream scale (the
    factor the embeddings must carry, 1.0 if none). A Linear's weight and bias are multiplied by s, fused experts' down projection and its bias;
    a norm's gain γ becomes (offset + γ)·s − offset. Memory: one new tensor per scaled weight, in float64 a slab at a
    time while computed (`in_float64_slabs`).
    """
    for path, sub in module.named_modules():
        if not isinstance(sub, ScaledOutput):
            continue
        inner, outer = (f"{path}.inner.", f"{path}.") if path else ("inner.", "")
        kind = _writer_kind(sub.inner)
        for key in [k for k in chunk if k.startswith(inner)]:
            value = chunk.pop(key)
            name = key[len(inner):]
            if kind == "linear" or (kind == "experts" and name in EXPERT_OUTPUTS):
                value = in_float64_slabs(value, lambda w: w * sub.scale)
            elif kind == "norm":
                value = in_float64_slabs(value, lambda w: (offset + w) * sub.scale - offset)
            chunk[outer + name] = value
    scale = stream_scale(module)
    if _is_stream_scale(module):
        chunk = {key.removeprefix("inner."): value for key, value in chunk.items()}  # StreamScale holds no tensor
    return chunk, scale


def fold_low_rank(module: nn.Module, chunk: Chunk) -> Chunk:
    """`chunk` (module_tensors of `module`, keys relative to it) with every `LowRankLinear` under `module` merged
    into a stock linear's keys: `p.base.weight` + the change becomes `p.weight`, `p.lora_a`/`p.lora_b` go.
    Memory: one new weight per merged layer, in float64 while computed."""
    for path, sub in module.named_modules():
        if not isinstance(sub, LowRankLinear):
            continue
        outer = f"{path}." if path else ""
        for name in ("lora_a", "lora_b"):
            chunk.pop(outer + name, None)
        for key in [k for k in chunk if k.startswith(f"{outer}base.")]:
            value = chunk.pop(key)
            stock = outer + key[len(f"{outer}base."):]
            chunk[stock] = sub.merged_weight(value) if stock == f"{outer}weight" else value
    return chunk


def _folds_into_down_proj(model: PreTrainedModel, path: str) -> bool:
    down = getattr(model.get_submodule(path)[0], "down_proj", None)
    down = down.inner if isinstance(down, ScaledOutput) else down
    arch = architecture_of(model.config)
    return arch.branch_folds and arch.down_proj == "mlp.down_proj" and path.rpartition(".")[2] == "mlp" \
        and isinstance(down, (nn.Linear, LowRankLinear))


def stock_blockers(model: PreTrainedModel) -> list[str]:
    """Why the variant cannot be saved as a stock checkpoint, one reason per operator (empty: it can)."""
    reasons = []
    for view_path, entry in _layout(model):
        width = entry["width"]
        if entry["kind"] == "patch":
            last = entry["path"].rpartition(".")[2]
            site = f"block {last} of the pruned model" if last.isdigit() else "the final norm"
            reasons.append(f"a {width}x{width} map on the residual stream entering {site} does not fold into stock "
                           "weights (every RMSNorm after it would see a different norm)")
        elif not _folds_into_down_proj(model, view_path):
            why = "its writers are offloaded (a fold needs them in memory)" if entry["path"].endswith(".mlp") \
                else "a norm sits between the MLP and the residual stream"
            reasons.append(f"the map after {entry['path']} does not fold: {why}")
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


def _rest(model: PreTrainedModel, embed_scale: float = 1.0, device: str = "cpu") -> Chunk:
    """Everything outside the decoder blocks (embeddings, final norm, LM head unless tied), with the
    embeddings times `embed_scale` and, when the head is tied to them, the final norm's gain divided by it."""
    chunk = dict(module_tensors(model, skip=[model.model.layers], device=device))
    tied = _tied(model)
    if tied:
        chunk.pop("lm_head.weight", None)  # transformers ties it back to the embeddings on load
    if embed_scale != 1.0:
        key = "model.embed_tokens.weight"
        chunk[key] = in_float64_slabs(chunk[key], lambda w: w * embed_scale)
        if tied:  # the head reads the scaled embeddings: the final norm's output must shrink by as much
            norm = f"model.{final_norm_name(model)}"
            key = f"{norm}.inner.weight" if isinstance(final_norm(model), PatchedBlock) else f"{norm}.weight"
            offset = architecture_of(model.config).norm_gain_offset
            chunk[key] = in_float64_slabs(chunk[key], lambda w: (offset + w) / embed_scale - offset)
    return chunk


def _block_chunks(model: PreTrainedModel, fold_after: bool, device: str = "cpu") -> Iterator[Chunk]:
    """One chunk per decoder block (keys `model.layers.i.…`) with upstream scales folded, then the rest.
    `device="meta"`: the same keys, shapes and dtypes with no data (folds cost nothing)."""
    offset = architecture_of(model.config).norm_gain_offset
    after = {entry["path"] for entry in operator_layout(model)} if fold_after else set()
    embed_scale = 1.0
    for i, block in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        chunk, scale = fold_scales(block, fold_low_rank(block, dict(module_tensors(block, device=device))), offset)
        embed_scale *= scale
        for path in sorted(p[len(prefix):] for p in after if p.startswith(prefix)):
            chunk = _fold_after_mlp(chunk, path)
        yield {prefix + key: value for key, value in chunk.items()}
    yield _rest(model, embed_scale, device)


def stock_tensors(model: PreTrainedModel, device: str = "cpu") -> Iterator[Chunk]:
    """The stock state dict of a foldable variant, one decoder block per chunk, then the rest.

    Memory: one block's tensors at a time beyond the model (copied only if offloaded or on
    a GPU, or scaled); folding costs one (C, C) @ (C, I) float64 product per folded boundary.
    """
    blockers = stock_blockers(model)
    if blockers:
        raise ValueError(f"variant does not fold into a stock checkpoint: {blockers[0]}")
    yield from _block_chunks(model, fold_after=True, device=device)


def variant_tensors(model: PreTrainedModel, device: str = "cpu") -> Iterator[Chunk]:
    """The variant's own state dict (keys as in its module tree, upstream scales folded), one block per chunk,
    then the rest."""
    yield from _block_chunks(model, fold_after=False, device=device)
