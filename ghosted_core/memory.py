"""The memory plan: what a run holds, where, phase by phase, from the config alone; and the one rule for "auto".

A run passes through phases, and what each holds at once is added up with the formulas the
code allocates by (`memory_parts`) and the declarations of the registry entries the run uses: score
the blocks (what the criterion declares, `selection.footprint`), calibrate (one
batch's activations, every boundary's statistics, and for `blocks` the hidden states and masks
on the host), fit (the statistics, the fit's working matrices, every variant's kept maps and
modules, a sweep's kept dense states), the held-out pass, and evaluate (perplexity and drift
transients and the LM-head logits of one chunk; then drift; then each variant's size and speed at
batch 1). From the calibration pass on, every phase on a host that computes also holds the allocator's
residue: the buffers the BLAS library keeps once it has multiplied (`memory_parts.allocator_residue_bytes`).
The plan is the largest phase on the compute device and on the host. It then picks the
calibration pipeline (`choose_pipeline`: the only place "auto" is resolved) and where the statistics
live, and refuses, with one line naming the way out, what cannot fit.

Planned once the model is loaded, the free memory measured then is added to what the model
already holds there (`resident_bytes`), so a plan before and after loading agree.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ghosted_core.errors import GhostedError
from ghosted_core.memory_parts import (GIB, OperatorCost, activation_bytes, allocator_residue_bytes, block_parameters,
                                       choice_bytes, drift_bytes, dtype_bytes, estimate_parameters, evaluation_bytes,
                                       fit_bytes, kept_bytes, kept_states_bytes, logits_bytes, mask_bytes, speed_bytes)
from ghosted_core.statistics import STATS_ITEM, StatNeeds, statistics_bytes

HEADROOM = 0.9  # plan against 90% of what the device reports free


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


def resident_bytes(model: nn.Module) -> tuple[int, int]:
    """(host, GPU) bytes the model's parameters and buffers already occupy (offloaded ones count nowhere)."""
    host = gpu = 0
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or tensor.device.type == "meta":
            continue
        seen.add(storage.data_ptr())
        if tensor.device.type == "cuda":
            gpu += storage.nbytes()
        else:
            host += storage.nbytes()
    return host, gpu


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


def choose_pipeline(asked: str, device: str, gpu: bool, full_fits: bool = True) -> str:
    """The calibration pipeline that runs: as asked, or for "auto" `full` wherever one device computes the
    whole model (the CPU, or a GPU holding the weights, a batch and a logits chunk: `full_fits`), and
    `blocks` for an offloaded model on a GPU machine (`map`) or one whose weights do not fit the GPU.

    The one place "auto" is resolved: the memory plan asks it before loading, and
    `calibration.collect` asks it for a loaded model that was never planned (`full_fits`: it is there).
    """
    if asked != "auto":
        return asked
    if device == "map":
        return "blocks" if gpu else "full"
    return "blocks" if device.startswith("cuda") and not full_fits else "full"


@dataclass(frozen=True)
class PlanRequest:
    """What a run will do, in the counts the plan multiplies out (`run.options.memory_plan` builds it)."""

    needs: StatNeeds  # the statistics every boundary keeps
    boundaries: int  # boundaries whose statistics are alive at once (every depth of a sweep)
    sequences: int  # calibration fit sequences
    seqlen: int
    batch_size: int  # calibration sequences per forward
    sink_capacity: int
    operators: tuple[OperatorCost, ...] = ()  # one per variant
    variant_boundaries: int | None = None  # boundaries of one depth's variants (None: `boundaries`)
    candidates: int = 5  # replaceme_keepsink's sink-direction counts
    inner: int = 0  # I, when the down_proj refit's statistics are collected (`memory_parts.inner_width`; 0: none)
    refit_candidates: int = 0  # the refit's (λ, sink count) candidates, held until the held-out pass chooses
    heldout: int = 0  # held-out sequences
    score_bytes: int = 0  # the criterion's scoring beyond the weights, as it declares it (`selection.footprint`)
    score_note: str = ""  # how the criterion's budgets handle what they cannot hold (recompute, spill), "" if all fits
    eval_batch: int = 4
    eval_seqlen: int | None = None
    eval_tokens: int = 0  # perplexity tokens over every corpus
    kept_indices: int = 0  # a sweep's dense-state indices kept for every corpus (0: none)
    kept_cap: int = 0  # above this many bytes the sweep keeps no dense states
    drift: bool = False  # per-block drift on one window at a time
    speed_tokens: int = 0  # the size-and-speed stage's prompt + new tokens (0: speed not measured)
    sequential: bool = False  # +seq variants: one more boundary's statistics and a calibration batch while fitting
    keep_heldout: bool = False  # the run may keep the held-out rows from the calibration pass (a single run does)
    pipeline: str = "auto"
    stats_device: str = "auto"
    # the distill phase (`distill.budget.distill_plan`): on the compute device (training state, backward activations,
    # prefix states, distilled modules) and the host (the teacher cache); `distill_kept`: the distilled variants'
    # modules, alive in every later phase
    distill_device: int = 0
    distill_host: int = 0
    distill_kept: int = 0
    threads: int | None = None  # the host's compute threads (the BLAS's kept buffers grow with them; None: torch's now)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a run needs where, worked out from the config; `to_json` for results.json.

    The byte fields are the parts; `phases` says what each phase holds on the compute device
    and on the host, and `device_bytes` / `host_bytes` are the largest of them.
    """

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
    fit_bytes: int  # the largest fit's working memory (its C×C solves, candidates, a folded down_proj)
    variant_bytes: int  # every variant's kept maps and modules (fp32 C×C operators, folded down_proj copies)
    hidden_cache_bytes: int  # `blocks`: every calibration sequence's hidden states (and open boundaries' copies) on the CPU
    mask_bytes: int  # `blocks`: the recorded attention masks (Gemma-3's sliding windows), T² per batch on the CPU
    kept_states_bytes: int  # a sweep's kept dense evaluation states, on the model's device
    heldout_rows_bytes: int  # the held-out rows the calibration pass keeps (0: the held-out pass streams them again)
    evaluation_bytes: int  # one perplexity batch: the forward's transients and the LM head's logits chunk
    logits_bytes: int  # … of which the logits
    pipeline: str  # calibration pipeline chosen: full or blocks
    stats_device: str  # where the statistics live: cpu or cuda
    device_bytes: int  # needed on the compute device at its peak (0: the device is the host)
    host_bytes: int  # needed in host memory at its peak
    device_available: int | None  # free there, plus what the model already holds there
    host_available: int
    phases: dict  # phase → {"device": bytes, "host": bytes}
    peak_phase: str  # the phase that sets the larger of the two peaks
    score_note: str = ""  # what the criterion's budgets recompute or spill (its `Footprint.note`)
    residue_bytes: int = 0  # the host allocator's residue in every phase from calibration on (the BLAS's kept buffers)

    @property
    def fits(self) -> bool:
        host_ok = self.host_bytes <= HEADROOM * self.host_available
        device_ok = self.device_available is None or self.device_bytes <= HEADROOM * self.device_available
        return host_ok and device_ok

    @property
    def on_device(self) -> int:
        """Bytes on the compute device at the peak (the host's for a CPU run)."""
        return self.device_bytes if self.device_available is not None else self.host_bytes

    @property
    def total(self) -> int:
        """Device and host peaks together."""
        return self.device_bytes + self.host_bytes

    def to_json(self) -> dict:
        return asdict(self) | {"fits": self.fits, "on_device": self.on_device, "total": self.total}

    def summary(self) -> str:
        """One line: what goes where, against what is free."""
        where = f"device {self.device_bytes / GIB:.2f} of {self.device_available / GIB:.1f} GiB, " \
            if self.device_available is not None else ""
        return (f"memory plan: weights {self.weights_bytes / GIB:.2f} GiB ({self.dtype}), "
                f"statistics {self.stats_bytes / GIB:.2f} GiB ({self.boundaries} boundaries × "
                f"{self.stats_bytes_per_boundary / 2**20:.0f} MiB, on {self.stats_device}), "
                f"variants {self.variant_bytes / GIB:.2f} GiB, calibration batch {self.activation_bytes / GIB:.2f} GiB, "
                f"allocator residue {self.residue_bytes / 2**20:.0f} MiB, pipeline {self.pipeline}, "
                f"peak at {self.peak_phase}; "
                f"{where}host {self.host_bytes / GIB:.2f} of {self.host_available / GIB:.1f} GiB")

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


def plan_memory(config: PretrainedConfig, name: str, device: str, dtype: torch.dtype, request: PlanRequest,
                device_available: int | None = None, host_available: int | None = None,
                resident: tuple[int, int] = (0, 0)) -> MemoryPlan:
    """The plan for one run; "auto" pipeline and statistics device are resolved here.

    `device_available` / `host_available`: free bytes now (None: measured). `resident`: (host,
    GPU) bytes this model already holds (`resident_bytes` once loaded), added to what is free,
    since the plan counts the weights itself. Rules: on the CPU everything is host memory and
    the pipeline is `full`. On a GPU the statistics go on the GPU when the device's peak with
    them there fits, else on the CPU; when not even the weights fit, the `blocks` pipeline keeps
    them (and the hidden states) on the CPU and copies one block at a time to the GPU. `map`
    (accelerate offload) calibrates with `blocks`, statistics on the CPU.
    """
    r = request
    c, item = config.hidden_size, dtype_bytes(dtype)
    params = estimate_parameters(config)
    weights = params * item
    tokens = min(r.batch_size, max(r.sequences, 1)) * r.seqlen
    per_boundary = statistics_bytes(c, r.needs, r.sink_capacity, inner_width=r.inner)
    stats = per_boundary * r.boundaries
    depth_boundaries = r.boundaries if r.variant_boundaries is None else r.variant_boundaries
    stats_after = per_boundary * max(r.boundaries - depth_boundaries, 0)  # other depths' statistics, still alive
    fit = max((fit_bytes(op, config, r.candidates, r.inner, r.refit_candidates) for op in r.operators),
              default=0) if r.boundaries else 0
    choice = max((choice_bytes(op, config, r.candidates, r.inner, r.refit_candidates) for op in r.operators),
                 default=0) if r.boundaries else 0
    kept_parts = [kept_bytes(op, config, item, r.inner) for op in r.operators]  # (map, module) per variant
    maps = depth_boundaries * sum(m for m, _ in kept_parts)
    modules = depth_boundaries * sum(m for _, m in kept_parts)
    later = modules + r.distill_kept  # what every phase after the distillation keeps
    acts = activation_bytes(config, tokens, r.seqlen, dtype, 2 * r.boundaries, r.boundaries * r.needs.branch,
                            r.boundaries * bool(r.inner))
    rows = tokens * (4 * c + r.inner) * STATS_ITEM  # the held-out pass: x, m, Δ, a refit's a and one error, float64
    score = r.score_bytes  # the criterion's own declaration, nothing added
    eval_seqlen = r.eval_seqlen or r.seqlen
    logits = logits_bytes(config, r.eval_batch, eval_seqlen)
    evaluate = evaluation_bytes(config, r.eval_batch, eval_seqlen, dtype) + logits
    drift = drift_bytes(config, eval_seqlen, dtype) if r.drift else 0
    kept = kept_states_bytes(c, item, r.eval_tokens, r.kept_indices, r.kept_cap)
    open_copies = 1 + 2 * r.boundaries + r.boundaries * r.inner / c  # `blocks`: hidden states, x_pre/m (and a) copies
    hidden = int(open_copies * r.sequences * r.seqlen * c * item)
    held_hidden = int(open_copies * r.heldout * r.seqlen * c * item)
    masks = mask_bytes(config, r.sequences, r.batch_size, r.seqlen, item)
    # the held-out rows (x_pre, x_post, m) kept from the calibration pass when they cost no more than one
    # boundary's statistics: the held-out pass then needs no forward
    rows_per_boundary = r.heldout * r.seqlen * item * ((2 + r.needs.branch) * c + r.inner)
    held_rows = rows_per_boundary * r.boundaries if r.keep_heldout and 0 < rows_per_boundary <= per_boundary else 0
    gpu = device.startswith("cuda") or device == "map" and (device_available is not None or torch.cuda.is_available())
    if host_available is None:
        host_available = available_bytes("cpu")
    host_available += resident[0]
    if gpu:
        if device_available is None:
            device_available = available_bytes(device if device != "map" else "cuda")
        device_available += resident[1]
        full_fits = device != "map" and weights + acts + logits <= HEADROOM * device_available
        pipeline = choose_pipeline(r.pipeline, device, True, full_fits)
    else:
        device_available = None
        pipeline = choose_pipeline(r.pipeline, device, False)
    blocks = pipeline == "blocks"
    threads = torch.get_num_threads() if r.threads is None else r.threads
    inner_products = r.inner if r.boundaries else 0

    def residue_of(on_gpu: bool, stats_on_gpu: bool) -> int:
        """The host allocator's residue from the calibration pass on (`memory_parts.allocator_residue_bytes`): the
        BLAS's buffers for the products the host computes. A CPU run: the forward's and, once anything is
        calibrated, the statistics'; a GPU run: the statistics' where they live on the host, else none."""
        if not on_gpu:
            return allocator_residue_bytes(config, threads, inner_products, products=bool(r.boundaries))
        if stats_on_gpu or not r.boundaries:
            return 0
        return allocator_residue_bytes(config, threads, inner_products, forward=False)

    def phases(on_gpu: bool, stats_on_gpu: bool) -> dict[str, dict[str, int]]:
        """phase → bytes on the device and the host, given where the model and the statistics live."""
        if not on_gpu:  # the host computes; with "map" and no GPU, accelerate keeps what exceeds max_memory on disk
            model_part = 0 if device == "map" else weights
            parts = {"model": model_part, "host": 0, "stats": 0}
        else:
            on_device = weights if not blocks else block_parameters(config) * item + config.vocab_size * c * item
            parts = {"model": on_device, "host": weights if blocks or device == "map" else 0, "stats": 0}
        table = {
            "score blocks": {"model": score},
            "calibrate": {"model": acts + held_rows, "stats": stats,  # kept rows: the held-out sequences join it
                          "host": hidden + masks + (held_hidden if held_rows else 0) if blocks else 0},
            # a fit's candidates are chosen by a held-out pass right after it, while its statistics live
            # (`run.fitting.fit_variants`): its working memory, or its candidates and that pass's rows
            "fit": {"model": modules + kept + held_rows + (acts if r.sequential else 0),
                    "stats": stats + max(fit, choice + rows if choice else 0) + maps
                    + (per_boundary if r.sequential else 0)},
            # the final held-out pass over every fit, once their statistics are freed
            "held-out": {"model": modules + kept + (held_rows if held_rows else acts),
                         "host": held_hidden if blocks and not held_rows else 0,
                         "stats": maps + rows + stats_after},
            **({"distill": {"model": modules + r.distill_device, "host": r.distill_host}}
               if r.distill_device or r.distill_host else {}),
            "evaluate": {"model": later + kept + evaluate, "stats": stats_after},
            "drift": {"model": later + drift},
            **({"size and speed": {"model": later + speed_bytes(config, r.speed_tokens, dtype)}}
               if r.speed_tokens else {}),
        }
        if not r.boundaries:  # nothing to calibrate (the dense model alone, or no block removed): those stages never run
            for phase in ("calibrate", "fit", "held-out"):
                table.pop(phase)
        residue = residue_of(on_gpu, stats_on_gpu)  # kept from the calibration pass's first products to the end
        for phase, use in table.items():
            if phase != "score blocks":  # the criterion's declaration, nothing added
                use["host"] = use.get("host", 0) + residue
        out = {}
        for phase, use in table.items():
            device_sum = host_sum = 0
            for where, amount in (("model", parts["model"] + use.get("model", 0)), ("host", parts["host"] + use.get("host", 0)),
                                  ("stats", use.get("stats", 0))):
                if where == "host" or (where == "stats" and not stats_on_gpu) or not on_gpu:
                    host_sum += amount
                else:
                    device_sum += amount
            out[phase] = {"device": device_sum, "host": host_sum}
        return out

    if not gpu:
        stats_device = "cpu"
        table = phases(False, False)
        residue = residue_of(False, False)
    else:
        stats_device = r.stats_device
        if stats_device == "auto":
            room = HEADROOM * device_available
            stats_device = "cuda" if max(p["device"] for p in phases(True, True).values()) <= room else "cpu"
        table = phases(True, stats_device.startswith("cuda"))
        residue = residue_of(True, stats_device.startswith("cuda"))
    device_peak = max(p["device"] for p in table.values())
    host_peak = max(p["host"] for p in table.values())
    peak_phase = max(table, key=lambda p: (table[p]["device"], table[p]["host"]) if gpu else table[p]["host"])
    return MemoryPlan(name, device, str(dtype).removeprefix("torch."), params, weights, c, tokens, acts, r.boundaries,
                      r.needs.describe(), r.sink_capacity, per_boundary, stats, fit, maps + modules,
                      hidden if blocks else 0, masks if blocks else 0, kept, held_rows, evaluate, logits, pipeline,
                      stats_device,
                      device_peak if gpu else 0, host_peak, device_available, host_available, table, peak_phase,
                      r.score_note, residue)
