"""Writing a model's tensors and config as a Hugging Face checkpoint folder, wherever the weights live.

- `module_tensors` reads a module tree's persistent tensors on the CPU, also when accelerate
  offloaded them to CPU or disk (their parameters are then meta tensors; the real ones sit in
  the offload hook's weights map). A meta tensor is never written.
- `ShardWriter` writes safetensors shards of bounded size and, when there is more than one,
  the `model.safetensors.index.json` that transformers reads. It writes each tensor's bytes from
  its own memory (`write_safetensors`), and a `StreamedTensor` (the kept slices of Gemma 4 E2B's
  per-layer table) piece by piece, so an export never holds such a tensor whole.
- `export_config` turns a variant's config into a clean config.json: per-layer lists sliced
  to the kept blocks and nothing that names a path of this machine.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn
from transformers import PretrainedConfig

from ghosted_core.architectures import architecture_of
from ghosted_core.model.layer_config import layer_fields
from ghosted_core.model.side_inputs import StreamedTensor

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 2**30  # a shard is written once this many bytes are buffered


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's own parameters and persistent buffers (not its children's)."""
    yield from module.named_parameters(recurse=False)
    skip = getattr(module, "_non_persistent_buffers_set", set())
    yield from ((name, buf) for name, buf in module.named_buffers(recurse=False) if name not in skip)


def module_tensors(module: nn.Module, prefix: str = "", skip: Sequence[nn.Module] = (),
                   device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, CPU tensor) for every persistent tensor under `module`, offload included.

    Offloaded modules (accelerate hooks with a weights map) are loaded one module at a time,
    so memory grows with the largest module, not the model. Tensors already on the CPU are
    yielded as they are (no copy); others are copied to the CPU. `skip`: subtrees left out.
    `device="meta"`: shapes and dtypes only (nothing read, loaded or copied), for counting what an
    export would write.
    """
    if any(module is s for s in skip):
        return
    if hasattr(module, "export_tensors"):  # a module standing for tensors it computes (side_inputs.PackedRows)
        for name, tensor in module.export_tensors(device).items():
            yield prefix + name, tensor
        return
    meta = device == "meta"
    context = align_module_device(module, torch.device("cpu")) if has_offloaded_params(module) and not meta \
        else nullcontext()
    with context:
        for name, tensor in _own_tensors(module):
            if tensor is None:
                continue
            if tensor.device.type == "meta" and not meta:
                raise RuntimeError(f"{prefix}{name} is a meta tensor with no offloaded copy to read")
            yield prefix + name, tensor.detach().to(device)
        for name, child in module.named_children():
            yield from module_tensors(child, f"{prefix}{name}.", skip, device)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def _raw(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor, as a buffer over its own memory (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor | StreamedTensor],
                      metadata: Mapping[str, str]) -> None:
    """One safetensors file (the format's 8-byte header length, its JSON header padded to 8 bytes, then each
    tensor's bytes in order) written from each tensor's own memory, and a `StreamedTensor` piece by piece: beyond
    the tensors, memory is one piece."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: safetensors has no {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for key, tensor in tensors.items():
            written = 0
            for piece in tensor.pieces() if isinstance(tensor, StreamedTensor) else (tensor,):
                piece = piece.detach().to("cpu").contiguous()
                if piece.numel():
                    out.write(_raw(piece))
                written += piece.numel() * piece.element_size()
            if written != header[key]["data_offsets"][1] - header[key]["data_offsets"][0]:
                raise RuntimeError(f"{key}: {written} bytes written for a tensor of shape {tuple(tensor.shape)}")


class ShardWriter:
    """Collects tensors and writes them as safetensors shards of at most ~`max_bytes` each.

    Memory: the tensors of one shard are held until it is written (≤ max_bytes plus one
    block's tensors); CPU tensors are referenced, not copied, and a `StreamedTensor` is only its recipe.
    """

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # keys per written shard
        self.total_bytes = 0

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            if key in self.pending or any(key in shard for shard in self.shards):
                raise RuntimeError(f"tensor {key} written twice")
            self.pending[key] = tensor if isinstance(tensor, StreamedTensor) else tensor.contiguous()
            self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        write_safetensors(self.folder / f".shard-{len(self.shards):05d}", self.pending, {"format": "pt"})
        self.shards.append(list(self.pending))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left; name the shards; return the weight file names."""
        self._flush()
        if len(self.shards) == 1:
            (self.folder / ".shard-00000").rename(self.folder / WEIGHTS)
            return [WEIGHTS]
        names = [f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors" for k in range(len(self.shards))]
        weight_map = {}
        for k, (name, keys) in enumerate(zip(names, self.shards)):
            (self.folder / f".shard-{k:05d}").rename(self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
        return [*names, WEIGHTS_INDEX]


def export_config(config: PretrainedConfig, record: Mapping, **overrides) -> dict:
    """config.json content for an export of a variant: clean and self-consistent.

    Drops the `ghosted` record and `_name_or_path` (a local path where the model came from a
    folder), slices every per-layer list still at the dense length to the kept blocks (surgery already
    sliced the config's own; `layer_config` says which lists are per-layer: the same rule for both), and
    applies `overrides`.
    """
    values = config.to_diff_dict()  # what save_pretrained writes: values that differ from the class defaults
    for key in ("ghosted", "_name_or_path", "_commit_hash", "wrapper_parameters"):
        values.pop(key, None)
    removed = set(record.get("removed_layers", ()))
    kept_count = int(config.num_hidden_layers)
    values["num_hidden_layers"] = kept_count
    dense_count = kept_count + len(removed)
    kept = [j for j in range(dense_count) if j not in removed]
    if removed:
        for key in layer_fields(config, values, dense_count).per_layer:
            values[key] = [values[key][j] for j in kept]
            log.info("sliced per-layer config list %s to the %d kept blocks", key, kept_count)
    names = dict(architecture_of(config).hub_layer_types)
    if names and isinstance(values.get("layer_types"), list):
        values["layer_types"] = [names.get(kind, kind) for kind in values["layer_types"]]
    values.update(overrides)
    return values


def write_json(path: Path, values: Mapping) -> None:
    path.write_text(json.dumps(values, indent=2, sort_keys=True, default=str) + "\n")
