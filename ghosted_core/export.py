"""Save a recovered variant to a folder and load it back with one call.

The folder holds the tokenizer, a `config.json` with `num_hidden_layers` and `layer_types`
of the pruned model plus a `ghosted` record (removed blocks, boundaries, operator, and where
each operator module sits), and `model.safetensors` with the surviving blocks and the
operators only. Keys follow the variant's own module tree (a boundary operator is
`model.layers.<i>.patch.weight`, the block it feeds `model.layers.<i>.inner.…`), so plain
transformers cannot load it; `load_recovered` rebuilds that tree on the meta device and
assigns the saved tensors, reproducing the in-memory variant's logits exactly.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ghosted_core.errors import GhostedError
from ghosted_core.operators import ResidualLinear, ResidualScale
from ghosted_core.surgery import PatchedBlock

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
OPERATOR_TYPES = {cls.__name__: cls for cls in (ResidualLinear, ResidualScale)}


def _operator_entry(path: str, kind: str, module: nn.Module) -> dict:
    return {"path": path, "kind": kind, "type": type(module).__name__, "width": int(module.matrix().shape[0])}


def operator_layout(model: PreTrainedModel) -> list[dict]:
    """Where the variant's operator modules sit: boundary patches, and maps appended after a branch."""
    layout = []
    for path, module in model.named_modules():
        if isinstance(module, PatchedBlock):
            layout.append(_operator_entry(path, "patch", module.patch))
        elif isinstance(module, nn.Sequential) and len(module) == 2 and type(module[1]).__name__ in OPERATOR_TYPES:
            layout.append(_operator_entry(path, "after", module[1]))
    return layout


def save_recovered(model: PreTrainedModel, tokenizer, folder: str | Path) -> Path:
    """Write a recovered (or plain pruned) variant to `folder`; only its surviving blocks are saved."""
    folder = Path(folder)
    record = dict(getattr(model.config, "ghosted", None) or {})
    if not record:
        raise GhostedError("only pruned variants built by ghosted_core can be saved (no 'ghosted' record in the config)")
    record["layout"] = operator_layout(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-") as tmp:
        staged = Path(tmp) / "model"
        staged.mkdir()
        config = model.config.to_dict() | {"ghosted": record}
        config["num_hidden_layers"] = len(model.model.layers)
        (staged / "config.json").write_text(json.dumps(config, indent=2, default=str))
        save_model(model, str(staged / WEIGHTS))  # de-duplicates tied tensors
        if tokenizer is not None:
            tokenizer.save_pretrained(staged)
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    log.info("saved %s (%d blocks, %d operator modules) to %s", record.get("operator", "variant"),
             len(model.model.layers), len(record["layout"]), folder)
    return folder


def archive_recovered(model: PreTrainedModel, tokenizer, path: str | Path) -> Path:
    """`save_recovered` into one uncompressed zip at `path` (fp32 weights barely compress), for downloads."""
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}-") as tmp:
        folder = save_recovered(model, tokenizer, Path(tmp) / path.stem)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
            for file in sorted(folder.rglob("*")):
                if file.is_file():
                    archive.write(file, Path(path.stem) / file.relative_to(folder))
    return path


def _apply_layout(model: PreTrainedModel, layout: list[dict]) -> None:
    """Recreate the operator modules (empty, on the meta device) around the model's own modules."""
    for entry in layout:
        parent_path, _, name = entry["path"].rpartition(".")
        parent = model.get_submodule(parent_path)
        original = getattr(parent, name)
        width = entry["width"]
        with torch.device("meta"):  # filled by load_state_dict(assign=True)
            operator = OPERATOR_TYPES[entry["type"]](torch.ones(width) if entry["type"] == "ResidualScale"
                                                     else torch.eye(width))
        wrapped = PatchedBlock(operator, original) if entry["kind"] == "patch" else nn.Sequential(original, operator)
        setattr(parent, name, wrapped)


def load_recovered(folder: str | Path, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) saved by `save_recovered`, with its operators in place."""
    folder = Path(folder)
    if not (folder / "config.json").exists() or not (folder / WEIGHTS).exists():
        raise GhostedError(f"{folder} is not a saved recovered model (config.json and {WEIGHTS} expected)")
    config = AutoConfig.from_pretrained(folder)
    record = getattr(config, "ghosted", None)
    if not record or "layout" not in record:
        raise GhostedError(f"{folder}/config.json has no 'ghosted' record; was it written by save_recovered?")
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary, scales) computed
        model = AutoModelForCausalLM.from_config(config)
    _apply_layout(model, record["layout"])
    state = load_file(str(folder / WEIGHTS), device=str(device))
    if getattr(config, "tie_word_embeddings", False):  # save_model keeps one name of a tied pair
        tied = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
        state.setdefault("lm_head.weight", tied)
        state.setdefault("model.embed_tokens.weight", tied)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise GhostedError(f"{folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").exists() else None
    return model, tokenizer

