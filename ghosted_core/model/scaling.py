"""A scalar on the residual stream carried by the weights upstream of a cut, as a view that copies none.

In a pre-norm model every block reads the stream through a norm, and RMSNorm(s·h) = RMSNorm(h)
up to its ε. So if the embeddings' output and every module that writes to the stream before
block `cut` (`Architecture.residual_writers`: o_proj and down_proj, or Gemma3's post-norms) are
scaled by s, those blocks compute what they did, and the stream entering block `cut` is s·h.
That is how the magnitude compensation (Prune&Comp) lands in stock weights. A view realizes it:
- `ScaledOutput(module, s)`: y ↦ s·module(x) around each writer (a bias is scaled with it);
- `StreamScale(s)`, the patch of block 0: the embeddings' output times s. The embedding
  module stays the dense one, so prefix-shared evaluation works and a tied LM head is untouched.
`export.fold` turns both into stock weights (see `fold_scales` there). Scales compose: a second
call multiplies the factors already in place (the iterative Prune&Comp multiplies its rounds).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.model.loading import final_norm
from ghosted_core.architectures import architecture_of
from ghosted_core.errors import GhostedError
from ghosted_core.model.modeling_ghosted import OPERATOR_TYPES, PatchedBlock
from ghosted_core.model.assembly import assemble
from ghosted_core.model.shallow import replace_submodules

log = logging.getLogger(__name__)


class ScaledOutput(nn.Module):
    """y ↦ s·inner(x): a writer to the residual stream, scaled (weights shared, nothing copied)."""

    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner = inner
        self.scale = float(scale)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


class StreamScale(nn.Module):
    """x ↦ s·x on the stream entering block 0: the embeddings' output, scaled without touching them."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


def is_after_map(module: nn.Module) -> bool:
    """`nn.Sequential(module, operator)`: a map applied after a module's output (see modeling_ghosted)."""
    return isinstance(module, nn.Sequential) and len(module) == 2 and type(module[1]).__name__ in OPERATOR_TYPES


def unwrap_patches(block: nn.Module) -> nn.Module:
    while isinstance(block, PatchedBlock):
        block = block.inner
    return block


def writer_path(block: nn.Module, path: str) -> str:
    """Where the module named `path` of a stock block sits in a view's block: through a `PatchedBlock`'s
    inner module and into the first module of an after-map (a scalar commutes with the map after it)."""
    parts: list[str] = []
    module = block
    while isinstance(module, PatchedBlock):
        parts.append("inner")
        module = module.inner
    for name in path.split("."):
        module = getattr(module, name)
        parts.append(name)
        while is_after_map(module):
            parts.append("0")
            module = module[0]
    return ".".join(parts)


def _scaled(module: nn.Module, scale: float) -> ScaledOutput:
    if isinstance(module, ScaledOutput):
        return ScaledOutput(module.inner, module.scale * scale)
    return ScaledOutput(module, scale)


def present_writers(block: nn.Module, writers: tuple[str, ...]) -> list[str]:
    """The paths in a view's block of those of the family's candidate writers this block has (attention or linear
    attention, experts or a dense MLP)."""
    paths = []
    for name in writers:
        try:
            paths.append(writer_path(block, name))
        except AttributeError:
            continue
    return paths


def scale_writers(block: nn.Module, writers: tuple[str, ...], scale: float) -> nn.Module:
    """A view of `block` whose residual writers' outputs are multiplied by `scale`."""
    paths = present_writers(block, writers)
    if not paths:
        raise ValueError(f"{type(unwrap_patches(block)).__name__} has none of the residual writers {writers}")
    return replace_submodules(block, {path: _scaled(block.get_submodule(path), scale) for path in paths})


def stream_scale(block: nn.Module) -> float:
    """The factor a view applies to the embeddings' output at its block 0 (1.0: none)."""
    if isinstance(block, PatchedBlock) and isinstance(block.patch, StreamScale):
        return block.patch.scale
    return 1.0


def _scale_stream(block: nn.Module, scale: float) -> nn.Module:
    if isinstance(block, PatchedBlock) and isinstance(block.patch, StreamScale):
        return PatchedBlock(StreamScale(block.patch.scale * scale), block.inner)
    return PatchedBlock(StreamScale(scale), block)


def scale_before(model: PreTrainedModel, cut: int, scale: float) -> PreTrainedModel:
    """A view of `model` (dense or a pruned view) whose residual stream entering its block `cut` is scaled by
    `scale`, carried by the embeddings and the writers of blocks 0 … cut−1; `cut` = number of blocks: the
    stream entering the final norm (which normalizes it away: no effect up to ε).

    Shares every weight: new module objects are the scaled writers' wrappers and the shallow block views
    holding them. Memory O(cut) small modules; time none until the view runs.
    """
    layers = list(model.model.layers)
    if not 0 <= cut <= len(layers):
        raise ValueError(f"cut {cut} outside the model's {len(layers)} blocks")
    arch = architecture_of(model.config)
    refusal = arch.refusal("scale", "a scale upstream of the cut", model.config)
    if refusal:
        raise GhostedError(refusal)
    writers = arch.residual_writers
    new = [scale_writers(block, writers, scale) if i < cut else block for i, block in enumerate(layers)]
    if new:
        new[0] = _scale_stream(new[0], scale)
    if cut == len(layers):
        log.info("a scale on the stream entering the final norm changes nothing (it is normalized away)")
    return assemble(model, new, model.config, final_norm(model))


def depth_rescaled(block: nn.Module, config, index: int) -> nn.Module:
    """`block` as block `index` of a model with `config` (a cut's), computing what it computed in the dense model:
    where the family's blocks derive attributes from the block count (`Architecture.depth_scaled`, MiniCPM3's
    residual_scale = scale_depth / √L on each branch), the view carries the value `config` gives, as a checkpoint
    of the cut will, and its writers are scaled by dense / cut value to make up for it (folded on export).
    Shares every weight; the block class is built once on the meta device to read the value."""
    arch = architecture_of(config)
    if not arch.depth_scaled:
        return block
    inner = unwrap_patches(block)
    with torch.device("meta"):
        rebuilt = type(inner)(config, index)
    ratios = {name: getattr(inner, name) / getattr(rebuilt, name) for name in arch.depth_scaled}
    if len(set(ratios.values())) != 1:
        raise ValueError(f"{arch.family}'s depth-scaled attributes change by different factors: {ratios}")
    ratio = next(iter(ratios.values()))
    if ratio == 1.0:
        return block
    view = scale_writers(block, arch.residual_writers, ratio)
    target = unwrap_patches(view)
    for name in arch.depth_scaled:
        setattr(target, name, getattr(rebuilt, name))
    return view
