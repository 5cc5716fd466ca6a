"""llama.cpp's own CPU tools, run as subprocesses on GGUF files: where `make llamacpp` built them, and one
function per tool run.

`make llamacpp` builds llama.cpp once from the source distribution of `llama-cpp-python` on PyPI (its
vendored llama.cpp, commit below) into `cache_dir()/llama.cpp/<version>`: the converter (used by
`export.gguf`) and the tools in `TOOLS`, all from one commit, so the runtime reads what the converter writes.

- `llamacpp_generate`: greedy tokens of a prompt (llama-completion).
- `llamacpp_perplexity`: perplexity of a text file (llama-perplexity).
- `llamacpp_bench`: prefill and decode tokens/s (llama-bench).
- `quantize_gguf`: an f16 GGUF to Q4_K_M, Q5_K_M, Q6_K or Q8_0 (llama-quantize), with an importance matrix or not.
- `compute_imatrix`: an importance matrix from calibration text (llama-imatrix), as the gguf-my-repo Space makes one.

Every failure of a tool is one GhostedError line quoting the tool's last output lines.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import statistics
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ghosted_core.data.assets import cache_dir
from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python's sdist on PyPI; the Makefile's LLAMACPP_VERSION must match
LLAMACPP_COMMIT = "0c1e57098"  # the llama.cpp commit it vendors (its CHANGELOG)
LLAMACPP_ENV = "GHOSTED_LLAMACPP"  # a folder laid out as `make llamacpp` lays it out, instead of the cache
# Every tool scripts/build_llamacpp.sh builds (its `targets`); a build without one of them is stale.
TOOLS = ("llama-completion", "llama-perplexity", "llama-quantize", "llama-imatrix", "llama-bench")
STDERR_LINES = 12  # converter/tool output lines quoted in an error
# llama-quantize's type names, by the lowercase names we offer (llama.cpp's own file-name style: q4_k_m).
QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0"}


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
class Perplexity:
    """llama-perplexity's estimate: windows of `context` tokens, the second half of each scored."""

    value: float
    error: float  # its ± (standard error of the mean negative log-likelihood, propagated)
    chunks: int
    context: int
    seconds: float

    def to_json(self) -> dict:
        return {"ppl": self.value, "ppl_error": self.error, "chunks": self.chunks, "context": self.context,
                "ppl_seconds": round(self.seconds, 2)}


@dataclass(frozen=True)
class GGUFResult:
    """One GGUF file that the converter or llama-quantize wrote, and its llama-perplexity once measured."""

    path: Path
    outtype: str  # our lowercase name: f16, q8_0, q4_k_m, …
    bytes: int
    seconds: float  # to write it
    perplexity: Perplexity | None = None

    def to_json(self) -> dict:
        ppl = {} if self.perplexity is None else self.perplexity.to_json()
        return {"file": self.path.name, "path": str(self.path), "type": self.outtype, "bytes": self.bytes,
                "seconds": round(self.seconds, 2)} | ppl


@dataclass(frozen=True)
class Generation:
    """Greedy continuation of a prompt in llama.cpp: token ids as its tokenizer and model chose them."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]  # the new tokens only
    text: str  # the new tokens as llama-completion printed them
    seconds: float


@dataclass(frozen=True)
class Speed:
    """One llama-bench test: tokens per second over its repetitions, as llama-bench reports them."""

    tokens: int  # tokens per repetition (n_prompt for prefill, n_gen for decode)
    mean: float  # avg_ts
    stddev: float  # stddev_ts (0 with one repetition)
    median: float  # of samples_ts
    samples: tuple[float, ...]  # samples_ts: tokens/s of each repetition

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "mean_tps": self.mean, "stddev_tps": self.stddev, "median_tps": self.median,
                "samples_tps": list(self.samples)}


@dataclass(frozen=True)
class BenchResult:
    """llama-bench on one GGUF: prefill (pp, a prompt of n_prompt tokens in one batch) and decode (tg, n_gen
    tokens one at a time from an empty context) speeds on the CPU."""

    prefill: Speed | None  # None when n_prompt was 0
    decode: Speed | None  # None when n_gen was 0
    threads: int
    repetitions: int
    seconds: float  # wall time of the whole llama-bench run

    def to_json(self) -> dict:
        return {"prefill": None if self.prefill is None else self.prefill.to_json(),
                "decode": None if self.decode is None else self.decode.to_json(),
                "threads": self.threads, "repetitions": self.repetitions, "seconds": round(self.seconds, 2)}


def llamacpp_dir() -> Path:
    """Where `make llamacpp` puts llama.cpp: `$GHOSTED_LLAMACPP`, else `cache_dir()/llama.cpp/<version>`."""
    override = os.environ.get(LLAMACPP_ENV)
    return Path(override).expanduser() if override else cache_dir() / "llama.cpp" / LLAMACPP_VERSION


def find_llamacpp() -> LlamaCpp:
    """The built llama.cpp with every tool of `TOOLS`, or a GhostedError that says how to build it (a build
    made before a tool was added is stale: `make llamacpp` rebuilds it)."""
    llama = LlamaCpp(llamacpp_dir())
    needed = [llama.root / "BUILD_INFO", llama.converter, llama.gguf_py / "gguf", *(llama.tool(t) for t in TOOLS)]
    missing = [p for p in needed if not p.exists()]
    if missing:
        raise GhostedError(f"llama.cpp is not built ({missing[0]} is missing): run `make llamacpp` once (it builds "
                           f"llama.cpp {LLAMACPP_COMMIT} from PyPI's llama-cpp-python {LLAMACPP_VERSION} source, "
                           "11-23 minutes on 2 shared cores)")
    return llama


def _failure(what: str, code: int, lines) -> GhostedError:
    tail = " | ".join(line.rstrip() for line in lines if line.strip()) or "(no output)"
    return GhostedError(f"{what} failed (exit {code}): {tail}")


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run a llama.cpp program; its combined output, or a GhostedError quoting its last lines."""
    lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
    output: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=cwd, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # streamed, so a long conversion logs as it goes
            output.append(line)
            if line.strip():
                lines.append(line.rstrip())
                log.debug("%s: %s", what, line.rstrip())
        code = proc.wait()
    if code != 0:
        raise _failure(what, code, lines)
    return "".join(output)


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
            raise _failure(f"llama-completion on {Path(gguf).name}", done.returncode,
                           done.stderr.splitlines()[-STDERR_LINES:])
        ids = _session_tokens(session)
    if len(ids) <= max_new_tokens:
        raise RuntimeError(f"llama-completion saved {len(ids)} tokens for {max_new_tokens} new ones")
    text = done.stdout.split("\nllama_completion: saving final output", 1)[0]  # it prints that line on stdout
    return Generation(tuple(ids[:-max_new_tokens]), tuple(ids[-max_new_tokens:]), text, seconds)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+|-?nan|inf)")  # nan: windows too few to vary
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


# llama.cpp's logger is a thread whose queue is never flushed at exit (common/log.cpp leaks it on purpose), so on a
# loaded machine the last lines, the final estimate among them, are sometimes lost: the run is repeated, and the last
# try computes one window more, so that the running estimate over the windows asked for is printed while the next
# one computes (its ± is printed only on the final line: nan then).
PERPLEXITY_ATTEMPTS = 4
_RUNNING = re.compile(r"\[(\d+)\]([0-9.]+),")  # the running estimate after each window


def llamacpp_perplexity(gguf: str | Path, text_file: str | Path, context: int = 256, chunks: int | None = None,
                        threads: int = 1) -> Perplexity:
    """llama-perplexity on a text file: non-overlapping windows of `context` tokens (BOS first where the
    vocabulary adds one), each scored on its second half (`evaluation.perplexity.llamacpp_windowed_perplexity`
    is the same in transformers).

    Needs at least 2·`context` tokens; `chunks` caps the windows. Time grows with chunks × context ×
    parameters; memory with the weights, a KV cache of `context` tokens and context × vocabulary logits.
    """
    llama = find_llamacpp()
    cmd = [str(llama.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text_file), "-c", str(context),
           "-b", str(context), "-t", str(threads), "--no-warmup"]
    start, output = time.perf_counter(), ""
    for attempt in range(PERPLEXITY_ATTEMPTS):
        one_more = chunks is not None and attempt == PERPLEXITY_ATTEMPTS - 1
        asked = None if chunks is None else chunks + one_more
        output = _run(cmd + ([] if asked is None else ["--chunks", str(asked)]), f"llama-perplexity on {Path(gguf).name}")
        final, windows = _FINAL.search(output), _CHUNKS.search(output)
        if windows is None:
            break
        computed = int(windows.group(1))
        wanted = computed if chunks is None else min(chunks, computed)
        if final is not None and computed == wanted:
            return Perplexity(float(final.group(1)), float(final.group(2)), computed, int(windows.group(2)),
                              time.perf_counter() - start)
        running = {int(k): float(v) for k, v in _RUNNING.findall(output)}
        if computed > wanted and wanted in running:  # the estimate over the windows asked for, printed before the exit
            return Perplexity(running[wanted], float("nan"), wanted, int(windows.group(2)), time.perf_counter() - start)
    raise GhostedError(f"llama-perplexity printed no estimate for {Path(gguf).name} (is the text at least "
                       f"{2 * context} tokens?): {' | '.join(output.strip().splitlines()[-3:])}")


def _speed(test: dict, tokens: int) -> Speed:
    samples = tuple(float(s) for s in test.get("samples_ts") or ())
    mean = float(test["avg_ts"])
    return Speed(tokens, mean, float(test.get("stddev_ts") or 0.0), statistics.median(samples) if samples else mean,
                 samples)


def llamacpp_bench(gguf: str | Path, threads: int = 1, n_prompt: int = 128, n_gen: int = 32,
                   repetitions: int = 3) -> BenchResult:
    """Prefill and decode tokens/s of a GGUF by `llama-bench -o json` on the CPU (after its warm-up run).

    Prefill ("pp"): a prompt of `n_prompt` tokens in one batch; decode ("tg"): `n_gen` tokens one at a time.
    0 skips that test (its field is None). Each is repeated `repetitions` times; llama-bench reports the mean,
    the standard deviation and every repetition's tokens/s. Time grows with (repetitions + 1 warm-up) ×
    (n_prompt + n_gen) × parameters; memory with the weights plus a KV cache of n_prompt + n_gen tokens.
    llama.cpp's threads spin while they wait: on a loaded machine, more threads than free cores is slower.
    """
    if threads < 1 or repetitions < 1 or n_prompt < 0 or n_gen < 0 or n_prompt + n_gen == 0:
        raise GhostedError(f"llama-bench needs threads ≥ 1, repetitions ≥ 1 and some tokens to time (got threads "
                           f"{threads}, repetitions {repetitions}, n_prompt {n_prompt}, n_gen {n_gen})")
    llama = find_llamacpp()
    cmd = [str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(repetitions), "-o", "json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    seconds = time.perf_counter() - start
    what = f"llama-bench on {Path(gguf).name}"
    if done.returncode != 0:
        raise _failure(what, done.returncode, (done.stderr + done.stdout).splitlines()[-STDERR_LINES:])
    try:
        tests = json.loads(done.stdout)  # one entry per test: pp (n_gen 0), then tg (n_prompt 0)
    except json.JSONDecodeError:
        raise _failure(what, done.returncode, ["printed no JSON:", *done.stdout.splitlines()[-3:]]) from None
    prefill = next((_speed(t, n_prompt) for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0), None)
    decode = next((_speed(t, n_gen) for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0), None)
    if (prefill is None) != (n_prompt == 0) or (decode is None) != (n_gen == 0):
        raise GhostedError(f"{what} reported {len(tests)} tests, not the pp {n_prompt} / tg {n_gen} asked for")
    used = {int(t["n_threads"]) for t in tests}
    return BenchResult(prefill, decode, used.pop() if len(used) == 1 else threads, repetitions, seconds)


def _written(tmp: Path, out: Path, what: str) -> None:
    """Rename a tool's finished output into place (so `out` is either complete or absent)."""
    if not tmp.exists():
        raise GhostedError(f"{what} wrote no file")
    os.replace(tmp, out)


def _temporary(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def quantize_gguf(source_f16: str | Path, out: str | Path, qtype: str, imatrix: str | Path | None = None,
                  threads: int | None = None) -> GGUFResult:
    """An f16 (or f32/bf16) GGUF quantized by llama-quantize to `qtype` (q4_k_m, q5_k_m, q6_k or q8_0).

    With `imatrix` (a file from `compute_imatrix`), the k-quants weight each column's rounding by how much
    calibration activations used it; Q8_0 ignores it. Written under a temporary name beside `out` and renamed
    into place. `threads`: llama-quantize's own default (every core) when None. llama-quantize records the
    matrix's file as given in the GGUF (`quantize.imatrix.file`): it is run in the matrix's folder and given its
    bare name, so no path of this machine ends up in the file. Time grows with the parameter
    count (the k-quants search each block's scales: ~2-4× Q8_0's time); memory with the largest tensor (it
    quantizes one tensor at a time from the memory-mapped source); disk: ~0.60 (q4_k_m), 0.69 (q5_k_m),
    0.82 (q6_k), 1.06 (q8_0) bytes per parameter, plus f32 norms.
    """
    if qtype not in QUANT_TYPES:
        raise GhostedError(f"unknown quantized GGUF type {qtype!r}; use one of {', '.join(QUANT_TYPES)}")
    source_f16, out = Path(source_f16).resolve(), Path(out).resolve()
    imatrix = None if imatrix is None else Path(imatrix).resolve()
    if not source_f16.is_file():
        raise GhostedError(f"{source_f16} is not a GGUF file")
    if imatrix is not None and not imatrix.is_file():
        raise GhostedError(f"importance matrix {imatrix.name} not found")
    llama = find_llamacpp()
    tmp = _temporary(out)
    cmd = [str(llama.tool("llama-quantize"))]
    cmd += ["--imatrix", imatrix.name] if imatrix is not None else []  # run in its folder: see below
    cmd += [str(source_f16), str(tmp), QUANT_TYPES[qtype]] + ([str(threads)] if threads else [])
    start = time.perf_counter()
    try:
        _run(cmd, f"llama-quantize ({source_f16.name} to {QUANT_TYPES[qtype]})",
             cwd=None if imatrix is None else imatrix.parent)
        _written(tmp, out, f"llama-quantize ({source_f16.name} to {QUANT_TYPES[qtype]})")
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    size = out.stat().st_size
    log.info("quantized %s to %s (%s%s, %.1f MB) in %.1f s", source_f16.name, out.name, qtype,
             ", importance matrix" if imatrix else "", size / 1e6, seconds)
    return GGUFResult(out, qtype, size, seconds)


def compute_imatrix(gguf: str | Path, text_file: str | Path, out: str | Path, context: int = 512,
                    chunks: int | None = 32, threads: int = 1) -> Path:
    """llama-imatrix on calibration text: per weight matrix, the mean squared activation of each input column
    over `chunks` windows of `context` tokens (as the gguf-my-repo Space makes one), written to `out` (llama.cpp's
    GGUF imatrix format) for `quantize_gguf(..., imatrix=out)`.

    Needs at least 2·`context` tokens of text. Time grows with chunks × context × parameters (a forward pass
    each); memory with the weights, a KV cache of `context` tokens and one float per input column per matrix;
    disk: that float per column (~1 MB for SmolLM2-135M).

    llama-imatrix records the text file as given in the matrix, and llama-quantize copies it into every GGUF
    made with it (`quantize.imatrix.dataset`): it is run in the text's folder and given its bare name, so no
    path of this machine ends up in a GGUF.
    """
    gguf, out, text_file = Path(gguf).resolve(), Path(out).resolve(), Path(text_file).resolve()
    if not text_file.is_file():
        raise GhostedError(f"calibration text {text_file.name} not found")
    llama = find_llamacpp()
    tmp = _temporary(out)
    cmd = [str(llama.tool("llama-imatrix")), "-m", str(gguf), "-f", text_file.name, "-o", str(tmp),
           "--output-format", "gguf", "-c", str(context), "-b", str(context), "-t", str(threads), "--no-ppl"]
    cmd += ["--chunks", str(chunks)] if chunks else []
    start = time.perf_counter()
    try:
        _run(cmd, f"llama-imatrix on {gguf.name}", cwd=text_file.parent)
        _written(tmp, out, f"llama-imatrix on {gguf.name}")
    finally:
        tmp.unlink(missing_ok=True)
    log.info("importance matrix of %s from %s in %.1f s", gguf.name, Path(text_file).name,
             time.perf_counter() - start)
    return out
