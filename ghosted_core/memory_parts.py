"""The byte formulas the memory plan adds up, each from the config and the run's counts.

One function per thing the code allocates: the weights (parameters from the config's shapes),
one forward batch's transients, the LM head's logits chunk, what each operator's fit works in
and what its variant keeps (`OperatorCost`, declared by each operator in its registry entry),
the `blocks` pipeline's recorded masks, a sweep's kept dense states, the host allocator's residue (the BLAS
library's kept buffers), and the run's sizes.
`memory.plan_memory` places them phase by phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from ghosted_core.architectures import architecture_of
from ghosted_core.config_values import kv_stores, mlp_width, per_layer_width, widest
from ghosted_core.statistics import STATS_ITEM

GIB = 2**30
LOGITS_BUDGET = 2**28  # bytes of logits (the head's output and its fp32 copy) materialized at once, per perplexity chunk
KEPT = ("none", "scale", "rotated", "matrix", "branch", "refit")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _tied(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def attention_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head width), each the largest over the blocks (Gemma 4's full-attention
    blocks have wider heads than its sliding ones): what bounds one block's attention."""
    heads = widest(config, "num_attention_heads")
    return heads, widest(config, "num_key_value_heads") or heads, \
        widest(config, "head_dim") or config.hidden_size // heads


def estimate_parameters(config: PretrainedConfig) -> int:
    """Parameter count of a decoder-only LM from its config (to refuse what cannot fit before loading): the model
    transformers builds from it, counted on the meta device (experts, mixers and per-layer sizes included); the
    dense formula where that config builds no model. A multimodal checkpoint's text config adds what loads beside
    its decoder (`model.wrapper.planning_config`)."""
    beside = getattr(config, "wrapper_parameters", 0) or 0  # a multimodal checkpoint's vision tower, projector, …
    counted = skeleton_counts(config)
    if counted is not None:
        return counted.total + beside
    c = config.hidden_size
    layers = config.num_hidden_layers
    return int(layers * block_parameters(config) + config.vocab_size * c * (1 if _tied(config) else 2) + c + beside)


def block_parameters(config: PretrainedConfig) -> int:
    """Parameters of the largest decoder block (attention or a mixer, a gated MLP or experts, the norms): what one
    block on a device holds; the dense formula where the config builds no model."""
    counted = skeleton_counts(config)
    if counted is not None:
        return counted.block
    c = config.hidden_size
    heads, kv_heads, head_dim = attention_shape(config)
    attention = c * head_dim * (2 * heads + 2 * kv_heads)
    return attention + 3 * c * mlp_width(config) + 2 * c


@dataclass(frozen=True)
class SkeletonCounts:
    """What the model transformers builds from a config holds, counted on the meta device."""

    total: int  # parameters (a tied head once)
    block: int  # the largest block's parameters
    mlp: int  # the largest MLP module's parameters (the family's `Architecture.mlp`; a block of experts whole)
    linear_widths: int  # the largest block's Σ (in + out) over its plain nn.Linear modules (what rank-r changes add per r)


def skeleton_counts(config: PretrainedConfig) -> SkeletonCounts | None:
    """`SkeletonCounts` of `config` (cached per config), None where no causal-LM class builds it."""
    try:
        key = (type(config).__name__, config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None
    if key not in _COUNTS:
        _COUNTS[key] = _count_on_meta(config)
    return _COUNTS[key]


_COUNTS: dict[tuple[str, str], SkeletonCounts | None] = {}


def _count_on_meta(config: PretrainedConfig) -> SkeletonCounts | None:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  a config no causal-LM class builds: the caller's formula answers
        return None
    blocks = list(getattr(getattr(model, "model", None), "layers", None) or ())
    mlp = architecture_of(config).mlp

    def size(module) -> int:
        return sum(p.numel() for p in module.parameters())

    def widths(block) -> int:
        return sum(m.in_features + m.out_features for m in block.modules() if plain_linear(m))

    mlps = [size(b.get_submodule(mlp)) for b in blocks if mlp and _has(b, mlp)]
    return SkeletonCounts(size(model), max(map(size, blocks), default=0), max(mlps, default=0),
                          max(map(widths, blocks), default=0))


def plain_linear(module) -> bool:
    """An nn.Linear that computes only x Wᵀ + b (what a rank-r change wraps and the LoRA count adds up): not a
    subclass with its own forward (Llama-4's router subclasses nn.Linear and returns scores and logits)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def block_run_bytes(config: PretrainedConfig, tokens: int, seqlen: int, item: int) -> int:
    """One decoder block on `tokens` at its peak: the MLP's gate, up and product (3·I per token) or attention's q, k,
    v, their rotated copies and its output, whichever is larger, the normalized input and the block's output (2·C
    per token); the (B, H, T, T) scores only where attention is eager (SDPA does not materialize them). Measured at
    C = 1024, I = 2816 on 2,560 tokens: 107.5 MiB against 102.5 planned here."""
    heads, kv_heads, head_dim = attention_shape(config)
    mlp = 3 * mlp_width(config)
    attention = 2 * (heads + 2 * kv_heads) * head_dim + heads * head_dim
    scores = seqlen * heads if getattr(config, "_attn_implementation", None) == "eager" else 0
    return tokens * item * (max(mlp, attention) + 2 * config.hidden_size + scores)


def forward_bytes(config: PretrainedConfig, tokens: int, seqlen: int, item: int) -> int:
    """A forward's transient tensors for `tokens` (= sequences × seqlen) at their peak: the residual stream entering
    a block and that block's run (`block_run_bytes`); one block's transients are freed before the next runs; and
    where blocks read per-layer embeddings, those inputs (`per_layer_input_bytes`)."""
    return (tokens * config.hidden_size * item + block_run_bytes(config, tokens, seqlen, item)
            + per_layer_input_bytes(config, tokens, item))


def per_layer_input_bytes(config: PretrainedConfig, tokens: int, item: int) -> int:
    """Gemma 4 E2B/E4B's per-layer inputs for `tokens`, L·P per token: the table's rows, the projection of the
    embeddings and their sum (held through the blocks, the first two only while it is made); 0 for other families."""
    return 3 * tokens * config.num_hidden_layers * per_layer_width(config) * item


def shared_kv_bytes(config: PretrainedConfig, tokens: int, item: int) -> int:
    """The keys and values Gemma 4 E2B/E4B's storing blocks keep for later blocks over `tokens` (each store's, at
    the widest heads: a bound); 0 for other families. A stream cached for later blocks carries them too."""
    _heads, kv, head_dim = attention_shape(config)
    return len(kv_stores(config)) * 2 * kv * head_dim * tokens * item


def activation_bytes(config: PretrainedConfig, tokens: int, seqlen: int, dtype: torch.dtype, residuals: int,
                     branches: int, inners: int = 0) -> int:
    """One calibration batch: the forward's transients and what the capture and the accumulators hold
    (grows with tokens·C, tokens·I for the down_proj refit's `inners`, and tokens·seqlen·heads)."""
    c, item, i = config.hidden_size, dtype_bytes(dtype), mlp_width(config)
    captured = (residuals + branches) * tokens * c * item  # (B, T, C) per captured index
    captured += inners * tokens * i * item  # (B, T, I) per captured down_proj input
    working = 3 * tokens * c * STATS_ITEM  # x_pre, Δ, m as float64 (T, C) in the accumulator
    working += tokens * i * STATS_ITEM if inners else 0  # a as float64 (T, I)
    return forward_bytes(config, tokens, seqlen, item) + captured + working


def logits_bytes(config: PretrainedConfig, batch: int, seqlen: int) -> int:
    """Float32 logits of one perplexity chunk, and cross-entropy's copy of them."""
    full = 4 * config.vocab_size * batch * max(seqlen - 1, 1)
    return 2 * min(full, max(LOGITS_BUDGET, 4 * config.vocab_size * batch))


def evaluation_bytes(config: PretrainedConfig, batch: int, seqlen: int, dtype: torch.dtype) -> int:
    """One perplexity batch besides its logits: the forward's transients, the shared prefix's output and a
    suffix's output (B, T, C) each."""
    item = dtype_bytes(dtype)
    return forward_bytes(config, batch * seqlen, seqlen, item) + 2 * batch * seqlen * config.hidden_size * item


def speed_bytes(config: PretrainedConfig, tokens: int, dtype: torch.dtype) -> int:
    """The size-and-speed stage (`export.gain`) on one model at batch 1: the prompt's forward (`forward_bytes` over
    `tokens`, the prompt and the new tokens), the KV cache of every block (keys and values, `tokens` each) and two
    float32 rows of logits (the last position's, and `generate`'s processed scores). Sizes are counted on the meta
    device and cost nothing. Grows with tokens·(C + I) and layers·tokens·KV width, not with the variants (timed
    one at a time)."""
    item = dtype_bytes(dtype)
    _, kv_heads, head_dim = attention_shape(config)
    cache = 2 * config.num_hidden_layers * kv_heads * head_dim * tokens * item
    return forward_bytes(config, tokens, tokens, item) + cache + 2 * 4 * config.vocab_size


def drift_bytes(config: PretrainedConfig, seqlen: int, dtype: torch.dtype) -> int:
    """Per-block drift on one window: every captured residual of the dense model and of one variant, and
    the float64 copies of one index."""
    c = config.hidden_size
    return 2 * (config.num_hidden_layers + 1) * seqlen * c * dtype_bytes(dtype) + 3 * seqlen * c * STATS_ITEM


def mask_bytes(config: PretrainedConfig, sequences: int, batch_size: int, seqlen: int, item: int) -> int:
    """The `blocks` pipeline's recorded attention masks on the host, for every calibration batch.

    Under SDPA the full causal mask is not materialized; a sliding-window one (Gemma-3's sliding
    layers, Mistral) is, (B, 1, T, T) bool broadcast over the batch, kept broadcast on the host:
    T² bytes per batch. Eager attention materializes float masks of the model's dtype for every
    kind. Memory grows with batches × T².
    """
    eager = getattr(config, "_attn_implementation", None) == "eager"
    types = set(getattr(config, "layer_types", None) or ())
    sliding = "sliding_attention" in types or (config.model_type == "mistral" and getattr(config, "sliding_window", None))
    kinds = int(bool(sliding)) + int(eager)
    batches = math.ceil(max(sequences, 1) / max(batch_size, 1))
    return batches * kinds * seqlen * seqlen * (item if eager else 1)


RESIDUE_FP32_BUFFER = 6 * 2**20  # the largest fp32 packing buffer one thread asks for (5.3 MiB measured)
RESIDUE_FP64_BUFFER = 12 * 2**20  # the largest float64 one, per product width (10.8 MiB measured)
RESIDUE_BUFFERS = 2  # buffers kept per kind of product and thread: the one in use and one it outgrew


def allocator_residue_bytes(config: PretrainedConfig, threads: int, inner: int = 0, forward: bool = True,
                            products: bool = True) -> int:
    """The host allocator's residue once the calibration pass has begun: the buffers the BLAS library keeps.

    Intel MKL (torch's CPU BLAS on x86) packs a matrix product's panels into buffers from its own allocator and
    keeps them, per thread, for the rest of the process; a product that needs a larger buffer than any it
    keeps gets a new one, and the smaller stays (`mkl_serv_mem_stat` counts them; after
    `mkl_serv_free_buffers` the process keeps nothing after the calibration pass beyond what we hold). One
    buffer per thread grows with its product's width up to a cap, bounded here, from single products at
    C = 256 to 4096 (I = 2.75·C) on 1 to 8 threads, by min(6 MiB, 2 KiB·max(I, V)) for the forward's fp32
    products (`forward`: the MLP's I or the LM head's vocabulary is their widest output; 0.7 to 5.3 MiB
    measured) and min(12 MiB, 1.25 MiB + 2.5 KiB·n) for the float64 products over each width n (`products`:
    the statistics and the fits over C, and over I for the down_proj refit, `inner`; 1.0 to 10.8 MiB).
    Planned: `RESIDUE_BUFFERS` of each kind per thread, × `threads`. A run's stages on 2 threads kept
    (planned; bench/blas_residue.py, bench/memory_plan.py): C = 1024, I = 2816: 24.5 MiB with ghost_capped,
    replaceme_keepsink and rotate (39.0), 32.0 with magcomp_refit (71.5); C = 2048, I = 5632: 33.7 with
    ghost_capped (49.0), 27.6 with magcomp_refit (97.0); C = 4096, I = 14336: 36.1 with the three (69.0),
    39.9 with magcomp_refit (117.0), 49.4 once a warm-up's products came first; the residue read from the
    resident size at that width was 44 to 78 MiB (docs/scale.md).
    """
    if threads <= 0:
        return 0
    outputs = max(mlp_width(config), int(config.vocab_size))  # the widest fp32 outputs
    fp32 = min(RESIDUE_FP32_BUFFER, 2048 * outputs) if forward else 0
    fp64 = sum(min(RESIDUE_FP64_BUFFER, 5 * 2**18 + 2560 * n) for n in (config.hidden_size, inner) if n) \
        if products else 0
    return threads * RESIDUE_BUFFERS * (fp32 + fp64)


def kept_states_bytes(width: int, item: int, eval_tokens: int, indices: int, cap: int) -> int:
    """A sweep's kept dense evaluation states: tokens × C × dtype bytes per kept index, or none over `cap`."""
    needed = eval_tokens * width * item * indices
    return needed if needed <= cap else 0


@dataclass(frozen=True)
class OperatorCost:
    """What an operator's fit works in and what its variant keeps, per boundary.

    `fit_matrices`: C×C float64 matrices alive at its fit's peak beside the statistics (assembled
    normal equations, the eigenvalues' workspace, the regularized copy, the solution, the error
    and singular-value products). `candidates`: one C×C float64 fit and its float32 map per
    sink-direction count until the held-out pass chooses (replaceme_keepsink). `kept`: what stays
    once fitted: "none"; "scale" (a (C,) map and module); "rotated" (a (C,) map, a dense fp32 C×C
    module: H diag(r) Hᵀ); "matrix" (an fp32 C×C map and module); "branch" (an fp32 C×C map, and
    the folded down_proj copy, C × intermediate in the model's dtype, or an fp32 C×C module where a
    norm follows the MLP); "refit" (the down_proj change B, an fp32 I×C map, and the folded down_proj
    copy). `refit`: the fit solves the down_proj refit (`refit_solve_bytes`: two I×I and three I×C float64
    matrices, and every (λ, sink count) candidate's fp32 I×C update until the held-out pass chooses).
    """

    fit_matrices: int = 0
    kept: str = "none"
    candidates: bool = False
    refit: bool = False

    def __post_init__(self) -> None:
        if self.kept not in KEPT:
            raise ValueError(f"kept must be one of {KEPT}, not {self.kept!r}")


def _folds(config: PretrainedConfig) -> bool:
    return architecture_of(config).branch_folds_into_down_proj


def inner_width(config: PretrainedConfig, needs) -> int:
    """I, when the down_proj refit's statistics are collected for this family (0 otherwise: none asked, or a
    norm after the MLP, where a change of down_proj is no change of the stream)."""
    return mlp_width(config) if needs.inner and _folds(config) else 0


def refit_solve_bytes(inner: int, width: int) -> int:
    """The down_proj refit's solve beside the statistics (`recovery.refit.refit_solutions`): its own working
    normal equations and their Cholesky factor (two I×I float64, solved from in place: `linalg.factor_solve`),
    and five I×C float64 at most: the projected right-hand side, a scaled target's cross moment, the triangular
    solves' intermediate and working copy, one solution (its float32 copy is the candidate's). Measured at
    I = 2500, C = 256 with 8 sink rows: refit 136 MiB, magcomp_refit 151 MiB, against 144 MiB planned with
    the candidates (a few MiB of LAPACK workspace are not counted)."""
    return (2 * inner * inner + 5 * inner * width) * STATS_ITEM


def _refit_bytes(cost: OperatorCost, config: PretrainedConfig, inner: int, refit_candidates: int) -> tuple[int, int]:
    """(the refit's solve, its candidates' fp32 I×C updates) in bytes."""
    if not (cost.refit and inner):
        return 0, 0
    c = config.hidden_size
    return refit_solve_bytes(inner, c), refit_candidates * inner * c * 4


def fit_bytes(cost: OperatorCost, config: PretrainedConfig, candidates: int, inner: int = 0,
              refit_candidates: int = 0) -> int:
    """One fit's working memory at its peak: its C×C float64 matrices (with every candidate solved so far),
    a refit's I×I solve and candidates, or, for a fold, the chosen update A (and one C×C the fit leaves), the
    float64 down_proj and its product W_down + Aᵀ W_down (`recovery.modules.branch_replacement`), whichever
    is larger. Measured in tests/test_memory_declarations.py for every operator, fit and fold."""
    c = config.hidden_size
    solving = (cost.fit_matrices + (candidates if cost.candidates else 0)) * c * c * STATS_ITEM
    solving += sum(_refit_bytes(cost, config, inner, refit_candidates))
    folding = 2 * c * c * STATS_ITEM + 2 * c * mlp_width(config) * STATS_ITEM \
        if cost.kept == "branch" and _folds(config) else 0
    return max(solving, folding)


def choice_bytes(cost: OperatorCost, config: PretrainedConfig, candidates: int, inner: int = 0,
                 refit_candidates: int = 0) -> int:
    """Candidates alive while the held-out pass chooses among them: a float64 fit and a float32 map each
    (a refit's: its fp32 I×C update, once as the fit and once as the map)."""
    c = config.hidden_size
    return (candidates * c * c * (STATS_ITEM + 4) if cost.candidates else 0) + \
        2 * _refit_bytes(cost, config, inner, refit_candidates)[1]


def kept_bytes(cost: OperatorCost, config: PretrainedConfig, item: int, inner: int = 0) -> tuple[int, int]:
    """(its map for the held-out pass, its module in the variant) per boundary, in bytes."""
    c = config.hidden_size
    if cost.kept == "refit":
        return (4 * inner * c, c * mlp_width(config) * item) if inner else (c * STATS_ITEM, 4 * c)
    if cost.kept == "scale":
        return c * STATS_ITEM, 4 * c
    if cost.kept == "rotated":
        return c * STATS_ITEM, 4 * c * c
    if cost.kept == "matrix":
        return 4 * c * c, 4 * c * c
    if cost.kept == "branch":
        return 4 * c * c, c * mlp_width(config) * item if _folds(config) else 4 * c * c
    return 0, 0


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


def min_calibration_sequences(width: int, seqlen: int, factor: int = 4, floor: int = 64) -> int:
    """Sequences that give a fit at least `factor`·C tokens (a well-posed C×C least squares), at least `floor`."""
    return max(floor, math.ceil(factor * width / max(seqlen, 1)))
