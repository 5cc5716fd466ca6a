"""Which blocks to remove: the criteria registry, the simple criteria, and the entry points that score them.

A criterion is one function `(request: SelectionRequest, scoring: Scoring) -> PruningPlan`
registered with its paper, what it reads (`needs`: the similarity pass, forward passes of its
own, the weights only, or nothing), its cost in words (passes and memory) and a label shown
wherever its name appears. The similarity criteria here (streamline, shortgpt, angular) share
one streamed pass (`selection.similarity`); the others live in their own modules (sleb, kl,
swap, weights, prunecomp) and register themselves when `ghosted_core.selection` is imported.

Cosines are taken per token over the hidden dimension, as the papers define them. The
reference repositories take torch's default `dim=1` on a [B, T, C] tensor instead, i.e. over
the token axis, and never consider a run starting at block 0 or ending at the last block;
`cosine="token-axis"` reproduces that variant, and its plans are labelled as such.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from ghosted_core.calibration.collect import CalibrationBatch
from ghosted_core.errors import GhostedError
from ghosted_core.plan import PruningPlan, check_block_number
from ghosted_core.registry import add, check_signature, lookup
from ghosted_core.selection.footprint import Footprint, ScoreShapes, no_memory
from ghosted_core.selection.similarity import COSINE_AXES, SimilarityStats, similarity_bytes
from ghosted_core.selection.suffixes import Work

log = logging.getLogger(__name__)

NEEDS = ("similarity", "forward", "weights", "nothing")  # what a criterion reads besides the request


@dataclass(frozen=True)
class SelectionRequest:
    """What the user asked for."""

    num_layers: int
    n: int  # blocks to remove
    layers: tuple[int, ...] = ()  # for the manual criterion
    cosine: str = "hidden"  # or "token-axis" (reference-repo variant)
    keep: tuple[int, ...] = ()  # blocks the family requires kept (`layer_config.required_blocks`): never removed
    why_kept: tuple[tuple[int, str], ...] = ()  # (block, why it must stay) for those the family's rules name

    def removable(self, block: int) -> bool:
        return block not in self.keep

    def run_removable(self, start: int) -> bool:
        """Whether the run of n blocks from `start` removes no block that must stay."""
        return all(self.removable(j) for j in range(start, start + self.n))


@dataclass
class Scoring:
    """What a criterion may read: the dense model, the calibration batches, the shared similarity pass.

    `work` counts what the criterion runs; `shared` holds results two criteria compute once for
    both (swap_kl's probes); `details` receives JSON-ready facts per criterion name (for results.json).
    """

    model: PreTrainedModel | None = None
    batches: Sequence[CalibrationBatch] = ()
    sim: SimilarityStats | None = None
    quiet: bool = True
    work: Work = field(default_factory=Work)
    shared: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    memo_budget: int | None = None  # sleb's kept-state budget in bytes (None: its default, `sleb.MEMO_BUDGET`)

    @property
    def fit_batches(self) -> list[CalibrationBatch]:
        return [b for b in self.batches if not b.heldout]


@dataclass(frozen=True)
class CriterionSpec:
    name: str
    select: Callable[[SelectionRequest, Scoring], PruningPlan]
    needs: str  # one of NEEDS
    paper: str
    cost: str  # passes and memory, in words (the measured cost is in each run's results)
    memory: Callable[[ScoreShapes], Footprint]  # its scoring's bytes beyond the weights (the memory plan's score phase)
    label: str = ""  # how it differs from the paper's or reference's method, shown beside its name
    contiguous: bool = False  # always removes one run of blocks (one boundary)

    @property
    def needs_similarity(self) -> bool:
        return self.needs == "similarity"

    @property
    def needs_text(self) -> bool:
        """Whether it reads calibration text (similarity or forward passes of its own)."""
        return self.needs in ("similarity", "forward")

    @property
    def title(self) -> str:
        """The name with its label, as tables and legends show it."""
        return f"{self.name} ({self.label})" if self.label else self.name


CRITERIA: dict[str, CriterionSpec] = {}


def register_criterion(name: str, *, paper: str, needs: str, cost: str,
                       memory: Callable[[ScoreShapes], Footprint], label: str = "", contiguous: bool = False):
    """Add `fn(request: SelectionRequest, scoring: Scoring) -> PruningPlan` to CRITERIA.

    `memory` is required: `memory(shapes: ScoreShapes) -> Footprint`, the bytes its scoring holds beyond
    the weights (`selection.footprint`); the memory plan sums it, so an entry without one fails at import.
    """
    if needs not in NEEDS:
        raise ValueError(f"criterion {name}: needs must be one of {NEEDS}")
    check_signature(memory, f"criterion {name}'s memory", {"shapes": ScoreShapes}, Footprint)

    def decorator(fn):
        check_signature(fn, f"criterion {name}", {"request": SelectionRequest, "scoring": Scoring}, PruningPlan)
        add(CRITERIA, name, CriterionSpec(name, fn, needs, paper, cost, memory, label, contiguous),
            "criterion")
        return fn

    return decorator


def get_criterion(name: str) -> CriterionSpec:
    return lookup(CRITERIA, name, "pruning method")


def criterion_title(name: str) -> str:
    """A criterion's name with its label ("weights (ours, inspired by WRP's abstract …)"), as tables show it."""
    spec = CRITERIA.get(name)
    return spec.title if spec else name


# ---------------------------------------------------------------- the similarity criteria

SHARED_PASS = ("one forward pass over the calibration text, shared by every similarity criterion; memory: the last "
               "n+1 residual streams of a batch")



def _run_starts(request: SelectionRequest) -> list[int]:
    """Candidate run starts (none removing a block the family keeps); the reference repos never start at block 0
    nor end at the last block."""
    starts = range(1, request.num_layers - request.n) if request.cosine == "token-axis" else \
        range(0, request.num_layers - request.n + 1)
    return [s for s in starts if request.run_removable(s)]


def _label(base: str, request: SelectionRequest) -> str:
    return base + (" [reference-repo variant: cosine over the token axis]" if request.cosine == "token-axis" else "")


def _best_run(request: SelectionRequest, scores: Sequence[float], highest: bool) -> int:
    starts = list(_run_starts(request))
    if not starts:
        raise GhostedError(f"no run of {request.n} blocks fits the reference-repo range 1..{request.num_layers - 2}")
    return (max if highest else min)(starts, key=lambda s: scores[s])


@register_criterion("streamline", paper="LLM-Streamline", needs="similarity", contiguous=True, cost=SHARED_PASS,
                    memory=similarity_bytes)
def select_streamline(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The contiguous run whose input and output streams are most similar."""
    sim = scoring.sim
    start = _best_run(request, sim.run_cosine, highest=True)
    return PruningPlan(request.num_layers, tuple(range(start, start + request.n)), "streamline", sim.run_cosine,
                       _label(f"mean cos(h_s, h_s+{request.n}) over tokens, per run start s", request))


@register_criterion("shortgpt", paper="ShortGPT", needs="similarity", cost=SHARED_PASS, memory=similarity_bytes)
def select_shortgpt(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The n blocks with the lowest Block Influence BI_i = 1 − mean cos(h_i, h_i+1)."""
    sim = scoring.sim
    influence = tuple(1.0 - c for c in sim.block_cosine)
    order = sorted(filter(request.removable, range(request.num_layers)), key=lambda i: influence[i])
    return PruningPlan(request.num_layers, tuple(order[: request.n]), "shortgpt", influence,
                       _label("Block Influence 1 − mean cos(h_i, h_i+1), per block", request))


@register_criterion("angular", paper="PruneMe / Unreasonable Ineffectiveness of the Deeper Layers", needs="similarity",
                    contiguous=True, cost=SHARED_PASS, memory=similarity_bytes)
def select_angular(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The run with the smallest angular distance arccos(cos)/π between its input and output at the last token."""
    sim = scoring.sim
    start = _best_run(request, sim.run_angular, highest=False)
    return PruningPlan(request.num_layers, tuple(range(start, start + request.n)), "angular", sim.run_angular,
                       f"angular distance arccos(cos(h_s, h_s+{request.n}))/π at the last token, per run start s")


@register_criterion("manual", paper="user's choice", needs="nothing", cost="none: the blocks you list",
                    memory=no_memory)
def select_manual(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """Exactly the blocks the user listed."""
    check_blocks_listed("manual", request.layers)
    return PruningPlan(request.num_layers, request.layers, "manual")


@register_criterion("none", paper="dense model", needs="nothing", cost="none", memory=no_memory)
def select_none(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
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


def check_blocks_listed(criterion: str, layers: tuple[int, ...]) -> None:
    """The manual criterion's one check that needs no model: some blocks are listed (run before anything loads)."""
    if criterion == "manual" and not layers:
        raise GhostedError("the manual pruning method needs the blocks to remove, e.g. --layers 20,21,22")


def check_request(criterion: str, request: SelectionRequest) -> None:
    """Refuse depths that leave nothing, before any work is done."""
    spec = get_criterion(criterion)
    if request.cosine not in COSINE_AXES:
        raise GhostedError(f"unknown cosine axis {request.cosine!r}; use {' or '.join(COSINE_AXES)}")
    if spec.needs != "nothing":
        if request.n >= request.num_layers:
            raise GhostedError(f"removing {request.n} of {request.num_layers} blocks leaves none; "
                               f"use --total_num_prune at most {request.num_layers - 1}")
        if request.n < 1:
            raise GhostedError(f"--total_num_prune must be at least 1 for {criterion} (got {request.n})")
    if criterion == "manual":
        PruningPlan(request.num_layers, request.layers, "manual")  # validates the range
        if set(request.layers) & set(request.keep):
            block = sorted(set(request.layers) & set(request.keep))[0]
            why = dict(request.why_kept).get(block, "its family requires it")
            raise GhostedError(f"block {block} must stay: {why}; list other blocks")
