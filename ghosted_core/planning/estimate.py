"""What a run will cost before it starts: memory, time on this device, and a ZeroGPU duration.

Estimates, not measurements, and labelled so wherever they are shown:

- Memory is the run's own memory plan (`run.options.memory_plan` → `memory.plan_memory`: what
  each phase holds, where), for the boundaries of every depth of a sweep at once and its kept
  dense states; the same plan a run makes, not a second estimator.
- Time is a FLOP count divided by a rate: forward passes cost 2 × parameters per token through
  the blocks they run (plus attention, 4 × T × C per token and block, and the LM head, 2 × V × C,
  where perplexity needs it); the float64 statistics 8 × C² per token and boundary; each
  least-squares fit ~20 × C³. The rate is this device's measured matmul rate (`DeviceInfo`)
  times `EFFICIENCY[kind]`, the share of it a transformer forward pass reaches, and the float64
  work runs at the measured float64 rate. Model loading adds weights / `LOAD_BYTES_PER_SECOND`.
  Downloads from the Hub are not counted. On a shared machine the rates are measured under
  whatever load it has at the time, and so is the estimate.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from ghosted_core.errors import GhostedError
from ghosted_core.memory import MemoryPlan
from ghosted_core.memory_parts import estimate_parameters, inner_width, max_boundaries
from ghosted_core.recovery.operators import get_operator, needs_of
from ghosted_core.run.options import RunOptions, memory_plan, sized

# Share of the measured matmul rate a forward pass reaches. CPU: SmolLM2's forward (8 × 256 tokens) ran at
# 0.65-0.85 of a 1024² float32 matmul on this project's 2-core machine.
EFFICIENCY = {"cpu": 0.7, "cuda": 0.4}
# A one-token decode step reads every weight for a few FLOPs each: it reaches a small share of the matmul rate.
# CPU: SmolLM2's greedy decode (batch 1, KV cache, `generate`) ran at 12.7 tokens/s on this project's 2-core
# machine (bench/results/inference.json), ~0.05 of what the fp32 matmul rate gives its 2 × 135 M FLOPs per token;
# GPUs are further from it (launch-bound).
DECODE_EFFICIENCY = {"cpu": 0.05, "cuda": 0.005}
LOAD_BYTES_PER_SECOND = 1.0e9  # reading safetensors from a local disk or the Hub cache
FIT_FLOPS_PER_C3 = 23.0  # eigenvalues for the condition number (~9 C³), the solve (~3 C³), singular values as eig(MᵀM) (~2 + 9 C³)

# ZeroGPU lends a slice of an NVIDIA H200 with 70 GB (huggingface.co/docs/hub/spaces-zerogpu). Outside the
# @spaces.GPU call no GPU is visible, so its rates cannot be measured there; these are assumptions: half of an
# H200's dense bf16 and float64 tensor-core rates (989 and 67 TFLOP/s on NVIDIA's data sheet).
ZEROGPU_MEMORY = 70 * 10**9
ZEROGPU_FLOPS = 0.5 * 989e12
ZEROGPU_FP64_FLOPS = 0.5 * 67e12
ZEROGPU_MIN_SECONDS = 60  # below this, ask for the default duration anyway
ZEROGPU_MAX_SECONDS = 300  # the longest call we ask ZeroGPU for
ZEROGPU_MARGIN = 1.5  # the estimate is rough: ask for half as much again


@dataclass(frozen=True)
class DeviceInfo:
    """A device and the rates the time estimate divides by."""

    name: str  # e.g. "NVIDIA H200", "CPU (2 threads)", "ZeroGPU (H200 slice)"
    kind: str  # "cpu" or "cuda"
    memory_bytes: int  # total memory (GPU memory, or the machine's RAM)
    matmul_flops: float  # dense matmul FLOP/s in the model dtype (bf16 on a GPU, fp32 on the CPU)
    fp64_flops: float  # float64 matmul FLOP/s (statistics and fits)
    source: str  # "measured (…)" or "assumed (…)"

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.kind == "cuda" else 4

    def to_json(self) -> dict:
        return asdict(self)


def _matmul_rate(device: str, dtype: torch.dtype, size: int, seconds: float = 0.2) -> float:
    """FLOP/s of a square matmul, timed for about `seconds` after a warm-up."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        if reps % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * size**3 * reps / elapsed


def zerogpu() -> bool:
    """Whether this process serves a ZeroGPU Space (the `spaces` package sets SPACES_ZERO_GPU there)."""
    return os.environ.get("SPACES_ZERO_GPU", "").strip().lower() in {"1", "true", "yes"}


@functools.lru_cache(maxsize=4)
def current_device(device: str = "auto") -> DeviceInfo:
    """The device runs will use, its memory and measured rates (~1 s, once per process)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "zerogpu" if zerogpu() else "cpu"
    if device == "zerogpu":
        return DeviceInfo("ZeroGPU (NVIDIA H200 slice)", "cuda", ZEROGPU_MEMORY, ZEROGPU_FLOPS, ZEROGPU_FP64_FLOPS,
                          "assumed (half an H200's data-sheet rates; no GPU is visible outside the ZeroGPU call)")
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        rates = (_matmul_rate(f"cuda:{index}", torch.bfloat16, 4096), _matmul_rate(f"cuda:{index}", torch.float64, 2048))
        return DeviceInfo(props.name, "cuda", int(props.total_memory), *rates,
                          "measured (bf16 4096² and float64 2048² matmuls)")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rates = (_matmul_rate("cpu", torch.float32, 1024), _matmul_rate("cpu", torch.float64, 1024))
    return DeviceInfo(f"CPU ({torch.get_num_threads()} threads)", "cpu", int(memory), *rates,
                      "measured (float32 and float64 1024² matmuls)")


# ---------------------------------------------------------------- what a run does


@dataclass(frozen=True)
class Workload:
    """Token and boundary counts of a run (or a sweep) that the estimates multiply out."""

    depths: tuple[int, ...]
    boundaries: int  # distinct boundaries whose statistics are alive during the calibration pass
    fit_tokens: int  # calibration tokens (fit sequences × length)
    heldout_tokens: int
    eval_tokens: int  # perplexity tokens over every corpus
    variants: int  # recovered variants per depth
    least_squares: int  # least-squares fits per boundary (ghost family, replaceme)
    batch_tokens: int  # tokens of one calibration forward pass
    refits: int = 0  # down_proj refits per boundary (each solves one I×I system per candidate)
    refit_candidates: int = 0  # (λ, sink count) candidates per refit
    inner: int = 0  # I, when the refit's statistics are collected (0: none)


def workload(config: PretrainedConfig, options: RunOptions, depths: Sequence[int] | None = None) -> Workload:
    """The counts of `options` (one depth: options.num_prune; a sweep: `depths`) on a model with `config`.

    Boundaries: the most each depth's criterion can make (`memory.max_boundaries`), all alive at once.
    """
    options = sized(options, int(config.hidden_size))
    chosen = tuple(sorted(set(depths))) if depths else (options.num_prune,)
    layers = int(config.num_hidden_layers)
    if options.criterion == "manual":
        chosen = (len(set(options.layers)),)
    boundaries = sum(max_boundaries(options.criterion, layers, n, options.layers) for n in chosen)
    eval_tokens = len(options.eval_corpora) * (options.eval_max_tokens or 100_000)  # uncapped: ~PTB's 82k + margin
    least_squares = sum(1 for v in options.variants if v.operator.startswith("ghost") or v.operator == "replaceme")
    refits = sum(1 for v in options.variants if get_operator(v.operator).needs.inner)
    inner = inner_width(config, needs_of(v.operator for v in options.variants))
    candidates = options.fit.refit_candidates
    return Workload(chosen, boundaries, options.train_size * options.seqlen, options.heldout * options.seqlen,
                    eval_tokens, len(options.variants), least_squares, options.calibrate.batch_size * options.seqlen,
                    refits, candidates if inner else 0, inner)


# ---------------------------------------------------------------- memory


def estimate_memory(config: PretrainedConfig, options: RunOptions, depths: Sequence[int] | None = None,
                    device: DeviceInfo | None = None) -> MemoryPlan:
    """The memory plan of `options` (every depth of a sweep at once, with its kept dense states) on a model
    with `config`, on `device` (default: the CPU), as `run.options.memory_plan` makes it for a run: bf16
    on a GPU, whose memory is taken as its total; host memory is what this machine has free."""
    options = sized(options, int(config.hidden_size))
    gpu = device is not None and device.kind == "cuda"
    return memory_plan(options, config, "cuda" if gpu else "cpu", torch.bfloat16 if gpu else torch.float32,
                       depths=tuple(depths) if depths else None, device_available=device.memory_bytes if gpu else None)


# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds a run (or sweep) should take on a device, by stage (an estimate: see the module docstring)."""

    load: float
    score: float
    calibrate: float
    fit: float
    perplexity: float
    device: str
    speed: float = 0.0  # the size-and-speed stage (`export.gain`): every variant and dense, timed in rounds

    @property
    def total(self) -> float:
        return self.load + self.score + self.calibrate + self.fit + self.perplexity + self.speed

    def to_json(self) -> dict:
        return asdict(self) | {"total": self.total}


def estimate_time(config: PretrainedConfig, options: RunOptions, device: DeviceInfo,
                  depths: Sequence[int] | None = None) -> TimeEstimate:
    """Seconds of each stage of `options` (and `depths`, for a sweep) on a model with `config` on `device`."""
    options = sized(options, int(config.hidden_size))
    work = workload(config, options, depths)
    c, layers, vocab = int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size)
    params = estimate_parameters(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    block_params = (params - vocab * c * (1 if tied else 2)) / layers
    rate, fp64 = device.matmul_flops * EFFICIENCY[device.kind], device.fp64_flops * EFFICIENCY[device.kind]

    def forward(tokens: float, blocks: float, head: bool = False) -> float:
        per_token = blocks * (2 * block_params + 4 * options.seqlen * c) + (2 * vocab * c if head else 0)
        return tokens * per_token / rate

    mean_depth = sum(work.depths) / len(work.depths)
    suffix = max(layers - mean_depth, 1) / 2  # a variant's suffix: about half the surviving blocks
    per_depth_eval = work.variants * forward(work.eval_tokens, suffix, head=True)
    i = work.inner
    stats = (work.fit_tokens + work.heldout_tokens) * work.boundaries * (8 * c * c + 2 * i * i + 4 * i * c) / fp64
    per_depth = max(1, work.boundaries // len(work.depths))
    fits = len(work.depths) * work.least_squares * per_depth * FIT_FLOPS_PER_C3 * c**3
    # each refit candidate: a Cholesky factorization (I³/3), its solve and its calibration error (~4·I²·C)
    fits += len(work.depths) * work.refits * per_depth * work.refit_candidates * (i**3 / 3 + 4 * i * i * c)
    speed = 0.0
    if options.speed.measure:  # warm-up + repeats rounds of (variants + dense) per depth: a prefill and a decode
        opts = options.speed
        kept = max(layers - mean_depth, 1)
        step = forward(1, kept, head=True) * EFFICIENCY[device.kind] / DECODE_EFFICIENCY[device.kind]
        speed = len(work.depths) * (work.variants + 1) * (opts.repeats + 1) * (
            forward(opts.prefill_tokens, kept) + opts.decode_tokens * step)
    return TimeEstimate(
        speed=speed,
        load=params * device.dtype_bytes / LOAD_BYTES_PER_SECOND,
        score=forward(work.fit_tokens, layers),
        calibrate=forward(work.fit_tokens + work.heldout_tokens, layers) + stats,
        fit=fits / fp64,
        perplexity=forward(work.eval_tokens, layers, head=True) + len(work.depths) * per_depth_eval,
        device=device.name,
    )


def gpu_duration(config: PretrainedConfig, options: RunOptions, depths: Sequence[int] | None = None,
                 device: DeviceInfo | None = None) -> int:
    """Seconds to ask `@spaces.GPU(duration=…)` for one run: the estimate with a margin, in
    [ZEROGPU_MIN_SECONDS, ZEROGPU_MAX_SECONDS]; GhostedError when even the maximum is too short."""
    device = device or current_device("zerogpu")
    seconds = ZEROGPU_MARGIN * estimate_time(config, options, device, depths).total
    if seconds > ZEROGPU_MAX_SECONDS:
        raise GhostedError(f"this run would need about {seconds:.0f} s of GPU time, more than the "
                           f"{ZEROGPU_MAX_SECONDS} s a ZeroGPU call may hold; use fewer calibration sequences, "
                           "fewer depths or a smaller perplexity cap")
    return int(max(ZEROGPU_MIN_SECONDS, math.ceil(seconds)))


def check_work_budget(config: PretrainedConfig, options: RunOptions, device: DeviceInfo, budget_seconds: float,
                      depths: Sequence[int] | None = None, runs: int = 1, setting: str = "the work budget") -> float:
    """Refuse, before any work, a run whose estimated time on `device` exceeds `budget_seconds` (an operator's
    limit on what one request may cost a shared server); the estimate otherwise. `runs`: how many such runs the
    request makes (a comparison: one per criterion). The estimate counts loading, scoring, calibration, fits and
    perplexity and the speed measurement (`estimate_time`), not quick tasks or distillation, which have limits of
    their own."""
    seconds = runs * estimate_time(config, options, device, depths).total
    if seconds > budget_seconds:
        raise GhostedError(f"this run would take about {_minutes(seconds)} on {device.name}, more than the "
                           f"{_minutes(budget_seconds)} this server allows a run ({setting}); use fewer calibration "
                           "sequences or shorter ones, fewer perplexity tokens or corpora, fewer operators, depths "
                           "or criteria")
    return seconds


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
