"""GGUF files of stock exports, written by llama.cpp's own converter, and llama.cpp runs that check them.

Nothing here writes GGUF itself. `make llamacpp` builds llama.cpp once from the source distribution of
`llama-cpp-python` on PyPI (its vendored llama.cpp, commit below) into `cache_dir()/llama.cpp/<version>`:
the converter (`convert_hf_to_gguf.py` with the matching `gguf-py`) and the CPU tools `llama-completion`
and `llama-perplexity`, all from one commit, so the runtime reads what the converter writes.

- `convert_to_gguf(folder, out, "f16")` runs the converter in a subprocess of this Python (the venv's
  torch, transformers and sentencepiece are the converter's dependencies), and renames the file into
  place only once it is complete. Only stock exports convert: llama.cpp has no remote code.
- `export_gguf(model, tokenizer, folder, "q8_0")` writes a variant as a stock folder (`export.folder`)
  with its GGUF beside the safetensors and a GGUF section in its model card (`--export gguf`).
- `llamacpp_generate` (greedy tokens of a prompt) and `llamacpp_perplexity` (llama-perplexity on a text
  file) are how the tests check a GGUF in llama.cpp itself, not through transformers' GGUF reader.

One gap in the converter is closed: for Gemma-3 it writes no per-layer attention types, and llama.cpp
then assumes Google's pattern (every 6th layer global, with its own RoPE base). A pruned Gemma-3 whose
kept layers break that pattern would load and run with the wrong attention (and RoPE) in some layers, so
the converter is started with its Gemma-3 class extended to write llama.cpp's per-layer
`sliding_window_pattern` array (a key its runtime already reads) from the export's `layer_types`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ghosted_core.data.assets import cache_dir
from ghosted_core.errors import GhostedError
from ghosted_core.export.folder import ExportResult, export_variant
from ghosted_core.export.model_card import gguf_section

log = logging.getLogger(__name__)

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python's sdist on PyPI; the Makefile's LLAMACPP_VERSION must match
LLAMACPP_COMMIT = "0c1e57098"  # the llama.cpp commit it vendors (its CHANGELOG)
LLAMACPP_ENV = "GHOSTED_LLAMACPP"  # a folder laid out as `make llamacpp` lays it out, instead of the cache
OUTTYPES = ("f16", "q8_0", "bf16", "f32")  # the converter's own --outtype values that we offer
TOOLS = ("llama-completion", "llama-perplexity")
STDERR_LINES = 12  # converter/tool output lines quoted in an error

# Runs in the subprocess as `python -c CONVERTER_MAIN <convert_hf_to_gguf.py> <its arguments>`, with the
# converter's folder and its gguf-py first on sys.path. It imports nothing from ghosted_core.
CONVERTER_MAIN = r"""
import runpy, sys
script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
from conversion import gemma

_set_parameters = gemma.Gemma3Model.set_gguf_parameters

def set_gguf_parameters(self):
    _set_parameters(self)
    types = self.hparams.get("layer_types")
    if self.model_arch != gemma.gguf.MODEL_ARCH.GEMMA3 or not types or "sliding_window" not in self.hparams:
        return
    swa = [t == "sliding_attention" for t in types]
    if swa != [i % 6 < 5 for i in range(len(types))]:  # llama.cpp's default for Gemma-3: 5 local, 1 global
        self.gguf_writer.add_sliding_window_pattern(swa)

gemma.Gemma3Model.set_gguf_parameters = set_gguf_parameters
runpy.run_path(script, run_name="__main__")
"""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: the converter and the CPU tools of one commit."""

    root: Path

    @property
    def converter(self) -> Path:
        return self.root / "convert" / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.root / "convert" / "gguf-py"

    def tool(self, name: str) -> Path:
        return self.root / "bin" / name

    def build_info(self) -> str:
        return (self.root / "BUILD_INFO").read_text()


@dataclass(frozen=True)
class GGUFResult:
    """What `convert_to_gguf` wrote."""

    path: Path
    outtype: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Generation:
    """Greedy continuation of a prompt in llama.cpp: token ids as its tokenizer and model chose them."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]  # the new tokens only
    text: str  # the new tokens as llama-completion printed them
    seconds: float


@dataclass(frozen=True)
class Perplexity:
    """llama-perplexity's estimate: windows of `context` tokens, the second half of each scored."""

    value: float
    error: float  # its ± (standard error of the mean negative log-likelihood, propagated)
    chunks: int
    context: int
    seconds: float


def llamacpp_dir() -> Path:
    """Where `make llamacpp` puts llama.cpp: `$GHOSTED_LLAMACPP`, else `cache_dir()/llama.cpp/<version>`."""
    override = os.environ.get(LLAMACPP_ENV)
    return Path(override).expanduser() if override else cache_dir() / "llama.cpp" / LLAMACPP_VERSION


def find_llamacpp() -> LlamaCpp:
    """The built llama.cpp, or a GhostedError that says how to build it."""
    llama = LlamaCpp(llamacpp_dir())
    needed = [llama.root / "BUILD_INFO", llama.converter, llama.gguf_py / "gguf", *(llama.tool(t) for t in TOOLS)]
    missing = [p for p in needed if not p.exists()]
    if missing:
        raise GhostedError(f"llama.cpp is not built ({missing[0]} is missing): run `make llamacpp` once (it builds "
                           f"llama.cpp {LLAMACPP_COMMIT} from PyPI's llama-cpp-python {LLAMACPP_VERSION} source, "
                           "about 5 minutes on 2 cores)")
    return llama


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
    return config


def _warn_sliding_window(config: dict, name: str) -> None:
    """llama.cpp runs Mistral and Qwen2 with full attention: say so where the checkpoint has a sliding window."""
    model_type, window = config.get("model_type"), config.get("sliding_window")
    windowed = window and (model_type == "mistral" or (model_type == "qwen2" and config.get("use_sliding_window")))
    if windowed and window < config.get("max_position_embeddings", 0):
        log.warning("%s has a sliding window of %d tokens, which llama.cpp's %s graph does not apply: its outputs "
                    "differ from transformers' once a sequence is longer than that", name, window, model_type)


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
    """Run a llama.cpp program; its combined output, or a GhostedError quoting its last lines."""
    lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
    output: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # streamed, so a long conversion logs as it goes
            output.append(line)
            if line.strip():
                lines.append(line.rstrip())
                log.debug("%s: %s", what, line.rstrip())
        code = proc.wait()
    if code != 0:
        tail = " | ".join(lines) or "(no output)"
        raise GhostedError(f"{what} failed (exit {code}): {tail}")
    return "".join(output)


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


def _session_tokens(path: Path) -> list[int]:
    """Token ids of a llama.cpp session file: magic 'ggsn', version, count (u32 each), then int32 ids."""
    data = path.read_bytes()
    magic, _version, count = struct.unpack_from("<III", data)
    if magic != 0x6767736E:
        raise RuntimeError(f"{path} is not a llama.cpp session file")
    return list(struct.unpack_from(f"<{count}i", data, 12))


def llamacpp_generate(gguf: str | Path, prompt: str, max_new_tokens: int = 16, threads: int = 1,
                      context: int = 1024) -> Generation:
    """Greedy continuation of `prompt` by llama-completion (top-k 1, temperature 0, EOS ignored).

    The token ids come from the session file llama-completion saves (`--prompt-cache-all`), not from
    re-tokenizing its text. `threads` is 1 by default: llama.cpp's threads spin while they wait, and on a
    shared 2-core machine a second thread made generation ~30× slower. Time grows with
    (prompt + new tokens) × parameters; memory with the weights plus a KV cache of `context` tokens.
    """
    llama = find_llamacpp()
    with tempfile.TemporaryDirectory(prefix="ghosted-llamacpp-") as tmp:
        session = Path(tmp) / "session.bin"
        cmd = [str(llama.tool("llama-completion")), "-m", str(gguf), "-p", prompt, "-n", str(max_new_tokens),
               "--temp", "0", "--top-k", "1", "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup",
               "-t", str(threads), "-c", str(context), "--prompt-cache", str(session), "--prompt-cache-all"]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not session.exists():
            tail = " | ".join(line for line in done.stderr.splitlines()[-STDERR_LINES:] if line.strip())
            raise GhostedError(f"llama-completion failed on {Path(gguf).name} (exit {done.returncode}): {tail}")
        ids = _session_tokens(session)
    if len(ids) <= max_new_tokens:
        raise RuntimeError(f"llama-completion saved {len(ids)} tokens for {max_new_tokens} new ones")
    text = done.stdout.split("\nllama_completion: saving final output", 1)[0]  # it prints that line on stdout
    return Generation(tuple(ids[:-max_new_tokens]), tuple(ids[-max_new_tokens:]), text, seconds)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def llamacpp_perplexity(gguf: str | Path, text_file: str | Path, context: int = 256, chunks: int | None = None,
                        threads: int = 1) -> Perplexity:
    """llama-perplexity on a text file: non-overlapping windows of `context` tokens (BOS first where the
    vocabulary adds one), each scored on its second half.

    Needs at least 2·`context` tokens; `chunks` caps the windows. Time grows with chunks × context ×
    parameters; memory with the weights, a KV cache of `context` tokens and context × vocabulary logits.
    """
    llama = find_llamacpp()
    cmd = [str(llama.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text_file), "-c", str(context),
           "-b", str(context), "-t", str(threads), "--no-warmup"]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    start = time.perf_counter()
    output = _run(cmd, f"llama-perplexity on {Path(gguf).name}")
    final, windows = _FINAL.search(output), _CHUNKS.search(output)
    if final is None or windows is None:
        raise RuntimeError(f"llama-perplexity printed no estimate: {output[-500:]}")
    return Perplexity(float(final.group(1)), float(final.group(2)), int(windows.group(1)), int(windows.group(2)),
                      time.perf_counter() - start)


GGUF_FORMAT = "gguf"  # the export format (--export gguf): a stock folder with its GGUF
GGUF_OUTTYPES = ("f16", "q8_0")  # offered in the CLI and the app (the converter also writes bf16 and f32)


def gguf_name(folder: Path, outtype: str) -> str:
    return f"{folder.name}-{outtype}.gguf"


def export_gguf(model, tokenizer, folder: str | Path, outtype: str = "f16") -> ExportResult:
    """`export_variant` as a stock folder, then llama.cpp's converter into `folder/<name>-<outtype>.gguf`.

    Refused (GhostedError, before anything is written) when llama.cpp is not built or the variant does
    not fold into a stock checkpoint. The model card gains a GGUF section. Time and memory: the stock
    export's, then the converter's (see `convert_to_gguf`); disk: the folder plus 2 B/param at f16.
    """
    if outtype not in OUTTYPES:
        raise GhostedError(f"unknown GGUF type {outtype!r}; use one of {', '.join(OUTTYPES)}")
    find_llamacpp()
    result = export_variant(model, tokenizer, folder, mode="stock")
    converted = convert_to_gguf(result.folder, result.folder / gguf_name(result.folder, outtype), outtype)
    card = result.folder / "README.md"
    card.write_text(card.read_text() + gguf_section(converted.path.name, outtype, LLAMACPP_COMMIT, LLAMACPP_VERSION))
    files = tuple(sorted(p.name for p in result.folder.iterdir()))
    return replace(result, files=files, gguf=converted.path)
