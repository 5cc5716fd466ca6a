"""What some families' blocks read besides the residual stream, and how a cut carries it.

Gemma 4's small checkpoints (E2B, E4B) give each block two more inputs:
- **per-layer embeddings**: a table `embed_tokens_per_layer` (V × L·P) and a projection of the token embeddings
  `per_layer_model_projection` (C → L·P) pack one P-wide slice per block; block j reads slice j, made from the
  *tokens*, not from the stream. A cut keeps the kept blocks' slices (`PackedRows`: the dense module's output with
  the removed slices left out, no weight copied); an export writes those slices as the smaller tensor. A view fed a
  residual stream instead of token ids (prefix sharing) is given its slices by the caller (`stream_kwargs`), made
  from the token ids of the same batch.
- **shared keys and values**: the last `num_kv_shared_layers` blocks ("reuse") attend with the keys and values of
  the last earlier block of their kind ("store"), computed on the same forward pass. A cut must keep every store
  (`layer_config.required_blocks`), and a view that starts after a store would miss what its reusers read, so
  prefix sharing and distillation start no later than the first store (`self_contained_start`). The criteria that
  run one block at a time from cached streams (`selection.suffixes`) carry the stored keys and values with each
  cached stream instead, and give each block its per-layer inputs (`dense_per_layer_inputs`).

The family's facts (which modules pack slices, the width field, the base model's index of the first reuser) are
data in its architecture-table entry; the store/reuse layout is transformers' own `config.kv_sharing_modes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ghosted_core.architectures import architecture_of
from ghosted_core.config_values import kv_stores, per_layer_width


SLAB_BYTES = 64 * 2**20  # an export's piece of a packed table (vocabulary rows)


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor made and written a piece at a time (`export.checkpoint.write_safetensors`): its dtype, shape, and
    `pieces()`, contiguous tensors whose bytes in order are its row-major bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], Iterator[torch.Tensor]]

    def pieces(self) -> Iterator[torch.Tensor]:
        return self.make()

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class PackedRows(nn.Module):
    """A module whose output packs one slice per dense block (…, L·P), showing only the slices of `rows`.

    Its forward is the dense module's with the other slices left out (…, len(rows)·P); its exported state dict
    (`export_tensors`) is the dense weight with those slices left out along the packed axis (a copy of the kept
    part, made only when an export asks)."""

    def __init__(self, packed: nn.Module, rows: Sequence[int], width: int):
        super().__init__()
        self.packed = packed
        self.rows = tuple(int(j) for j in rows)
        self.width = int(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.packed(x)
        out = out.unflatten(-1, (-1, self.width))[..., list(self.rows), :]  # (…, len(rows), P)
        return out.flatten(-2)

    def _packed_axis(self) -> int:
        return 1 if isinstance(self.packed, nn.Embedding) else 0  # Embedding (V, L·P); Linear (L·P, C)

    def export_tensors(self, device: str = "cpu") -> dict:
        """The dense module's tensors with the removed blocks' slices left out: what a checkpoint of the cut holds,
        as a `StreamedTensor` that the checkpoint writer makes a slab at a time (E2B's kept table is up to 4.7 GB in
        bf16: never copied whole). `device="meta"`: shapes only."""
        weight = self.packed.weight
        axis = self._packed_axis()
        shape = list(weight.shape)
        shape[axis] = len(self.rows) * self.width
        if device == "meta":
            return {"weight": torch.empty(shape, dtype=weight.dtype, device="meta")}
        return {"weight": StreamedTensor(weight.dtype, tuple(shape), lambda: self._kept_slabs(weight, device))}

    def _kept_slabs(self, weight: torch.Tensor, device: str):
        """The kept slices, row-major: an Embedding's (V, L·P) a slab of vocabulary rows at a time (SLAB_BYTES),
        a Linear's (L·P, C) one kept block's P rows at a time (views, no copy)."""
        weight = weight.detach()
        if self._packed_axis() == 0:
            for j in self.rows:
                yield weight[j * self.width:(j + 1) * self.width].to(device)
            return
        rows = max(1, SLAB_BYTES // max(1, weight.shape[1] * weight.element_size()))
        for start in range(0, weight.shape[0], rows):
            slab = weight[start:start + rows].unflatten(1, (-1, self.width))[:, list(self.rows)]
            yield slab.flatten(1).to(device)


def dense_rows(model) -> tuple[int, ...]:
    """The dense indices of the blocks a model (dense, or a view over it) holds, in order."""
    rows = getattr(model.model, "ghosted_rows", None)
    return tuple(rows) if rows is not None else tuple(range(len(model.model.layers)))


def carry(base: nn.Module, dense_base: nn.Module, rows: Sequence[int], config) -> None:
    """Make `base` (a new base-model view holding dense blocks `rows`, with `config` sliced to them) read what its
    blocks read: the per-layer slices of its rows, and the index of its first KV-reusing block recounted."""
    base.ghosted_rows = tuple(rows)
    arch = architecture_of(config)
    width = per_layer_width(config)
    if width:
        for name in arch.per_layer_inputs:  # `rows` are dense indices: slices of the dense module's output
            packed = getattr(dense_base, name)
            base._modules[name] = PackedRows(packed.packed if isinstance(packed, PackedRows) else packed, rows, width)
    if arch.shared_kv_start and hasattr(dense_base, arch.shared_kv_start):
        shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
        setattr(base, arch.shared_kv_start, int(config.num_hidden_layers) - shared)


def stream_fed_inputs(base: nn.Module, config) -> None:
    """Make a view fed a residual stream (`surgery.stream_fed`) take its per-layer inputs from the caller
    (`stream_kwargs`): its own would be made from the stream, which is not the token embeddings they need."""
    if not per_layer_width(config):
        return

    def missing(input_ids, inputs_embeds=None):  # the base model would look the stream up in its embeddings
        raise RuntimeError("a view fed a residual stream needs its per-layer inputs (side_inputs.stream_kwargs)")

    base.get_per_layer_inputs = missing
    base.project_per_layer_inputs = lambda inputs_embeds, per_layer_inputs=None: per_layer_inputs


def stream_kwargs(view, input_ids: torch.Tensor, dense_inputs: torch.Tensor | None = None) -> dict:
    """The keyword arguments a stream-fed `view` needs beside `inputs_embeds` for the batch of `input_ids` (B, T):
    {} for most families; Gemma 4's per-layer inputs (B, T, blocks, P) for the blocks the view holds: the view's
    slices of `dense_inputs` (the dense model's for the batch, `dense_per_layer_inputs`, made once for every view
    fed that batch: each slice is computed on its own, so slicing after equals the view's own), or else made here.
    Memory: B·T·blocks·P in the model's dtype, for one call."""
    base = view.model
    if not per_layer_width(view.config):
        return {}
    if dense_inputs is not None:
        rows = torch.tensor(dense_rows(view), device=dense_inputs.device)
        return {"per_layer_inputs": dense_inputs.index_select(2, rows)}
    cls = type(base)
    with torch.no_grad():
        ids = input_ids.to(base.embed_tokens.weight.device)
        tokens = cls.get_per_layer_inputs(base, ids)
        return {"per_layer_inputs": cls.project_per_layer_inputs(base, base.embed_tokens(ids), tokens)}


def dense_per_layer_inputs(model, input_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The per-layer inputs of every block `model` holds for the batch `input_ids` (B, T): (B, T, blocks, P), or
    None for a family without them. Memory: B·T·blocks·P in the model's dtype."""
    if not per_layer_width(model.config):
        return None
    if input_ids is None:
        raise ValueError("this model's blocks read per-layer inputs of the tokens: give the batch's input_ids")
    return stream_kwargs(model, input_ids)["per_layer_inputs"]


def self_contained_start(config) -> int:
    """The latest block a view of this model may start at and still compute everything its blocks read from the
    stream it is fed (and the tokens): the first KV store where later blocks reuse stored keys and values, else
    the block count (any)."""
    stores = kv_stores(config)
    return min(stores) if stores else int(config.num_hidden_layers)
