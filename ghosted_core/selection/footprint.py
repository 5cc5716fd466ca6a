"""What a criterion's scoring holds at its peak: the shapes it is given and the byte terms its declaration adds up.

Every criterion registers a `memory` function (`criteria.register_criterion(..., memory=fn)`),
`fn(shapes: ScoreShapes) -> Footprint`, as it registers its cost in words: the bytes its scoring
allocates beyond the model's weights, as a function of the model's shapes (C, I, L, vocabulary,
dtype) and the run's (calibration tokens, one batch, the depth, the number of candidates its
budgets let run together). The memory plan's "score blocks" phase is that declaration and
nothing else (`run.options.plan_request`), and `tests/test_memory_declarations.py` holds each
declaration against the measured peak of its criterion run alone.

The shared terms live here, one function each: one forward's transients (`forward`), a group of
candidate models run together from cached states (`candidate_group`), and the next-token heads'
logits chunk (`logits_chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from ghosted_core.memory_parts import LOGITS_BUDGET, block_run_bytes, forward_bytes, shared_kv_bytes
from ghosted_core.selection.suffixes import STATE_BUDGET


@dataclass(frozen=True)
class ScoreShapes:
    """The shapes a criterion's scoring allocates by."""

    config: PretrainedConfig
    item: int  # bytes per element of the model's dtype
    sequences: int  # calibration fit sequences
    seqlen: int
    batch_size: int  # calibration sequences per forward
    n: int  # blocks to remove
    with_map: bool = False  # the comparison's layer-similarity map rides on the similarity pass
    memo_budget: int | None = None  # sleb's kept-state budget (None: its default)

    @property
    def width(self) -> int:
        return int(self.config.hidden_size)

    @property
    def layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    @property
    def batch_tokens(self) -> int:
        """Tokens of one calibration forward."""
        return min(self.batch_size, max(self.sequences, 1)) * self.seqlen

    @property
    def tokens(self) -> int:
        """Tokens of the whole calibration set."""
        return self.sequences * self.seqlen

    def state(self, tokens: int | None = None) -> int:
        """One residual state (tokens × C) in the model's dtype, with the keys and values it carries for later
        blocks where a model shares them (`memory_parts.shared_kv_bytes`); one batch's when `tokens` is None."""
        tokens = self.batch_tokens if tokens is None else tokens
        return tokens * self.width * self.item + shared_kv_bytes(self.config, tokens, self.item)

    def forward(self, tokens: int | None = None) -> int:
        """One forward over `tokens` (one batch's when None) at its peak (`memory_parts.forward_bytes`)."""
        return forward_bytes(self.config, self.batch_tokens if tokens is None else tokens, self.seqlen, self.item)


@dataclass(frozen=True)
class Footprint:
    """A criterion's scoring bytes beyond the weights, and how its budgets handle what does not fit ("" if all does)."""

    bytes: int
    note: str = ""


def block_run(shapes: ScoreShapes, tokens: int) -> int:
    """One decoder block on `tokens` at its peak (`suffixes.CandidateRunner.run_slot`; `memory_parts.block_run_bytes`),
    the rest of a criterion's peak (its kept states) being counted on top."""
    return block_run_bytes(shapes.config, tokens, shapes.seqlen, shapes.item)


def group_size(shapes: ScoreShapes, candidates: int) -> int:
    """Candidates of one chunk (`suffixes.chunks`: their states together under STATE_BUDGET, one at least)."""
    return max(1, min(candidates, STATE_BUDGET // max(shapes.state(), 1)))


def candidate_group(shapes: ScoreShapes, candidates: int, tallest: int | None = None) -> int:
    """`suffixes.CandidateRunner.run` on one chunk of candidates at a slot: their states concatenated along the
    batch axis, the previous slot's outputs and this slot's (three states per candidate), and the tall block run
    of the candidates that run one module there together (`tallest` at most; every candidate of the chunk when None)."""
    together = group_size(shapes, candidates)
    tall = together if tallest is None else min(together, tallest)
    return 3 * together * shapes.state() + block_run(shapes, tall * shapes.batch_tokens)


def logits_chunk(shapes: ScoreShapes, copies: int, alive: int) -> int:
    """`alive` float32 blocks of one chunk of the head's logits, the chunk sized for `copies` blocks under
    LOGITS_BUDGET (`next_token._chunks`) and never longer than one batch."""
    per_block = min(LOGITS_BUDGET // copies, shapes.batch_tokens * shapes.vocab * 4)
    return alive * max(per_block, shapes.vocab * 4)


def no_memory(shapes: ScoreShapes) -> Footprint:
    """A criterion that reads nothing (none, manual)."""
    return Footprint(0)
