"""Named calibration pipelines: how boundary activations reach the accumulators.

Both pipelines hand every boundary the same thing, batch after batch in the same order:
`consume(k, batch, x_pre, x_post, branch, inner)` with the residual entering boundary k's first
removed block, the residual entering its first surviving block, and (when asked) the MLP
branch output of the block before it, each (B, T, C) in the model's dtype, and (when asked,
for the down_proj refit) that block's down_proj input (B, T, I); None where not asked.

- `full`: one forward of the model per batch with capture hooks, stopped after the last block
  needed. Device memory: the weights plus one batch's activations.
- `blocks` (layer by layer, as llm-compressor's sequential pipeline): the calibration batches'
  hidden states wait on the CPU; one block at a time is copied to the compute device and every
  batch passes through it. Device memory: one block plus one batch, whatever the
  depth; host memory: the hidden states (tokens·C·dtype bytes) plus, per open boundary, a copy
  of its x_pre (and m, and a: tokens·I·dtype bytes) until its end block is reached.

Both leave a model that other threads use undisturbed: `full` through `capture`'s per-thread
hooks; `blocks` because its recorders and hooks act only in the thread that runs it (recording
is serialised per model), and a block that must compute elsewhere runs as a copy on the compute
device, so the shared weights never move.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.model.loading import final_norm
from ghosted_core.progress import track
from ghosted_core.calibration.capture import StopForward, branch_module, capture, down_projection, inner_folds, \
    run_forward
from ghosted_core.plan import Boundary
from ghosted_core.registry import add, lookup

log = logging.getLogger(__name__)

Consumer = Callable[[int, "object", torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], None]


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    run: Callable
    description: str


CALIBRATION_PIPELINES: dict[str, PipelineSpec] = {}


def register_pipeline(name: str, description: str):
    """Add `fn(model, boundaries, branches, batches, consume, compute_device, quiet, inner)` under `name`."""

    def decorator(fn):
        add(CALIBRATION_PIPELINES, name, PipelineSpec(name, fn, description), "calibration pipeline")
        return fn

    return decorator


def get_pipeline(name: str) -> PipelineSpec:
    return lookup(CALIBRATION_PIPELINES, name, "calibration pipeline")


def _needed(boundaries: Sequence[Boundary], branches: bool) -> tuple[set[int], set[int]]:
    residuals = {j for b in boundaries for j in (b.start, b.end)}
    branch_blocks = {b.start - 1 for b in boundaries if branches and b.start > 0}
    return residuals, branch_blocks


def _inner_blocks(model: PreTrainedModel, boundaries: Sequence[Boundary], inner: bool) -> set[int]:
    """Blocks whose down_proj input is wanted: the block before each cut, where the refit folds."""
    return {b.start - 1 for b in boundaries if b.start > 0} if inner and inner_folds(model) else set()


@register_pipeline("full", "one forward per batch through the whole model, stopped after the last block needed")
def full_pipeline(model: PreTrainedModel, boundaries: Sequence[Boundary], branches: bool, batches: Sequence,
                  consume: Consumer, compute_device: torch.device | None = None, quiet: bool = True,
                  inner: bool = False) -> None:
    """Per batch: capture every needed residual, branch and intermediate in one early-stopped forward."""
    residuals, branch_blocks = _needed(boundaries, branches)
    inner_blocks = _inner_blocks(model, boundaries, inner)
    for batch in track(batches, "calibrate", unit="batches", quiet=quiet):
        with capture(model, residuals, branch_blocks, inners=inner_blocks) as seen:
            run_forward(model, batch.input_ids, batch.attention_mask)
        for k, b in enumerate(boundaries):
            consume(k, batch, seen[("residual", b.start)], seen[("residual", b.end)], seen.get(("branch", b.start - 1)),
                    seen.get(("inner", b.start - 1)))


# ---------------------------------------------------------------- block by block


def _home_device(block: nn.Module) -> torch.device:
    for tensor in block.parameters():
        return tensor.device
    return torch.device("cpu")


_RECORDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → lock: one recording pass at a time
_RECORDING_GUARD = threading.Lock()


def _model_lock(model: nn.Module) -> threading.Lock:
    """The lock that serialises patching `model`'s block forwards (and copying its blocks) across threads."""
    with _RECORDING_GUARD:
        lock = _RECORDING.get(model)
        if lock is None:
            lock = _RECORDING[model] = threading.Lock()
        return lock


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@contextlib.contextmanager
def on_compute_device(block: nn.Module, device: torch.device, model: nn.Module | None = None) -> Iterator[nn.Module]:
    """`block` itself when it already lives on `device`, else a copy of it there, for the duration.

    The shared block never moves, so other threads using the model are not disturbed. Memory:
    one block on the compute device, and the same on the host while it is copied (freed on
    exit). A block dispatched by accelerate (offloaded weights) is left alone: its hook brings
    the weights to the execution device for each call. `model`: the model the block belongs to
    (its recording lock keeps the copy free of another thread's recorder).
    """
    if getattr(block, "_hf_hook", None) is not None or _same_device(_home_device(block), torch.device(device)):
        yield block
        return
    with _model_lock(model) if model is not None else contextlib.nullcontext():
        clone = copy.deepcopy(block)
    clone.to(device)
    try:
        yield clone
    finally:
        del clone


def _to(value, device: torch.device):
    """Tensors (also inside tuples, lists and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU, its broadcast (stride-0) axes kept broadcast: a (B, 1, T, T) mask expanded
    from (1, 1, T, T) costs T² on the host, not B·T² (a plain `.cpu()` of a GPU tensor materialises it)."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.detach()[index].cpu().expand(tensor.shape)


def record_block_inputs(model: PreTrainedModel, batch, upto: int) -> tuple[torch.Tensor, list[dict]]:
    """(hidden entering block 0, the keyword arguments of blocks 0 … upto−1) for one batch, on the CPU.

    Every block's forward is replaced for one pass by a recorder that returns its input, so the
    model computes only what it passes to the blocks (embeddings, attention masks, per-layer
    rotary embeddings: Gemma3's sliding and global layers get different ones); block `upto`
    (or the final norm) stops the pass. The recorders and the stop act only in this thread
    (another thread's forward runs the real blocks), and one recording pass per model runs at
    a time. Each tensor is copied to the host once per batch, however many blocks share it.
    Memory: per batch, the hidden state (B·T·C) and the distinct arguments (Gemma-3's sliding
    mask: T² bytes, broadcast over the batch; see `host_copy`).
    """
    layers = model.model.layers
    calls: dict[int, dict] = {}
    hidden: list[torch.Tensor] = []
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (the tensor, its host copy); the tensor kept alive
    owner = threading.get_ident()

    def cpu_once(value):
        if isinstance(value, torch.Tensor):
            entry = shared.get(id(value))
            if entry is None or entry[0] is not value:
                entry = shared[id(value)] = (value, host_copy(value))
            return entry[1]
        if isinstance(value, (tuple, list)):
            return type(value)(cpu_once(v) for v in value)
        if isinstance(value, dict):
            return {k: cpu_once(v) for k, v in value.items()}
        return value

    def recorder(j: int, original):
        def forward(*args, **kwargs):
            if threading.get_ident() != owner:
                return original(*args, **kwargs)
            states = args[0] if args else kwargs.pop("hidden_states")
            if j == 0:
                hidden.append(states.detach().cpu())
            calls[j] = {k: cpu_once(v) for k, v in kwargs.items()} | ({"__args__": cpu_once(args[1:])} if args[1:] else {})
            return states
        return forward

    stop = layers[upto] if upto < len(layers) else final_norm(model)

    def halt(_module, _args, _kwargs=None):  # torch registers a kwargs hook in two steps: another thread's forward
        # may call it between them without kwargs
        if threading.get_ident() == owner:
            raise StopForward

    with _model_lock(model):
        saved = {j: layers[j].__dict__.get("forward") for j in range(upto)}
        handle = stop.register_forward_pre_hook(halt, with_kwargs=True)
        try:
            for j in range(upto):
                layers[j].forward = recorder(j, layers[j].forward)
            run_forward(model, batch.input_ids, batch.attention_mask)
        finally:
            handle.remove()
            for j, original in saved.items():
                if original is None:
                    layers[j].__dict__.pop("forward", None)
                else:
                    layers[j].forward = original
    return hidden[0], [calls[j] for j in range(upto)]


@register_pipeline("blocks", "hidden states on the CPU; one block at a time on the compute device, all batches through it")
def blocks_pipeline(model: PreTrainedModel, boundaries: Sequence[Boundary], branches: bool, batches: Sequence,
                    consume: Consumer, compute_device: torch.device | None = None, quiet: bool = True,
                    inner: bool = False) -> None:
    """Layer-by-layer calibration.

    1. For each batch, record the hidden state entering block 0 and every block's call
       arguments (masks, position embeddings), without running any block.
    2. For block j = 0 … last−1: feed the boundaries whose end is j (their x_pre and m were
       kept when block start−1/start was reached), keep copies of the residual at j for the
       boundaries starting there, run block j on the compute device (a copy of it there when
       it lives elsewhere: the shared weights never move) over every batch, capturing the MLP
       branch when a boundary starts at j+1.
    3. Feed the boundaries ending at the last index.
    Each boundary's accumulator sees its batches in the same order as with `full`.
    """
    layers = model.model.layers
    residuals, branch_blocks = _needed(boundaries, branches)
    inner_blocks = _inner_blocks(model, boundaries, inner)
    last = max(residuals)
    device = torch.device(compute_device) if compute_device is not None else _home_device(layers[0])
    hidden, calls = [], []
    for batch in batches:
        h, kw = record_block_inputs(model, batch, last)
        hidden.append(h)
        calls.append(kw)
    kept: dict[tuple[str, int], list[torch.Tensor]] = {}  # x_pre copies and branch outputs, per batch

    def release_unneeded(j: int) -> None:
        pending = [b for b in boundaries if b.end > j]
        wanted = {(kind, b.start - 1) for b in pending for kind in ("branch", "inner")} | \
            {("residual", b.start) for b in pending}
        for key in [key for key in kept if key not in wanted]:
            del kept[key]

    for j in track(range(last + 1), "calibrate (block by block)", unit="blocks", quiet=quiet):
        for k, b in enumerate(boundaries):
            if b.end == j:
                for n, batch in enumerate(batches):
                    branch, inner_rows = (kept[(kind, b.start - 1)][n] if (kind, b.start - 1) in kept else None
                                          for kind in ("branch", "inner"))
                    consume(k, batch, kept[("residual", b.start)][n], hidden[n], branch, inner_rows)
        release_unneeded(j)
        if any(b.start == j for b in boundaries):
            kept[("residual", j)] = list(hidden)  # no copy: block j's outputs replace, never modify, these
        if j == last:
            break
        outputs: list[torch.Tensor] = []
        inputs: list[torch.Tensor] = []  # block j's down_proj inputs (B, T, I) per batch, on the CPU
        with on_compute_device(layers[j], device, model) as block, torch.no_grad():
            handles = []  # on the block that runs (a copy on the compute device, or the shared one)
            if j in branch_blocks:
                handles.append(branch_module(block, architecture_of(model.config)).register_forward_hook(_recorder(outputs, _output)))
            if j in inner_blocks:
                handles.append(down_projection(model, block).register_forward_pre_hook(_recorder(inputs, _input)))
            try:
                for n in range(len(batches)):
                    kwargs = dict(_to(calls[n][j], device))
                    args = kwargs.pop("__args__", ())
                    out = block(hidden[n].to(device), *args, **kwargs)
                    hidden[n] = (out[0] if isinstance(out, tuple) else out).detach().cpu()
            finally:
                for handle in handles:
                    handle.remove()
        if j in branch_blocks:
            kept[("branch", j)] = outputs
        if j in inner_blocks:
            kept[("inner", j)] = inputs


def _output(_args, out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _input(args) -> torch.Tensor:
    return args[0]


def _recorder(tensors: list[torch.Tensor], pick):
    """A forward (or pre-forward) hook appending `pick(...)` to `tensors` on the CPU, only in the thread that
    registered it."""
    owner = threading.get_ident()

    def hook(_module, *seen):
        if threading.get_ident() == owner:
            tensors.append(pick(*seen).detach().cpu())
    return hook
