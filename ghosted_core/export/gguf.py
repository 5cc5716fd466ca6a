"""GGUF files of stock exports, written by llama.cpp's own converter and quantized by llama.cpp's own tools.

Nothing here writes GGUF itself. `export.llamacpp` finds the llama.cpp that `make llamacpp` built (converter and
CPU tools of one commit) and runs its tools; this module runs the converter and puts a variant's files together.

- `convert_to_gguf(folder, out, "f16")` runs the converter in a subprocess of this Python (the venv's
  torch, transformers and sentencepiece are the converter's dependencies), and renames the file into
  place only once it is complete. Only stock exports convert: llama.cpp has no remote code.
- `export_gguf(model, tokenizer, folder, ("f16", "q4_k_m"), GGUFOptions(...))` writes a variant as a stock
  folder (`export.folder`) with every asked GGUF beside the safetensors (converted once to f16, the k-quants
  and q8_0 made from it by llama-quantize, with an importance matrix if asked), each scored by
  llama-perplexity beside transformers' fp32, and a GGUF section in its model card (`--export gguf`).

llama.cpp decides some facts from the block count or a layer's index, not from the file (`runtime_rules`): the
converter is started with its class extended to write what a cut model needs (the kept layers'
`sliding_window_pattern` array for Gemma-2, Gemma-3 and gpt-oss; Gemma's attention scale folded into the query),
and a cut whose difference no file can carry (SmolLM3's RoPE-less blocks) is refused before converting.
Qwen3-Next-style classes are told the export has no multi-token-prediction head (transformers does not load it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import llamacpp_windowed_perplexity
from ghosted_core.export.folder import ExportResult, export_variant
from ghosted_core.export.llamacpp import (LLAMACPP_COMMIT, LLAMACPP_ENV, LLAMACPP_VERSION, GGUFResult,  # noqa: F401
                                          compute_imatrix, find_llamacpp, llamacpp_generate, llamacpp_perplexity,
                                          quantize_gguf, _run)
from ghosted_core.export.model_card import gguf_section
from ghosted_core.export.runtime_rules import converter_fixes, ignored_window, runtime_refusal, text_values

log = logging.getLogger(__name__)

OUTTYPES = ("f16", "q8_0", "bf16", "f32")  # the converter's own --outtype values that we offer

# Runs in the subprocess as `python -c CONVERTER_MAIN <convert_hf_to_gguf.py> <its arguments>`, with the
# converter's folder and its gguf-py first on sys.path. It imports nothing from ghosted_core.
CONVERTER_MAIN = r"""
import json, os, runpy, sys
script, folder = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[2:]]
from conversion import get_model_class
from conversion.base import ModelBase

fixes = json.loads(os.environ.get("GHOSTED_CONVERTER_FIXES") or "{}")
config = json.load(open(os.path.join(folder, "config.json")))
model_class = get_model_class(config["architectures"][0])
if getattr(model_class, "supports_mtp_export", False):  # transformers loads no MTP head: the export has none
    sys.argv.append("--no-mtp")

_set_parameters = model_class.set_gguf_parameters

def set_gguf_parameters(self):
    _set_parameters(self)
    if "swa_pattern" in fixes:  # the kept layers' kinds, which the runtime reads before its index rule
        self.gguf_writer.add_sliding_window_pattern(fixes["swa_pattern"])
    if "final_softcap" in fixes:  # the converter wrote no key, and the runtime's default would cap
        self.gguf_writer.add_final_logit_softcapping(fixes["final_softcap"])

model_class.set_gguf_parameters = set_gguf_parameters
_modify = ModelBase.modify_tensors

def modify_tensors(self, data_torch, name, bid):
    scale = fixes.get("query_scale")
    if scale and name.endswith(scale["suffix"]):  # after the class's own shift (Gemma's 1 + w)
        data_torch = data_torch * scale["factor"]
    return _modify(self, data_torch, name, bid)

ModelBase.modify_tensors = modify_tensors
runpy.run_path(script, run_name="__main__")
"""


def check_gguf_exportable(folder: str | Path) -> dict:
    """The config of a stock export folder that the converter can read; GhostedError otherwise."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise GhostedError(f"{folder} is not an exported model folder (no config.json)")
    config = json.loads(config_file.read_text())
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("ghosted_") or "auto_map" in config:
        raise GhostedError(f"{folder.name} is a remote-code export ({model_type or 'auto_map'}), and llama.cpp runs "
                           "only stock architectures: export the variant as stock (--export stock; the stock "
                           "operators fold: none, the replaceme family, magcomp and the refits) and convert that")
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer.model").exists():
        raise GhostedError(f"{folder.name} has no tokenizer files, and a GGUF must carry its vocabulary: export it "
                           "with its tokenizer")
    refusal = runtime_refusal(config)
    if refusal is not None:
        raise GhostedError(f"{folder.name}: {refusal}")
    return config


def _warn_sliding_window(config: dict, name: str) -> None:
    """Say so where llama.cpp will run full attention over a checkpoint's sliding window (`ignored_window`)."""
    window = ignored_window(config)
    if window is not None:
        log.warning("%s has a sliding window of %d tokens, which llama.cpp's %s graph does not apply: its outputs "
                    "differ from transformers' once a sequence is longer than that", name, window,
                    text_values(config).get("model_type"))


def convert_to_gguf(folder: str | Path, out_path: str | Path, outtype: str = "f16",
                    python: str | None = None) -> GGUFResult:
    """Convert a stock export folder to one GGUF file with llama.cpp's converter.

    `outtype`: f16, q8_0 (the converter quantizes itself; no llama-quantize), bf16 or f32. Written under a
    temporary name beside `out_path` and renamed into place, so `out_path` is either complete or absent.
    Time grows with the parameter count (read, cast, write: 4 s for SmolLM2-135M here). Memory: the converter
    is lazy, so beyond torch and the memory-mapped checkpoint it holds about one tensor at a time (610 MB peak
    resident for SmolLM2's 460 MB fp32 export). Disk: 2 bytes per parameter at f16, 1.06 at q8_0.
    """
    if outtype not in OUTTYPES:
        raise GhostedError(f"unknown GGUF type {outtype!r}; use one of {', '.join(OUTTYPES)}")
    folder, out_path = Path(folder), Path(out_path)
    config = check_gguf_exportable(folder)
    if out_path.is_dir():
        raise GhostedError(f"{out_path} is a folder; give the GGUF file's path")
    _warn_sliding_window(config, folder.name)
    llama = find_llamacpp()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join([str(llama.converter.parent), str(llama.gguf_py)])  # the matching gguf-py
    env["GHOSTED_CONVERTER_FIXES"] = json.dumps(converter_fixes(config))
    cmd = [python or sys.executable, "-c", CONVERTER_MAIN, str(llama.converter), str(folder),
           "--outfile", str(tmp), "--outtype", outtype]
    start = time.perf_counter()
    try:
        _run(cmd, f"llama.cpp's converter ({folder.name} to {outtype})", env=env)
        if not tmp.exists():
            raise GhostedError(f"llama.cpp's converter wrote no file for {folder.name}")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    size = out_path.stat().st_size
    log.info("converted %s to %s (%s, %.1f MB) in %.1f s", folder.name, out_path.name, outtype, size / 1e6, seconds)
    return GGUFResult(out_path, outtype, size, seconds)


GGUF_FORMAT = "gguf"  # the export format (--export gguf): a stock folder with its GGUF files
# Offered in the CLI and the app, largest first: the converter writes f16, llama-quantize the rest from it.
GGUF_OUTTYPES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")


@dataclass(frozen=True)
class GGUFOptions:
    """What `export_gguf` does beyond writing the files: an importance matrix, and a perplexity per file."""

    imatrix_text: str | Path | None = None  # calibration text for llama-imatrix (a Path: a text file); None: none
    imatrix_label: str = ""  # what that text is, for the card (e.g. the run's calibration corpus)
    eval_text: str | Path | None = None  # every file's llama-perplexity, and the variant's in transformers fp32
    eval_label: str = ""  # what that text is
    context: int = 512  # tokens per window of llama-perplexity and llama-imatrix (llama.cpp's default)
    ppl_chunks: int = 8  # windows scored (the second half of each)
    imatrix_chunks: int = 32  # windows the importance matrix is summed over
    max_chars: int = 200_000  # a longer text is cut to this many characters (the windows read less than that)
    threads: int = 1  # llama.cpp's threads spin while they wait: 1 on a shared machine

    def __post_init__(self) -> None:
        if min(self.context, self.ppl_chunks, self.imatrix_chunks, self.max_chars, self.threads) < 1:
            raise GhostedError(f"GGUF options must be positive: context {self.context}, ppl_chunks "
                               f"{self.ppl_chunks}, imatrix_chunks {self.imatrix_chunks}, max_chars "
                               f"{self.max_chars}, threads {self.threads}")


@dataclass(frozen=True)
class GGUFExport(ExportResult):
    """What `export_gguf` wrote: the stock folder, every GGUF in it, and how each scored."""

    ggufs: tuple[GGUFResult, ...] = ()  # in the order asked for
    imatrix: str | None = None  # the text the k-quants' importance matrix came from; None: no matrix
    eval_label: str = ""  # the text of the perplexities
    reference_ppl: float | None = None  # transformers fp32 on the same windows as llama-perplexity

    def to_json(self) -> dict:
        first = self.ggufs[0] if self.ggufs else None
        evaluation = None if not self.eval_label or first is None or first.perplexity is None else {
            "text": self.eval_label, "context": first.perplexity.context, "chunks": first.perplexity.chunks,
            "transformers_fp32_ppl": self.reference_ppl}
        return super().to_json() | {"ggufs": [g.to_json() for g in self.ggufs], "imatrix": self.imatrix,
                                    "gguf_eval": evaluation}


def parse_gguf_types(types: str | Sequence[str]) -> tuple[str, ...]:
    """A comma list (or sequence) of GGUF types, checked against `GGUF_OUTTYPES` (case ignored, repeats dropped)."""
    items = types.split(",") if isinstance(types, str) else list(types)
    names = tuple(dict.fromkeys(str(t).strip().lower() for t in items if str(t).strip()))
    unknown = [n for n in names if n not in GGUF_OUTTYPES]
    if unknown or not names:
        what = f"unknown GGUF type {unknown[0]!r}" if unknown else "no GGUF type given"
        raise GhostedError(f"{what}; use one or more of {', '.join(GGUF_OUTTYPES)} (a comma list)")
    return names


def gguf_name(folder: Path, outtype: str) -> str:
    return f"{folder.name}-{outtype}.gguf"


def _text_file(text: str | Path, options: GGUFOptions, path: Path) -> Path:
    """A text for llama.cpp as a file: a Path is used as it is, a string written (cut to `max_chars`)."""
    if isinstance(text, Path):
        return text
    path.write_text(text[: options.max_chars])
    return path


def _reference_ppl(model, tokenizer, folder: Path, text: str, options: GGUFOptions) -> float:
    """transformers' fp32 perplexity of the variant on llama-perplexity's windows: the model itself when it is
    fp32, else its stock export reloaded in fp32 on the CPU (memory: 4 B per parameter more)."""
    if next(model.parameters()).dtype != torch.float32:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return llamacpp_windowed_perplexity(model, tokenizer, text, options.context, options.ppl_chunks)


def export_gguf(model, tokenizer, folder: str | Path, types: str | Sequence[str] = "f16",
                options: GGUFOptions = GGUFOptions()) -> GGUFExport:
    """`export_variant` as a stock folder, then its GGUF files `folder/<name>-<type>.gguf` for every type asked.

    llama.cpp's converter writes f16 once; llama-quantize makes every other type from it (with an importance
    matrix from `options.imatrix_text` when given). The f16 file is kept only when asked for; otherwise it is
    written to a hidden folder beside `folder` and removed. With `options.eval_text`, each file is scored by
    llama-perplexity, and the variant by transformers in fp32 on the same windows. The model card gains a
    GGUF section listing every file with its type, size and perplexity.

    Refused (GhostedError, before anything is written) when a type is unknown, llama.cpp is not built or the
    variant does not fold into a stock checkpoint. Time: the stock export, one conversion (see
    `convert_to_gguf`), one llama-quantize per other type (grows with parameters), the importance matrix
    (imatrix_chunks × context tokens of forward passes) and the perplexities ((types + 1) × ppl_chunks ×
    context tokens). Memory: the converter's, then one llama.cpp process at a time (weights, a KV cache of
    `context`); the fp32 reference needs an fp32 copy unless the model is fp32. Disk: the folder, plus
    2 B/param for the f16 (kept or not) and each type's own size.
    """
    types = parse_gguf_types(types)
    find_llamacpp()
    refusal = runtime_refusal(model.config.to_dict())
    if refusal is not None:
        raise GhostedError(f"GGUF: {refusal}")
    result = export_variant(model, tokenizer, folder, mode="stock")
    folder = result.folder
    written: list[GGUFResult] = []
    reference = None
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}-gguf-", dir=folder.parent) as tmp:
        work = Path(tmp)
        f16 = convert_to_gguf(folder, (folder if "f16" in types else work) / gguf_name(folder, "f16"), "f16")
        imatrix = None
        if options.imatrix_text is not None and any("_k" in t for t in types):  # Q8_0 and f16 ignore a matrix
            text_file = _text_file(options.imatrix_text, options, work / "calibration.txt")
            imatrix = compute_imatrix(f16.path, text_file, work / f"{folder.name}.imatrix.gguf", options.context,
                                      options.imatrix_chunks, options.threads)
        for name in types:
            written.append(f16 if name == "f16" else quantize_gguf(
                f16.path, folder / gguf_name(folder, name), name, imatrix, options.threads))
        if options.eval_text is not None:
            text_file = _text_file(options.eval_text, options, work / "evaluation.txt")
            written = [replace(g, perplexity=llamacpp_perplexity(g.path, text_file, options.context,
                                                                 options.ppl_chunks, options.threads))
                       for g in written]
            reference = _reference_ppl(model, tokenizer, folder, text_file.read_text(), options)
    imatrix_label = None if imatrix is None else options.imatrix_label or "calibration text"
    card = folder / "README.md"
    card.write_text(card.read_text() + gguf_section(
        [g.to_json() for g in written], LLAMACPP_COMMIT, LLAMACPP_VERSION, imatrix=imatrix_label,
        eval_label=options.eval_label if options.eval_text is not None else "", reference_ppl=reference))
    files = tuple(sorted(p.name for p in folder.iterdir()))
    return GGUFExport(**{**vars(result), "files": files, "gguf": written[0].path}, ggufs=tuple(written),
                      imatrix=imatrix_label, eval_label=options.eval_label if options.eval_text is not None else "",
                      reference_ppl=reference)
