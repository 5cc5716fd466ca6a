"""Which blocks to remove: criteria registered by name, each returning a `PruningPlan`.

Similarity-based criteria share one streamed pass (`measure_similarity`) over calibration
tokens that keeps only the last n+1 residual streams of a batch at a time. Cosines are taken
per token over the hidden dimension, as the papers define them. The reference repositories
take torch's default `dim=1` on a [B, T, C] tensor instead, i.e. over the token axis, and
never consider a run starting at block 0 or ending at the last block; `cosine="token-axis"`
reproduces that variant, and its plans are labelled as such.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ghosted_core.calibration.collect import CalibrationBatch
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.plan import PruningPlan, check_block_number
from ghosted_core.registry import add, check_signature, lookup

log = logging.getLogger(__name__)

COSINE_AXES = ("hidden", "token-axis")  # "hidden": the papers' per-token cosine; "token-axis": the reference repos'


@dataclass(frozen=True)
class SimilarityStats:
    """Mean cosine similarities between residual streams h_j (h_0 = embeddings, h_L = final-norm input)."""

    num_layers: int
    n: int  # run length the run-level scores were measured for
    cosine: str  # "hidden" or "token-axis"
    run_cosine: tuple[float, ...]  # s = 0..L−n: mean cos(h_s, h_s+n)
    block_cosine: tuple[float, ...]  # i = 0..L−1: mean cos(h_i, h_i+1)
    run_angular: tuple[float, ...]  # s = 0..L−n: mean over sequences of arccos(cos(h_s, h_s+n) at the last token) / π
    tokens: int


@dataclass(frozen=True)
class SelectionRequest:
    """What the user asked for."""

    num_layers: int
    n: int  # blocks to remove
    layers: tuple[int, ...] = ()  # for the manual criterion
    cosine: str = "hidden"  # or "token-axis" (reference-repo variant)


@dataclass(frozen=True)
class CriterionSpec:
    name: str
    select: Callable[[SelectionRequest, SimilarityStats | None], PruningPlan]
    needs_similarity: bool
    paper: str


CRITERIA: dict[str, CriterionSpec] = {}


def register_criterion(name: str, *, paper: str, needs_similarity: bool):
    """Add `fn(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan` to CRITERIA."""

    def decorator(fn):
        check_signature(fn, f"criterion {name}", {"request": SelectionRequest, "sim": None}, PruningPlan)
        add(CRITERIA, name, CriterionSpec(name, fn, needs_similarity, paper), "criterion")
        return fn

    return decorator


def get_criterion(name: str) -> CriterionSpec:
    return lookup(CRITERIA, name, "pruning method")


# ---------------------------------------------------------------- the similarity pass


def _cosine(a: torch.Tensor, b: torch.Tensor, axis: str) -> torch.Tensor:
    """Per-token cosine over the hidden dimension (B, T), or the repos' per-channel cosine over tokens (B, C)."""
    dim = -1 if axis == "hidden" else 1
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=dim, eps=1e-8)


class _SimilarityAccumulator:
    """Receives h_0 … h_L of one batch in order; keeps only the last n+1 of them."""

    def __init__(self, num_layers: int, n: int, axis: str):
        self.num_layers, self.n, self.axis = num_layers, n, axis
        self.run_sum = torch.zeros(num_layers - n + 1, dtype=torch.float64)
        self.block_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.angular_sum = torch.zeros(num_layers - n + 1, dtype=torch.float64)
        self.count = 0  # tokens (hidden) or channels×sequences (token-axis)
        self.sequences = 0
        self.window: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None
        self.last_index: torch.Tensor | None = None

    def start_batch(self, valid: torch.Tensor) -> None:
        self.window.clear()
        self.valid = valid
        self.last_index = valid.long().cumsum(1).argmax(1)  # last real token of each sequence
        self.count += int(valid.sum()) if self.axis == "hidden" else 0
        self.sequences += valid.shape[0]

    def _mean_sum(self, cos: torch.Tensor) -> float:
        if self.axis == "hidden":
            return float(cos[self.valid.to(cos.device)].double().sum())
        return float(cos.double().sum())

    def on_tensor(self, key: tuple[str, int], h: torch.Tensor) -> None:
        j = key[1]
        self.window[j] = h
        if j >= 1:
            self.block_sum[j - 1] += self._mean_sum(_cosine(self.window[j - 1], h, self.axis))
        if j >= self.n:
            earlier = self.window[j - self.n]
            self.run_sum[j - self.n] += self._mean_sum(_cosine(earlier, h, self.axis))
            rows = torch.arange(h.shape[0], device=h.device)
            last = self.last_index.to(h.device)
            cos_last = _cosine(earlier[rows, last], h[rows, last], "hidden").clamp(-1, 1)  # (B,)
            self.angular_sum[j - self.n] += float((torch.arccos(cos_last) / math.pi).double().sum())
        if self.axis == "token-axis" and j == 0:
            self.count += h.shape[0] * h.shape[-1]
        self.window.pop(j - self.n, None)

    def freeze(self) -> SimilarityStats:
        count = max(self.count, 1)
        return SimilarityStats(
            num_layers=self.num_layers, n=self.n, cosine=self.axis,
            run_cosine=tuple((self.run_sum / count).tolist()),
            block_cosine=tuple((self.block_sum / count).tolist()),
            run_angular=tuple((self.angular_sum / max(self.sequences, 1)).tolist()),
            tokens=self.count if self.axis == "hidden" else self.sequences,
        )


def measure_similarity(model: PreTrainedModel, n: int, batches: Sequence[CalibrationBatch], cosine: str = "hidden",
                       quiet: bool = False) -> SimilarityStats:
    """Cosine statistics of the dense model's residual streams on calibration batches (held-out ones skipped)."""
    return measure_similarity_depths(model, [n], batches, cosine, quiet)[max(n, 1)]


def measure_similarity_depths(model: PreTrainedModel, depths: Sequence[int], batches: Sequence[CalibrationBatch],
                              cosine: str = "hidden", quiet: bool = False) -> dict[int, SimilarityStats]:
    """`measure_similarity` for several run lengths from ONE pass (a depth sweep scores the blocks once).

    Each depth keeps its own accumulator, fed the same residual streams, so its statistics
    are exactly those of a single-depth pass. Memory: the last max(depths)+1 residual
    streams of a batch (B × T × C each, references to the captured tensors).
    """
    if cosine not in COSINE_AXES:
        raise GhostedError(f"unknown cosine axis {cosine!r}; use {' or '.join(COSINE_AXES)}")
    num_layers = len(decoder_blocks(model))
    accs = {n: _SimilarityAccumulator(num_layers, n, cosine) for n in sorted({max(d, 1) for d in depths})}

    def on_tensor(key: tuple[str, int], h: torch.Tensor) -> None:
        for acc in accs.values():
            acc.on_tensor(key, h)

    for batch in tqdm([b for b in batches if not b.heldout], desc="score blocks", disable=quiet, leave=False):
        valid = batch.attention_mask.bool() if batch.attention_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
        for acc in accs.values():
            acc.start_batch(valid)
        with capture(model, range(num_layers + 1), on_tensor=on_tensor):
            run_forward(model, batch.input_ids, batch.attention_mask)
    return {n: acc.freeze() for n, acc in accs.items()}


# ---------------------------------------------------------------- criteria


def _run_starts(request: SelectionRequest) -> range:
    """Candidate run starts; the reference repos never start at block 0 nor end at the last block."""
    if request.cosine == "token-axis":
        return range(1, request.num_layers - request.n)
    return range(0, request.num_layers - request.n + 1)


def _label(base: str, request: SelectionRequest) -> str:
    return base + (" [reference-repo variant: cosine over the token axis]" if request.cosine == "token-axis" else "")


def _best_run(request: SelectionRequest, scores: Sequence[float], highest: bool) -> int:
    starts = list(_run_starts(request))
    if not starts:
        raise GhostedError(f"no run of {request.n} blocks fits the reference-repo range 1..{request.num_layers - 2}")
    return (max if highest else min)(starts, key=lambda s: scores[s])


@register_criterion("streamline", paper="LLM-Streamline", needs_similarity=True)
def select_streamline(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan:
    """The contiguous run whose input and output streams are most similar."""
    start = _best_run(request, sim.run_cosine, highest=True)
    return PruningPlan(request.num_layers, tuple(range(start, start + request.n)), "streamline", sim.run_cosine,
                       _label(f"mean cos(h_s, h_s+{request.n}) over tokens, per run start s", request))


@register_criterion("shortgpt", paper="ShortGPT", needs_similarity=True)
def select_shortgpt(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan:
    """The n blocks with the lowest Block Influence BI_i = 1 − mean cos(h_i, h_i+1)."""
    influence = tuple(1.0 - c for c in sim.block_cosine)
    order = sorted(range(request.num_layers), key=lambda i: influence[i])
    return PruningPlan(request.num_layers, tuple(order[: request.n]), "shortgpt", influence,
                       _label("Block Influence 1 − mean cos(h_i, h_i+1), per block", request))


@register_criterion("angular", paper="PruneMe / Unreasonable Ineffectiveness of the Deeper Layers", needs_similarity=True)
def select_angular(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan:
    """The run with the smallest angular distance arccos(cos)/π between its input and output at the last token."""
    start = _best_run(request, sim.run_angular, highest=False)
    return PruningPlan(request.num_layers, tuple(range(start, start + request.n)), "angular", sim.run_angular,
                       f"angular distance arccos(cos(h_s, h_s+{request.n}))/π at the last token, per run start s")


@register_criterion("manual", paper="user's choice", needs_similarity=False)
def select_manual(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan:
    """Exactly the blocks the user listed."""
    if not request.layers:
        raise GhostedError("the manual pruning method needs the blocks to remove, e.g. --layers 20,21,22")
    return PruningPlan(request.num_layers, request.layers, "manual")


@register_criterion("none", paper="dense model", needs_similarity=False)
def select_none(request: SelectionRequest, sim: SimilarityStats | None) -> PruningPlan:
    """Remove nothing (evaluate the dense model only)."""
    return PruningPlan(request.num_layers, (), "none")


def parse_layers(text: str) -> tuple[int, ...]:
    """'20,21,25-27' → (20, 21, 25, 26, 27)."""
    layers: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            first, last = int(low), check_block_number(int(high or low), text)
            if last < first:
                raise GhostedError(f"reversed block range {part!r} in {text!r}; write it low-high, e.g. {last}-{first}")
            layers.extend(range(first, last + 1))
    except ValueError:
        raise GhostedError(f"cannot read block list {text!r}; write e.g. 20,21,25-27") from None
    return tuple(layers)


def check_request(criterion: str, request: SelectionRequest) -> None:
    """Refuse depths that leave nothing, before any work is done."""
    spec = get_criterion(criterion)
    if request.cosine not in COSINE_AXES:
        raise GhostedError(f"unknown cosine axis {request.cosine!r}; use {' or '.join(COSINE_AXES)}")
    if spec.needs_similarity:
        if request.n >= request.num_layers:
            raise GhostedError(f"removing {request.n} of {request.num_layers} blocks leaves none; "
                               f"use --total_num_prune at most {request.num_layers - 1}")
        if request.n < 1:
            raise GhostedError(f"--total_num_prune must be at least 1 for {criterion} (got {request.n})")
    if criterion == "manual":
        PruningPlan(request.num_layers, request.layers, "manual")  # validates the range


def select_blocks(model: PreTrainedModel, criterion: str, request: SelectionRequest,
                  batches: Sequence[CalibrationBatch], quiet: bool = False) -> tuple[PruningPlan, SimilarityStats | None]:
    """Score the blocks (if the criterion needs it) and return the plan."""
    return select_blocks_depths(model, criterion, [request], batches, quiet)[0]


def select_blocks_depths(model: PreTrainedModel, criterion: str, requests: Sequence[SelectionRequest],
                         batches: Sequence[CalibrationBatch],
                         quiet: bool = False) -> list[tuple[PruningPlan, SimilarityStats | None]]:
    """`select_blocks` for several requests (depths) with one scoring pass; plans in request order."""
    for request in requests:
        check_request(criterion, request)
    spec = get_criterion(criterion)
    sims: dict[int, SimilarityStats] = {}
    if spec.needs_similarity and requests:
        cosines = {r.cosine for r in requests}
        if len(cosines) > 1:
            raise GhostedError("all depths of a sweep must use the same cosine axis")
        sims = measure_similarity_depths(model, [r.n for r in requests], batches, cosines.pop(), quiet)
    chosen = []
    for request in requests:
        sim = sims.get(max(request.n, 1)) if spec.needs_similarity else None
        plan = spec.select(request, sim)
        log.info("%s removes blocks %s", criterion, list(plan.removed))
        chosen.append((plan, sim))
    return chosen
