"""Pruned and recovered models as views that share the dense model's weights.

A view is a new module tree over the dense model's own parameter tensors: only the module
objects whose state must differ are new (shallow copies), the weights never are. A kept
block after a removed run gets a shallow copy whose attention carries its new `layer_idx`
(so the KV cache has one slot per surviving block); the boundary operator wraps the first
surviving block after the run (or the final norm) as a real submodule; the config is a copy
with the right `num_hidden_layers` and block-describing fields (`layer_config.sliced_config`). The dense model is never modified.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.errors import GhostedError
from ghosted_core.model.modeling_ghosted import PatchedBlock  # shared with remote-code exports
from ghosted_core.model.assembly import assemble
from ghosted_core.model.scaling import depth_rescaled
from ghosted_core.model.shallow import replace_submodules, shallow_view
from ghosted_core.model.side_inputs import dense_rows, stream_fed_inputs
from ghosted_core.model.loading import decoder_blocks, final_norm
from ghosted_core.model.layer_config import check_kept_kinds, check_required_kept, sliced_config
from ghosted_core.plan import Boundary

log = logging.getLogger(__name__)


def reindexed(block: nn.Module, index: int) -> nn.Module:
    """A view of `block` whose `layer_idx` attributes (block and attention) read `index`."""
    if _layer_index(block) == index:
        return block
    paths = [name for name, sub in block.named_modules() if name and hasattr(sub, "layer_idx")]
    targets = {path: shallow_view(block.get_submodule(path)) for path in paths}
    for sub in targets.values():
        sub.layer_idx = index
    view = replace_submodules(block, targets)
    if hasattr(view, "layer_idx"):
        view.layer_idx = index
    return view


def _layer_index(block: nn.Module) -> int | None:
    for sub in block.modules():
        if hasattr(sub, "layer_idx"):
            return sub.layer_idx
    return None


def build_variant(dense: PreTrainedModel, removed: Sequence[int], patches: Mapping[int, nn.Module] | None = None,
                  replacements: Mapping[int, Mapping[str, nn.Module]] | None = None,
                  record: Mapping | None = None) -> PreTrainedModel:
    """The dense model without the `removed` blocks, sharing its weights.

    `patches[j]` is applied to the residual stream entering dense block j (j = num_layers:
    before the final norm). `replacements[j]` maps dotted paths inside dense block j to new
    submodules (ReplaceMe's folded down projection).
    """
    patches = dict(patches or {})
    replacements = dict(replacements or {})
    blocks = decoder_blocks(dense)
    num_layers = len(blocks)
    removed_set = set(removed)
    config = check_cut(dense, removed)
    layers: list[nn.Module] = []
    kept: list[int] = []
    for j in range(num_layers):
        if j in removed_set:
            continue
        block = blocks[j]
        if j in replacements:
            block = replace_submodules(block, replacements[j])
        block = depth_rescaled(reindexed(block, len(layers)), config, len(layers))
        if j in patches:
            block = PatchedBlock(patches[j], block)
        layers.append(block)
        kept.append(j)
    norm = final_norm(dense)
    if num_layers in patches:
        norm = PatchedBlock(patches[num_layers], norm)
    return assemble(dense, layers, config, norm, record, rows=kept)


def check_cut(dense: PreTrainedModel, removed: Sequence[int]):
    """Refuse a cut the model cannot take, with the reason, and return its config (`sliced_config`): one that keeps
    no attention block of a hybrid model, removes a block the family requires, or (a type outside the table) whose
    config would describe other blocks. Cheap (no weight is read): selection runs it on every plan it chooses, before
    any calibration, and `build_variant` on every view."""
    blocks = decoder_blocks(dense)
    kept = [j for j in range(len(blocks)) if j not in set(removed)]
    check_kept_kinds(dense.config, kept)
    check_required_kept(dense.config, removed)
    config = sliced_config(dense.config, kept)
    if architecture_of(dense.config).generic and removed:
        check_config_describes_blocks(blocks, kept, config)
    return config


def check_config_describes_blocks(blocks: nn.ModuleList, kept: Sequence[int], config) -> None:
    """Refuse a cut whose config would load other blocks than the kept ones. For a type outside the architecture
    table a per-layer fact may be left uncounted (Ernie-4.5-MoE's `moe_layer_start_index`: remove its dense block 0
    and the config still makes block 0 dense): each kept block's class is built from the cut's config on the meta
    device (no memory) and must have the same parameters, names and shapes, and the same float attributes (a value
    derived from the block count or a block's index, such as MiniCPM3's residual scale, would change on load). A
    class built otherwise is not checked."""
    for i, j in enumerate(kept):
        cls = type(blocks[j])
        try:
            with torch.device("meta"):
                rebuilt = cls(config, i)
        except Exception:  # noqa: BLE001  a block class with another constructor: nothing to compare
            return
        have = {name: tuple(t.shape) for name, t in blocks[j].named_parameters()}
        want = {name: tuple(t.shape) for name, t in rebuilt.named_parameters()}
        if have != want:
            differ = sorted(set(have) ^ set(want)) or [n for n in have if have[n] != want.get(n)]
            raise GhostedError(f"this cut's config would load block {i} (dense block {j}) as other modules "
                               f"({', '.join(differ[:3])}): a per-layer fact of {config.model_type!r} that the cut does "
                               "not recount (it is not in the architecture table); remove other blocks, or add the "
                               "type to the table")
        scalars = {f"{path}.{name}".lstrip("."): (value, getattr(rebuilt.get_submodule(path), name, value))
                   for path, module in blocks[j].named_modules() for name, value in vars(module).items()
                   if isinstance(value, float)}
        moved = {name: pair for name, pair in scalars.items() if pair[0] != pair[1]}
        if moved:
            name, (old, new) = next(iter(moved.items()))
            raise GhostedError(f"this cut's config would load block {i} (dense block {j}) with {name} {new:.6g} "
                               f"instead of {old:.6g} (a value {config.model_type!r} derives from the block count or "
                               "the block's index, which a checkpoint of the cut recomputes; the type is not in the "
                               "architecture table, which could carry it as `depth_scaled`); keep the blocks before "
                               "it, or add the type")


def patch_site(boundary: Boundary) -> int:
    """Dense index of the module whose input a boundary's operator transforms (num_layers = final norm)."""
    return boundary.end


# base-model attributes that multiply `inputs_embeds` inside the forward (Granite's family, HRM): a view fed a
# residual stream instead of embeddings must not scale it again
INPUT_SCALES = ("embedding_multiplier", "embedding_scale")


def stream_fed(view: PreTrainedModel) -> PreTrainedModel:
    """`view` (a new module tree: `assemble`'s) made to take a residual stream as `inputs_embeds`: the scalars its
    base model applies to embeddings, where it has them, become 1 on the view only, and what its blocks read
    from the tokens besides the stream comes from the caller (`side_inputs.stream_fed_inputs`)."""
    for name in INPUT_SCALES:
        if isinstance(getattr(view.model, name, None), (int, float)):
            setattr(view.model, name, 1.0)
    stream_fed_inputs(view.model, view.config)
    return view


def slice_view(model: PreTrainedModel, dense: PreTrainedModel, start: int, stop: int | None = None,
               normed: bool = True, stream_input: bool | None = None) -> PreTrainedModel:
    """Blocks `start:stop` of a model (dense or variant) as a model of their own, for prefix sharing.

    Fed `inputs_embeds=h_start`, it returns the residual after block `stop-1` (normed only
    when `normed`). `stream_input` (default: `start > 0`): it is fed a residual stream, not token ids,
    so it applies no embedding scalar of its own (`stream_fed`), and takes what its blocks read besides the stream
    from the caller (`side_inputs.stream_kwargs`). Only for cache-free forwards: layer
    indices are left as they are.
    """
    layers = list(model.model.layers)
    kept = range(len(layers))[start:stop]
    norm = final_norm(model) if normed else nn.Identity()
    view = assemble(dense, layers[start:stop], sliced_config(model.config, kept), norm,
                    rows=dense_rows(model)[start:stop])
    return stream_fed(view) if (start > 0 if stream_input is None else stream_input) else view
