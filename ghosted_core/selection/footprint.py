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

from ghosted_core.memory_parts import LOGITS_BUDGET
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
        """One residual state (tokens × C) in the model's dtype; one batch's when `tokens` is None."""
        return (self.batch_tokens if tokens is None else tokens) * self.width * self.item

    def forward(self, tokens: int | None = None) -> int:
        """One forward over `tokens` (one batch's when None) at its peak: the residual stream entering a block and
        that block's run (`block_run`)."""
        tokens = self.batch_tokens if tokens is None else tokens
        return self.state(tokens) + block_run(self, tokens)


@dataclass(frozen=True)
class Footprint:
    """A criterion's scoring bytes beyond the weights, and how its budgets handle what does not fit ("" if all does)."""

    bytes: int
    note: str = ""


def block_run(shapes: ScoreShapes, tokens: int) -> int:
    """One decoder block on `tokens` at its peak (`suffixes.CandidateRunner.run_slot`): the MLP's gate, up and
    product (3·I per token) or attention's q, k, v, their rotated copies and its output, whichever is larger,
    the normalized input and the block's output (2·C per token); the T² scores where attention is eager.
    Measured at C = 1024, I = 2816 on 2,560 tokens: 107.5 MiB against 102.5 planned here, the rest of a
    criterion's peak (its kept states) being counted on top."""
    config = shapes.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or shapes.width // heads
    mlp = 3 * int(config.intermediate_size)
    attention = 2 * (heads + 2 * kv_heads) * head_dim + heads * head_dim
    scores = shapes.seqlen * heads if getattr(config, "_attn_implementation", None) == "eager" else 0
    return tokens * shapes.item * (max(mlp, attention) + 2 * shapes.width + scores)


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
