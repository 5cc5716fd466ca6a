"""A memory plan from the config alone, before any weight is loaded.

It adds up, with the same formulas the code allocates by:
- the weights: parameters (from the config's shapes) × bytes of the dtype;
- one calibration batch's activations: the forward's transient tensors (hidden states, q/k/v,
  attention scores, the MLP's intermediate), the captured residuals, and the accumulators'
  float64 working copies;
- the statistics: `statistics.statistics_bytes` per boundary × boundaries, plus the fit-time
  solve (four C×C float64 matrices);
- the LM-head logits of one perplexity chunk (float32, chunked by `LOGITS_BUDGET`);
- for the `blocks` pipeline, the hidden states of every calibration sequence held on the CPU.
It then picks where the statistics live and which calibration pipeline runs ("auto"), and
refuses, with one line naming the way out, what cannot fit.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from ghosted_core.errors import GhostedError
from ghosted_core.statistics import STATS_ITEM, StatNeeds, statistics_bytes

HEADROOM = 0.9  # plan against 90% of what the device reports free
FIT_MATRICES = 4  # C×C float64 at fit time: assembled Gram and cross matrices, the regularized copy, the solution
GIB = 2**30
LOGITS_BUDGET = 2**28  # bytes of logits (the head's output and its fp32 copy) materialized at once, per perplexity chunk


def estimate_parameters(config: PretrainedConfig) -> int:
    """Parameter count of a decoder-only LM from its config (to refuse what cannot fit before loading)."""
    c = config.hidden_size
    layers = config.num_hidden_layers
    return int(layers * block_parameters(config) + config.vocab_size * c * (1 if _tied(config) else 2) + c)


def block_parameters(config: PretrainedConfig) -> int:
    """Parameters of one decoder block: attention projections, the gated MLP and two norms."""
    c = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or c // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = c * head_dim * (2 * heads + 2 * kv_heads)
    return attention + 3 * c * config.intermediate_size + 2 * c


def _tied(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def available_bytes(device: str) -> int:
    """Free memory on `device` now: the GPU's free bytes, or the host's MemAvailable."""
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 1 << 62


def check_fits(config: PretrainedConfig, device: str, dtype: torch.dtype, name: str) -> None:
    """Refuse a model whose weights would not fit on `device` (device="map" may offload, so it passes)."""
    if device == "map":
        return
    needed = estimate_parameters(config) * dtype_bytes(dtype)
    available = available_bytes(device)
    if needed > HEADROOM * available:
        raise GhostedError(
            f"{name} needs about {needed / GIB:.1f} GiB of weights in {str(dtype).removeprefix('torch.')} "
            f"but {device} has about {available / GIB:.1f} GiB free; use --device map to offload, or a smaller model"
        )


def activation_bytes(config: PretrainedConfig, tokens: int, seqlen: int, dtype: torch.dtype, residuals: int,
                     branches: int) -> int:
    """One calibration batch of `tokens` (= sequences × seqlen): the forward's transient tensors and
    what the capture and the accumulators hold (grows with tokens·C, and tokens·seqlen·heads)."""
    c, item = config.hidden_size, dtype_bytes(dtype)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or c // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    forward = tokens * item * (4 * c + (heads + 2 * kv_heads) * head_dim + 3 * config.intermediate_size)
    scores = tokens * seqlen * heads * item  # (B, H, T, T) when attention materializes its scores
    captured = (residuals + branches) * tokens * c * item  # (B, T, C) per captured index
    working = 3 * tokens * c * STATS_ITEM  # x_pre, Δ, m as float64 (T, C) in the accumulator
    return forward + scores + captured + working


def logits_bytes(config: PretrainedConfig, batch: int, seqlen: int) -> int:
    """Float32 logits of one perplexity chunk, and cross-entropy's copy of them."""
    full = 4 * config.vocab_size * batch * max(seqlen - 1, 1)
    return 2 * min(full, max(LOGITS_BUDGET, 4 * config.vocab_size * batch))


def max_boundaries(criterion: str, num_layers: int, n: int, layers: tuple[int, ...] = ()) -> int:
    """The most boundaries (runs of removed blocks) a criterion can produce, before it has scored anything."""
    from ghosted_core.plan import boundaries_of

    if criterion == "manual":
        return len(boundaries_of(layers))
    if criterion in ("streamline", "angular", "kl"):  # criteria that remove one run
        return 1 if n > 0 else 0
    if criterion == "none" or n <= 0:
        return 0
    return max(1, min(n, num_layers - n + 1))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a run needs where, worked out from the config before loading; `to_json` for results.json."""

    model: str
    device: str  # where the model computes: cpu, cuda, cuda:N or map
    dtype: str
    parameters: int
    weights_bytes: int
    width: int
    batch_tokens: int  # sequences × seqlen per calibration forward
    activation_bytes: int  # one calibration batch
    boundaries: int
    stats_needs: str
    sink_capacity: int
    stats_bytes_per_boundary: int  # what each boundary's accumulator allocates
    stats_bytes: int  # × boundaries
    fit_bytes: int  # the C×C solve at fit time
    hidden_cache_bytes: int  # `blocks`: every calibration sequence's hidden states (and open boundaries' copies) on the CPU
    logits_bytes: int  # one perplexity chunk of the LM head
    pipeline: str  # calibration pipeline chosen: full or blocks
    stats_device: str  # where the statistics live: cpu or cuda
    device_bytes: int  # needed on the compute device (0: the device is the host)
    host_bytes: int  # needed in host memory
    device_available: int | None
    host_available: int

    @property
    def fits(self) -> bool:
        host_ok = self.host_bytes <= HEADROOM * self.host_available
        device_ok = self.device_available is None or self.device_bytes <= HEADROOM * self.device_available
        return host_ok and device_ok

    def to_json(self) -> dict:
        return asdict(self) | {"fits": self.fits}

    def summary(self) -> str:
        """One line: what goes where, against what is free."""
        where = f"device {self.device_bytes / GIB:.2f} of {self.device_available / GIB:.1f} GiB free, " \
            if self.device_available is not None else ""
        return (f"memory plan: weights {self.weights_bytes / GIB:.2f} GiB ({self.dtype}), "
                f"statistics {self.stats_bytes / GIB:.2f} GiB ({self.boundaries} boundaries × "
                f"{self.stats_bytes_per_boundary / 2**20:.0f} MiB, on {self.stats_device}), "
                f"calibration batch {self.activation_bytes / GIB:.2f} GiB, pipeline {self.pipeline}; "
                f"{where}host {self.host_bytes / GIB:.2f} of {self.host_available / GIB:.1f} GiB free")

    def check(self) -> None:
        """Refuse a plan that cannot fit, with the way out."""
        if self.fits:
            return
        if self.device_available is not None and self.device_bytes > HEADROOM * self.device_available:
            raise GhostedError(
                f"{self.model} does not fit {self.device}: it needs about {self.device_bytes / GIB:.1f} GiB there "
                f"({self.weights_bytes / GIB:.1f} GiB of weights) but {self.device_available / GIB:.1f} GiB are free; "
                "use --device map (offload), --stats_device cpu, a smaller --batch_size, "
                "or --calibration_pipeline blocks")
        raise GhostedError(
            f"{self.model} does not fit in memory: it needs about {self.host_bytes / GIB:.1f} GiB "
            f"({self.weights_bytes / GIB:.1f} GiB of weights, {self.stats_bytes / GIB:.1f} GiB of statistics) but "
            f"{self.host_available / GIB:.1f} GiB are free; use --device map (disk offload), fewer operators or "
            "boundaries, a smaller --batch_size, or a smaller model")


def plan_memory(config: PretrainedConfig, name: str, device: str, dtype: torch.dtype, needs: StatNeeds,
                boundaries: int, sequences: int, seqlen: int, batch_size: int, sink_capacity: int,
                eval_batch: int = 4, eval_seqlen: int | None = None, pipeline: str = "auto",
                stats_device: str = "auto", device_available: int | None = None,
                host_available: int | None = None) -> MemoryPlan:
    """The plan for one run; "auto" pipeline and statistics device are resolved here.

    Rules: on the CPU everything is host memory and the pipeline is `full`. On a GPU the
    statistics go on the GPU when weights, a batch and the statistics fit there, else on the
    CPU; when not even the weights fit, the `blocks` pipeline keeps them (and the hidden
    states) on the CPU and moves one block at a time. `map` (accelerate offload) calibrates
    with `blocks`, statistics on the CPU.
    """
    c = config.hidden_size
    item = dtype_bytes(dtype)
    params = estimate_parameters(config)
    weights = params * item
    tokens = min(batch_size, max(sequences, 1)) * seqlen
    per_boundary = statistics_bytes(c, needs, sink_capacity)
    stats = per_boundary * boundaries
    fit = FIT_MATRICES * c * c * STATS_ITEM if boundaries else 0
    acts = activation_bytes(config, tokens, seqlen, dtype, 2 * boundaries, boundaries * needs.branch)
    hidden = (1 + 2 * boundaries) * sequences * seqlen * c * item
    logits = logits_bytes(config, eval_batch, eval_seqlen or seqlen)
    gpu = device.startswith("cuda") or device == "map" and (device_available is not None or torch.cuda.is_available())
    if gpu and device_available is None:
        device_available = available_bytes(device if device != "map" else "cuda")
    if host_available is None:
        host_available = available_bytes("cpu")
    if not gpu:  # the CPU computes; with "map", accelerate keeps what exceeds its max_memory on disk
        chosen = "full" if pipeline == "auto" else pipeline
        # `map` without a GPU: accelerate keeps at most its max_memory cap of the weights in RAM, the rest on disk
        resident = 0 if device == "map" else weights
        host = resident + acts + stats + fit + logits + (hidden if chosen == "blocks" else 0)
        return MemoryPlan(name, device, _name(dtype), params, weights, c, tokens, acts, boundaries, needs.describe(),
                          sink_capacity, per_boundary, stats, fit, hidden if chosen == "blocks" else 0, logits, chosen,
                          "cpu", 0, host, None, host_available)
    block = block_parameters(config) * item
    if pipeline == "auto":
        full_fits = device != "map" and weights + acts + logits <= HEADROOM * device_available
        pipeline = "full" if full_fits else "blocks"
    resident = weights if pipeline == "full" else block + config.vocab_size * c * item  # + embeddings for the scoring pass
    base = resident + acts + logits
    if stats_device == "auto":
        stats_device = "cuda" if base + stats + fit <= HEADROOM * device_available else "cpu"
    on_device = stats + fit if stats_device.startswith("cuda") else 0
    host = (0 if pipeline == "full" and device != "map" else weights) + (hidden if pipeline == "blocks" else 0) \
        + (stats + fit if not on_device else 0)
    return MemoryPlan(name, device, _name(dtype), params, weights, c, tokens, acts, boundaries, needs.describe(),
                      sink_capacity, per_boundary, stats, fit, hidden if pipeline == "blocks" else 0, logits, pipeline,
                      stats_device, base + on_device, host, device_available, host_available)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def min_calibration_sequences(width: int, seqlen: int, factor: int = 4, floor: int = 64) -> int:
    """Sequences that give a fit at least `factor`·C tokens (a well-posed C×C least squares), at least `floor`."""
    return max(floor, math.ceil(factor * width / max(seqlen, 1)))
