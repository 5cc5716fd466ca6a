"""What pruning buys: each variant's size as it would be saved, and its speed in transformers, against dense.

- Size: parameters and weight bytes of the checkpoint the variant exports to (`export.fold`): a stock
  checkpoint where it folds (the operator's map disappears into the weights), else the remote-code
  one with its operator tensors. Counted from the export's own tensor walk on the meta device (keys, shapes
  and dtypes, no data: nothing is read, folded or copied), at the model's dtype; the safetensors header (a
  few kB) is left out. Time and memory: one pass over the weights' metadata.
- Speed: prefill (one forward over a fixed prompt with the KV cache built and only the last logits, as
  `generate` starts) and decode (greedy `generate` steps with the KV cache, timed token by token after
  the first, so the prompt's prefill is not in it), at batch 1 on the run's device. Every variant is timed
  in the same round, `repeats` rounds in a rotated order, so load on a shared machine hits them alike;
  each figure is the median with its min and max, and each ratio is against dense measured in the same
  rounds. Time grows with (variants + 1) × repeats × (prefill tokens + decode tokens) × the kept
  parameters; memory with one batch-1 forward: a KV cache of prefill + decode tokens, far below the
  perplexity stage's batches (nothing is copied per variant).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import input_device
from ghosted_core.export.fold import stock_blockers, stock_tensors, variant_tensors
from ghosted_core.progress import Tracker
from ghosted_core.stopping import StopCheck, check_stop

SPEED_ENV = "GHOSTED_SPEED"  # "0": sizes only unless a run asks (a test suite; a server that wants no timing)
REFERENCE = "dense"  # every ratio is against the dense model, measured in the same rounds
DECODE_PROMPT = 8  # tokens of the decode prompt (its prefill is not timed)


def speed_by_default() -> bool:
    """Whether a run measures speed when it does not say: yes, unless $GHOSTED_SPEED is 0 (off, false, no)."""
    return os.environ.get(SPEED_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class SpeedOptions:
    """How the speed of every variant is measured (sizes are always reported; they cost no forward pass)."""

    measure: bool = field(default_factory=speed_by_default)  # False: sizes only (--no_speed)
    prefill_tokens: int = 64
    decode_tokens: int = 8  # a run's quick figure (~0.6 s a round for SmolLM2 on 2 cores); bench/gain.py times more
    repeats: int = 3
    seed: int = 0  # of the prompt's token ids (speed does not depend on the text, only on its length)

    def __post_init__(self) -> None:
        if self.prefill_tokens < 1 or self.decode_tokens < 2 or self.repeats < 1:
            raise GhostedError(f"speed measurement needs at least 1 prefill token, 2 decode tokens and 1 repeat (got "
                               f"{self.prefill_tokens}, {self.decode_tokens}, {self.repeats})")


@dataclass(frozen=True)
class Rate:
    """Tokens per second over the repeats: median and spread."""

    median: float
    low: float
    high: float
    samples: int

    @classmethod
    def of(cls, values: list[float]) -> Rate:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def to_json(self) -> dict:
        return {"median": round(self.median, 3), "min": round(self.low, 3), "max": round(self.high, 3),
                "samples": self.samples}


@dataclass(frozen=True)
class Size:
    """A variant's checkpoint: the format it exports to, its parameters and its weight bytes."""

    format: str  # "stock" or "remote_code"
    parameters: int
    weight_bytes: int
    blocks: int  # decoder blocks it runs


@dataclass
class GainReport:
    """Size and speed of every variant of one model and plan; `to_json` gives each variant's results.json entry."""

    sizes: dict[str, Size] = field(default_factory=dict)
    prefill: dict[str, Rate] = field(default_factory=dict)
    decode: dict[str, Rate] = field(default_factory=dict)
    options: SpeedOptions = SpeedOptions()
    measured_on: dict = field(default_factory=dict)

    def variant_json(self, name: str) -> dict:
        """One variant's figures, with its ratios to dense (dense itself: 1.0)."""
        size, dense = self.sizes[name], self.sizes.get(REFERENCE)
        entry: dict = {"format": size.format, "parameters": size.parameters, "weight_bytes": size.weight_bytes,
                       "blocks": size.blocks}
        if dense is not None:
            entry["size_vs_dense"] = size.weight_bytes / dense.weight_bytes
        for key, rates in (("prefill", self.prefill), ("decode", self.decode)):
            if name in rates:
                entry[f"{key}_tokens_per_s"] = rates[name].to_json()
                if REFERENCE in rates:
                    entry[f"{key}_vs_dense"] = rates[name].median / rates[REFERENCE].median
        return entry

    def settings_json(self) -> dict:
        """What every speed rests on: tokens, repeats, the machine, its threads and load."""
        opts = self.options
        return {"measured": bool(self.decode), "prefill_tokens": opts.prefill_tokens, "decode_tokens": opts.decode_tokens,
                "decode_prompt_tokens": DECODE_PROMPT, "repeats": opts.repeats, "batch": 1, "reference": REFERENCE,
                "measured_on": self.measured_on}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_label(device: torch.device) -> dict:
    """Device, CPU, torch's threads and the load average: the label every speed figure carries."""
    label = {"device": str(device), "cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
             "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        label["gpu"] = torch.cuda.get_device_name(device)
    return label


def variant_size(model: PreTrainedModel) -> Size:
    """The checkpoint a variant exports to (stock where it folds), counted tensor by tensor as the export walks it,
    on the meta device: the export's own keys, shapes and dtypes, with no weight read, folded or copied."""
    stock = not stock_blockers(model)
    parameters = weight_bytes = 0
    for chunk in (stock_tensors if stock else variant_tensors)(model, device="meta"):
        for tensor in chunk.values():
            parameters += tensor.numel()
            weight_bytes += tensor.numel() * tensor.element_size()
    return Size("stock" if stock else "remote_code", parameters, weight_bytes, len(model.model.layers))


class _TokenClock:
    """A `generate` streamer that notes when each new token arrives (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill_seconds(model: PreTrainedModel, ids: torch.Tensor) -> float:
    _sync(ids.device)
    start = time.perf_counter()
    model(ids, use_cache=True, logits_to_keep=1)
    _sync(ids.device)
    return time.perf_counter() - start


def _decode_rate(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int) -> float:
    """Greedy decode tokens per second after the first new token (whose time includes the prompt's prefill)."""
    clock = _TokenClock()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, streamer=clock, pad_token_id=0)
    _sync(prompt.device)
    return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def prompt_ids(vocab_size: int, tokens: int, seed: int) -> torch.Tensor:
    """A fixed (1, tokens) prompt of seeded token ids, the same for every variant."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, tokens), generator=generator)


def measure_gain(models: Mapping[str, PreTrainedModel], options: SpeedOptions = SpeedOptions(),
                 should_stop: StopCheck = None, quiet: bool = False) -> GainReport:
    """Size of every model, and (unless `options.measure` is off) its prefill and decode speed, dense first.

    `models` must hold "dense" for the ratios. `should_stop` is polled between timings (`stopping.RunStopped`);
    each timing is a step of its progress (`progress.Tracker`), silent when `quiet`.
    """
    report = GainReport(options=options)
    for name, model in models.items():
        report.sizes[name] = variant_size(model)
    if not options.measure:
        return report
    first = next(iter(models.values()))
    device = input_device(first)
    ids = prompt_ids(int(first.config.get_text_config().vocab_size), options.prefill_tokens, options.seed).to(device)
    report.measured_on = machine_label(device)
    names = list(models)
    prefill: dict[str, list[float]] = {name: [] for name in names}
    decode: dict[str, list[float]] = {name: [] for name in names}
    tracker = Tracker("size and speed", (options.repeats + 1) * len(names), "timings", quiet)
    with torch.inference_mode():
        for name in names:  # warm-up: first-call allocations and kernel choices stay out of the figures
            check_stop(should_stop, "size and speed")
            models[name](ids[:, :8], use_cache=True, logits_to_keep=1)
            _decode_rate(models[name], ids[:, :DECODE_PROMPT], 3)
            tracker.advance()
        for round_ in range(options.repeats):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # rotated, so drift hits all alike
                check_stop(should_stop, "size and speed")
                prefill[name].append(options.prefill_tokens / _prefill_seconds(models[name], ids))
                decode[name].append(_decode_rate(models[name], ids[:, :DECODE_PROMPT], options.decode_tokens))
                tracker.advance()
    report.measured_on["load_average_after"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    report.prefill = {name: Rate.of(values) for name, values in prefill.items()}
    report.decode = {name: Rate.of(values) for name, values in decode.items()}
    return report
