"""`swap_kl` and `swap_kl_repl`: the replacement and interchange probes of "No Free Swap" (arXiv 2605.16234).

For block pairs i < j with j − i ≤ `WINDOW` (the paper's |i−j| ≤ 3):

- replacement d_repl(i, j) = max(E KL(p_M ‖ p_{M, i←j}), E KL(p_M ‖ p_{M, j←i})), where slot i runs
  block j's weights (every other slot unchanged); the max is over the two directions' means;
- interchange d_inter(i, j) = E KL(p_M ‖ p_{M, i↔j}), slots i and j exchanging weights.

"Weights" means every parameter of the block, norms included, while the slot keeps its own
attention kind, window and positions (Gemma-3: a sliding layer's weights run as global
attention in a full slot): `with_weights_of` makes such a view without copying a tensor. E is
token-weighted over every calibration position (the paper's 8B scripts average per prompt; the
GPT-2 script takes the last position only).

Removal guided by each (the paper's Table 14): a layer's score is its smallest distance to a
partner in the window, layers are taken in ascending score (ties to the lower index), skipping
any within `SPACING` of one already taken (no adjacent removals), until n are taken. One shot,
no rescoring. Both probes come from the same passes, computed once when both criteria run.

Cost per calibration window: one dense pass keeping L+1 states, then 3·P(w) variants, each from
its first changed slot (P(w) = Σ_{g≤w} (L−g) pairs: 84 for 30 blocks, 48 for 18), batched slot by
slot, one head each; naively 1 + 3·P(w) full passes. Memory: the states of the variants run
together (under `suffixes.STATE_BUDGET`) and one chunk of logits.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ghosted_core.errors import GhostedError
from ghosted_core.model.surgery import shallow_view
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes
from ghosted_core.selection.kl import dense_states_bytes, mean_kl
from ghosted_core.selection.suffixes import CandidateRunner

WINDOW = 3  # pairs with j − i ≤ WINDOW (Qwen3-8B and Pythia in the paper)
SPACING = 1  # no two removed blocks within SPACING of each other (Table 14's Δ = 1: no adjacent removals)
COST = ("one dense pass per window, then 3 variants per pair within |i−j| ≤ 3 from their first changed slot (SmolLM2: "
        "252, Gemma-3: 144), one head each; naive: 1 + 3·pairs full passes; memory: L+1 residual states per batch")


def with_weights_of(slot: nn.Module, source: nn.Module) -> nn.Module:
    """A view of `slot` (its attention kind, window and index) that computes with `source`'s parameters and
    persistent buffers (what a checkpoint holds for the block: Gemma 4's per-block output scalar among them)."""
    children = {name: with_weights_of(child, source.get_submodule(name)) for name, child in slot.named_children()}
    view = shallow_view(slot, **children)
    for name in list(view._parameters):
        view._parameters[name] = source._parameters[name]
    for name in list(view._buffers):
        if name not in view._non_persistent_buffers_set:
            view._buffers[name] = source._buffers[name]
    return view


def exchangeable(a: nn.Module, b: nn.Module) -> bool:
    """Whether blocks a and b have the same modules and tensors (names, classes, shapes), so that either can run in
    the other's slot. Not so for blocks of other kinds in heterogeneous models: attention and linear-attention,
    convolution or Mamba mixers (hybrids), experts and a dense MLP (mlp_only_layers), Gemma 4's wider
    full-attention heads or its KV-sharing blocks (no key and value projections, a double-wide MLP), Llama-4's
    RoPE blocks (a weightless query-key norm the others lack)."""
    def layout(block: nn.Module) -> tuple[dict, dict]:
        return ({name: type(m) for name, m in block.named_modules()},
                {name: tuple(t.shape) for name, t in block.state_dict(keep_vars=True).items()})
    return layout(a) == layout(b)


def pairs(num_layers: int, window: int = WINDOW, blocks: Sequence[nn.Module] | None = None) -> list[tuple[int, int]]:
    """Block pairs i < j with j − i ≤ `window`, and, given the blocks, only the exchangeable ones (`exchangeable`)."""
    found = [(i, j) for i in range(num_layers) for j in range(i + 1, min(i + window, num_layers - 1) + 1)]
    return found if blocks is None else [(i, j) for i, j in found if exchangeable(blocks[i], blocks[j])]


def variant_steps(num_layers: int, window: int = WINDOW,
                  chosen: Sequence[tuple[int, int]] | None = None) -> list[tuple[str, tuple[int, int], int, tuple]]:
    """The probes' variants as (kind, pair, entry slot, steps), a step being (slot, the block whose weights run
    there): i←j runs j's weights at slot i, j←i i's at slot j, i↔j both; dense blocks after the first change.
    `chosen`: the pairs (all within the window when None)."""
    def dense(start: int, stop: int = num_layers) -> tuple:
        return tuple((k, k) for k in range(start, stop))

    variants = []
    for i, j in pairs(num_layers, window) if chosen is None else chosen:
        variants.append(("i<-j", (i, j), i, ((i, j),) + dense(i + 1)))
        variants.append(("j<-i", (i, j), j, ((j, i),) + dense(j + 1)))
        variants.append(("i<->j", (i, j), i, ((i, j),) + dense(i + 1, j) + ((j, i),) + dense(j + 1)))
    return variants


def tallest_group(num_layers: int, window: int = WINDOW) -> int:
    """The most variants that run one module at one slot together (`CandidateRunner.run` concatenates them): the
    dense block at the slot most variants leave unchanged."""
    counts: dict[tuple[int, int], int] = {}
    for _kind, _pair, _entry, steps in variant_steps(num_layers, window):
        for step in steps:
            counts[step] = counts.get(step, 0) + 1
    return max(counts.values(), default=0)


def swap_distances(scoring: Scoring, window: int = WINDOW) -> dict[str, dict[tuple[int, int], float]]:
    """{"replacement": d_repl, "interchange": d_inter} over the pairs within the window (mean KL per position)."""
    runner = CandidateRunner(scoring.model, scoring.work)
    blocks = runner.blocks
    num_layers = len(blocks)
    chosen = pairs(num_layers, window, blocks)
    if not chosen:
        raise GhostedError(f"no two blocks within {window} of each other hold the same tensors, so no block can run in "
                           "another's slot (the swap probes' measurement); use another criterion")
    views = {(a, b): with_weights_of(blocks[a], blocks[b]) for i, j in chosen for a, b in ((i, j), (j, i))}
    variants = variant_steps(num_layers, window, chosen)

    def modules(steps: tuple) -> tuple:
        return tuple((slot, blocks[slot] if source == slot else views[slot, source]) for slot, source in steps)

    found = mean_kl(scoring, runner, [(entry, modules(steps)) for _kind, _pair, entry, steps in variants],
                    "score swap_kl (both probes)", "variants")
    mean = {(kind, pair): value for (kind, pair, _e, _s), value in zip(variants, found)}
    return {"replacement": {p: max(mean["i<-j", p], mean["j<-i", p]) for p in chosen},
            "interchange": {p: mean["i<->j", p] for p in chosen},
            "directions": {p: (mean["i<-j", p], mean["j<-i", p]) for p in chosen}}


def layer_scores(distances: dict[tuple[int, int], float], num_layers: int) -> list[float]:
    """s(i) = min over partners j in the window of d(i, j) (both members of a pair get its value); infinite for a
    block with no exchangeable partner in the window (taken last)."""
    scores = [float("inf")] * num_layers
    for (i, j), d in distances.items():
        scores[i], scores[j] = min(scores[i], d), min(scores[j], d)
    return scores


def guided_removal(scores: list[float], n: int, spacing: int = SPACING, keep: Sequence[int] = ()) -> tuple[int, ...]:
    """Table 14: ascending scores (ties to the lower index), skipping layers within `spacing` of a chosen one (and
    those in `keep`)."""
    chosen: list[int] = []
    for i in sorted((i for i in range(len(scores)) if i not in keep), key=lambda i: (scores[i], i)):
        if all(abs(i - k) > spacing for k in chosen):
            chosen.append(i)
            if len(chosen) == n:
                return tuple(chosen)
    raise GhostedError(f"swap-guided removal takes no two blocks within {spacing} of each other: at most "
                       f"{len(chosen)} of {len(scores)} blocks, not {n}; remove fewer blocks")


def swap_bytes(shapes: ScoreShapes) -> Footprint:
    """Both probes: `kl.dense_states_bytes` with three variants per pair as candidates, the tallest block run being
    the variants that share the dense block at one slot (the others run their own views apart)."""
    return Footprint(dense_states_bytes(shapes, 3 * len(pairs(shapes.layers)), tallest_group(shapes.layers)))


def _select(request: SelectionRequest, scoring: Scoring, probe: str, name: str) -> PruningPlan:
    if "swap" not in scoring.shared:  # both probes from one set of passes, whichever criterion asks first
        scoring.shared["swap"] = (swap_distances(scoring), name, scoring.work)
    distances, first, scoring.work = scoring.shared["swap"]  # the measurement's own cost, whoever asks
    scores = layer_scores(distances[probe], request.num_layers)
    removed = guided_removal(scores, request.n, keep=request.keep)
    unpaired = [i for i, score in enumerate(scores) if score == float("inf")]
    scoring.details[name] = {
        "probe": probe, "window": WINDOW, "spacing": SPACING, "unpaired": unpaired,
        "pairs": [[i, j] for i, j in distances[probe]],
        "replacement": list(distances["replacement"].values()), "interchange": list(distances["interchange"].values()),
        "directions": [list(v) for v in distances["directions"].values()],
    } | ({"shared_with": first} if first != name else {})
    note = f" (none: no block of the same tensors within {WINDOW}, taken last)" if unpaired else ""
    return PruningPlan(request.num_layers, removed, name, tuple(None if i in unpaired else x for i, x in enumerate(scores)),
                       f"{probe} score min_j d_{probe[:5]}(i, j) over |i−j| ≤ {WINDOW} (mean KL per token){note}, "
                       "per block")


@register_criterion("swap_kl", paper="No Free Swap (arXiv 2605.16234), interchange probe", needs="forward", cost=COST,
                    memory=swap_bytes,
                    label=f"interchange-guided, |i−j| ≤ {WINDOW}, no adjacent removals")
def select_swap_kl(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """Removal guided by the interchange distance d_inter (slots i and j exchange weights)."""
    return _select(request, scoring, "interchange", "swap_kl")


@register_criterion("swap_kl_repl", paper="No Free Swap (arXiv 2605.16234), replacement probe", needs="forward",
                    cost=COST, memory=swap_bytes,
                    label=f"replacement-guided, |i−j| ≤ {WINDOW}, no adjacent removals")
def select_swap_kl_repl(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """Removal guided by the replacement distance d_repl (one block's weights in the other's slot, worse direction)."""
    return _select(request, scoring, "replacement", "swap_kl_repl")
