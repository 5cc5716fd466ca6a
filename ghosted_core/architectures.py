"""What a cut needs to know about a model family and cannot read off the model: one table, one entry per family.

Loading, capture, surgery, export and the model card read this table instead of knowing families themselves
(the way mergekit describes each architecture once, as data). What can be read off the model is inferred
elsewhere and is not here: the blocks are the base model's `layers`, and the config fields that describe blocks
(per-layer lists, layer-index lists, counts) are found by `model.layer_config`. An entry holds the rest: which
modules write to the residual stream (where a scale or a map folds), whether a norm sits after a branch, the
norms' gain convention, where the final norm is.

A model type with no entry still runs every operator that acts on the residual stream (`generic`): a boundary
map needs nothing but the blocks. The folds (magcomp's scale, ReplaceMe's map, the down_proj refit) need the
writers, so they are refused there with the reason (`refusal`). To add a family: one `Architecture` below and a tiny config
in `tests/conftest.py` (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ghosted_core.errors import GhostedError

DENSE, EXPERTS, HYBRID = "dense", "mixture of experts", "hybrid"
KINDS = (DENSE, EXPERTS, HYBRID)

ATTENTION_OUT = ("self_attn.o_proj",)
MLP_OUT = ("mlp.down_proj",)
EXPERTS_OUT = ("mlp.experts",)  # fused expert weights (E, C, I): their down projection writes the MLP's output
SHARED_OUT = ("mlp.shared_expert.down_proj",)  # Qwen-MoE's shared expert (behind a sigmoid gate: linear in it)
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Architecture:
    """One decoder-only family whose blocks add their output to a residual stream."""

    model_type: str  # config.model_type
    family: str  # the name users see ("Llama", "Gemma3", ...)
    kind: str = DENSE  # one of KINDS: how the app and the docs group families
    final_norm: str = "norm"  # the base model's norm after the blocks (LFM2's is `embedding_norm`)
    # the module whose output is the MLP branch added to the residual (ReplaceMe regresses it); "mlp" unless a
    # norm sits between the MLP and the residual (Gemma's, OLMo's post_feedforward_layernorm); None where no
    # single module computes it (Granite-hybrid adds its experts and its shared MLP inside the block)
    branch: str | None = "mlp"
    # the RMSNorm computes x̂ · (offset + γ): 0 for Llama-style norms, 1 for Gemma's and Qwen3-Next's (1 + γ)
    norm_gain_offset: float = 0.0
    # every block normalizes its attention and MLP outputs before the residual add, so a scale on the residual
    # stream is carried by those norms' gains, not by o_proj/down_proj
    post_norms: bool = False
    # every block reads the stream through a norm (RMSNorm(s·h) = RMSNorm(h)), so a scale on the stream changes
    # nothing a block computes (magcomp's premise); False where blocks read the raw stream (OLMo-2/3: norms after)
    pre_norm: bool = True
    # the modules whose outputs are added to the residual stream as they are (up to a global multiplier): scaling
    # them by s scales the stream leaving the block by s (magcomp's fold sites), and a map after the branch folds
    # into those under it. Candidates: each block has some of them (attention or linear attention, experts or a
    # dense MLP), and the ones a block has are what it writes with. Linears (weight and bias scale), fused experts
    # (their down projection and its bias) or, where post_norms, norms (gain: offset + γ scales)
    residual_writers: tuple[str, ...] = ATTENTION_OUT + MLP_OUT
    # the MLP's output projection, whose input is the intermediate activation a (I features) the down_proj refit
    # regresses on; None where the MLP is experts (no single intermediate)
    down_proj: str | None = "mlp.down_proj"
    # the MLP module itself (distillation's `+kd_mlp` trains it: a dense MLP, or router and experts); None where
    # the block has no one module for it (Granite-hybrid's experts and shared MLP sit side by side)
    mlp: str | None = "mlp"
    # fused experts store their down projection as (E, I, C), applied x @ W (gpt-oss), not (E, C, I)
    experts_transposed: bool = False
    generic: bool = False  # no table entry: only the residual-stream operators apply
    # the per-layer kinds under the names the family's checkpoints use, where transformers renames them on load
    # (an export writes these: llama.cpp's converter and vLLM read the checkpoints' names)
    hub_layer_types: tuple[tuple[str, str], ...] = ()
    # why the last block must stay, where the family requires it ("" where it does not)
    last_block_stays: str = ""
    # base-model modules whose output packs one slice per block along its last dimension (…, L·P), each block
    # reading its own (Gemma 4 E2B/E4B's per-layer embeddings), and the config field holding P; see side_inputs
    per_layer_inputs: tuple[str, ...] = ()
    per_layer_width: str = ""
    # the base model's attribute holding the index of its first block that reuses earlier keys and values
    # (Gemma 4's `first_kv_shared_layer_idx`), recounted on every view
    shared_kv_start: str = ""
    # block attributes computed from the block count (MiniCPM3's `residual_scale` = scale_depth / √L, on each
    # branch): a checkpoint of the cut recomputes them, so a cut keeps each kept block's value by scaling its
    # writers by old / new (`scaling.depth_rescaled`), and the export folds that into their weights
    depth_scaled: tuple[str, ...] = ()

    @property
    def branch_folds(self) -> bool:
        """ReplaceMe's map on the MLP output folds exactly into the writers under the branch (no norm after it)."""
        return self.branch is not None and self.branch not in POST_NORMS and not self.post_norms

    @property
    def branch_folds_into_down_proj(self) -> bool:
        """The refit's and ReplaceMe's statistics come from one down projection that writes the stream."""
        return self.branch_folds and self.down_proj is not None

    def per_layer_inputs_width(self, config) -> int:
        """P, the width of each block's slice of per-layer embeddings in a checkpoint with `config` (its text config),
        0 where the family or the checkpoint has none."""
        return int(getattr(config, self.per_layer_width, 0) or 0) if self.per_layer_width else 0

    def writers_under(self, path: str) -> tuple[str, ...]:
        """The residual writers inside the module at `path` (relative to a block)."""
        return tuple(w for w in self.residual_writers if w.startswith(path + "."))

    def refusal(self, requirement: str, operator: str, config=None) -> str | None:
        """Why `operator` cannot act on this family, which lacks `requirement` ("writers": modules known to write the
        residual stream; "scale": those, and blocks that read the stream through a norm; "branch": one module
        computing the MLP branch; "mlp": one MLP module; "down_proj": one MLP output projection writing the
        stream), or None where it can. `config` (the checkpoint's text config): what a checkpoint adds to its
        family (Gemma 4 E2B's per-layer embeddings, gated by the raw stream)."""
        if requirement == "scale" and not self.pre_norm:
            return (f"{operator} scales the residual stream, and {self.family}'s blocks read the stream without a "
                    "norm before them (their norms come after each branch), so a scaled stream changes what they "
                    "compute: it would not be the same model")
        if requirement == "scale" and self.per_layer_inputs_width(config):
            return (f"{operator} scales the residual stream, and this {self.family} checkpoint's blocks gate their "
                    "per-layer embeddings with the stream itself (per_layer_input_gate reads it without a norm), so a "
                    "scaled stream changes what they compute: it would not be the same model")
        if self.generic and requirement in ("writers", "scale"):
            return (f"{operator} acts on the modules that write to the residual stream, and {self.model_type!r} has no "
                    "entry in the architecture table that names them; the residual-stream operators (none, diag, "
                    "rotate, ghost, ghost_capped, …) run on it")
        if requirement == "branch" and self.branch is None:
            return (f"{operator} maps the MLP branch, and " + (
                f"{self.model_type!r} has no architecture-table entry that names it" if self.generic
                else f"no single module of a {self.family} block computes it"))
        if requirement == "mlp" and self.mlp is None:
            return f"{operator} trains the MLP module, and no single module of a {self.family} block is the MLP"
        if requirement == "down_proj" and not self.branch_folds_into_down_proj:
            return (f"{operator} refits the one MLP output projection that writes the residual stream; "
                    + (f"{self.model_type!r} has no architecture-table entry that names it" if self.generic
                       else f"{self.family}'s " + ("MLP is experts" if self.down_proj is None
                                                   else "MLP output passes a norm first")))
        return None


def _moe(model_type: str, family: str, writers: tuple[str, ...] = ATTENTION_OUT + EXPERTS_OUT, **facts) -> Architecture:
    return Architecture(model_type, family, kind=EXPERTS, residual_writers=writers, down_proj=None, **facts)


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture("llama", "Llama"),
        Architecture("mistral", "Mistral"),
        Architecture("qwen2", "Qwen2"),
        Architecture("qwen3", "Qwen3"),
        Architecture("gemma3_text", "Gemma3", branch="post_feedforward_layernorm", norm_gain_offset=1.0,
                     post_norms=True, residual_writers=POST_NORMS),
        # dense, 2025-26
        Architecture("phi3", "Phi-3"),
        Architecture("smollm3", "SmolLM3"),
        Architecture("granite", "Granite"),  # its residual multiplier scales every writer alike: a scale still folds
        Architecture("olmo2", "OLMo-2", branch="post_feedforward_layernorm", post_norms=True, pre_norm=False,
                     residual_writers=POST_NORMS),
        Architecture("olmo3", "OLMo-3", branch="post_feedforward_layernorm", post_norms=True, pre_norm=False,
                     residual_writers=POST_NORMS),
        Architecture("gemma2", "Gemma2", branch="post_feedforward_layernorm", norm_gain_offset=1.0, post_norms=True,
                     residual_writers=POST_NORMS),
        # Gemma 4 (31B; 26B-A4B, whose blocks add experts beside the MLP under the same post-norm): larger heads on
        # the full-attention blocks (a heterogeneous config), keys as values, a scalar on each block's output
        Architecture("gemma4_text", "Gemma4", branch="post_feedforward_layernorm", post_norms=True,
                     residual_writers=POST_NORMS + ("post_per_layer_input_norm",),
                     last_block_stays="transformers makes a Gemma 4 checkpoint's last block full attention, so a cut "
                                      "that ends on a sliding-window block would load as another model",
                     # E2B/E4B: per-layer embeddings, and the last blocks reuse earlier blocks' keys and values
                     per_layer_inputs=("embed_tokens_per_layer", "per_layer_model_projection"),
                     per_layer_width="hidden_size_per_layer_input", shared_kv_start="first_kv_shared_layer_idx"),
        # Gemma 4 Unified: Gemma 4's dense block (post-norms, a scalar on each block's output, shared KV) in one stack
        # with the vision tokens
        Architecture("gemma4_unified_text", "Gemma4-Unified", branch="post_feedforward_layernorm", post_norms=True,
                     residual_writers=POST_NORMS,
                     last_block_stays="transformers makes a Gemma 4 Unified checkpoint's last block full attention, so "
                                      "a cut that ends on a sliding-window block would load as another model",
                     shared_kv_start="first_kv_shared_layer_idx"),
        # MiniCPM3: multi-head latent attention (its o_proj writes the stream), branches scaled by scale_depth / √L
        Architecture("minicpm3", "MiniCPM3", depth_scaled=("residual_scale",)),
        # mixture of experts: a dense MLP on some blocks (mlp_only_layers) writes through mlp.down_proj
        _moe("mixtral", "Mixtral"),
        _moe("qwen2_moe", "Qwen2-MoE", ATTENTION_OUT + MLP_OUT + EXPERTS_OUT + SHARED_OUT),
        _moe("qwen3_moe", "Qwen3-MoE", ATTENTION_OUT + MLP_OUT + EXPERTS_OUT),
        _moe("olmoe", "OLMoE"),
        _moe("gpt_oss", "gpt-oss", experts_transposed=True),
        # Llama-4: experts (stored (E, I, C)) and a shared expert in `feed_forward` on the blocks in `moe_layers`, a
        # dense MLP there on the others; the experts' block returns (output, router logits), so no map follows it
        _moe("llama4_text", "Llama-4", ATTENTION_OUT + ("feed_forward.down_proj", "feed_forward.experts",
                                                       "feed_forward.shared_expert.down_proj"),
             experts_transposed=True, branch=None, mlp="feed_forward"),
        # hybrid: linear-attention (Gated DeltaNet), short-convolution or Mamba mixers on some blocks
        Architecture("qwen3_next", "Qwen3-Next", kind=HYBRID, norm_gain_offset=1.0, down_proj=None,
                     residual_writers=ATTENTION_OUT + ("linear_attn.out_proj",) + MLP_OUT + EXPERTS_OUT + SHARED_OUT),
        Architecture("qwen3_5_text", "Qwen3.5", kind=HYBRID, norm_gain_offset=1.0,
                     residual_writers=ATTENTION_OUT + ("linear_attn.out_proj",) + MLP_OUT),
        Architecture("qwen3_5_moe_text", "Qwen3.5-MoE", kind=HYBRID, norm_gain_offset=1.0, down_proj=None,
                     residual_writers=ATTENTION_OUT + ("linear_attn.out_proj",) + MLP_OUT + EXPERTS_OUT + SHARED_OUT),
        Architecture("lfm2", "LFM2", kind=HYBRID, final_norm="embedding_norm", branch="feed_forward", mlp="feed_forward",
                     residual_writers=("self_attn.out_proj", "conv.out_proj", "feed_forward.w2"),
                     down_proj="feed_forward.w2"),
        Architecture("granitemoehybrid", "Granite-4 hybrid", kind=HYBRID, branch=None, mlp=None, down_proj=None,
                     residual_writers=ATTENTION_OUT + ("mamba.out_proj", "block_sparse_moe.experts",
                                                       "shared_mlp.output_linear"),
                     hub_layer_types=(("linear_attention", "mamba"), ("full_attention", "attention"))),
    )
}


def families() -> str:
    """The families in the table, by kind, for messages ("dense: Gemma2, …; mixture of experts: …")."""
    parts = []
    for kind in KINDS:
        names = sorted({arch.family for arch in ARCHITECTURES.values() if arch.kind == kind}, key=str.lower)
        parts.append(f"{kind}: {', '.join(names)}")
    return "; ".join(parts)


# Causal-LM types whose forward is not one residual stream through a list of blocks into a final norm, though their
# modules are laid out as if it were (found by bench/families.py): why a cut cannot map them.
NOT_ONE_STREAM: dict[str, str] = {
    "nanochat": "its final norm module also runs on the embeddings before the first block, so the norm a cut at the "
                "end patches and the stream entering the blocks are the same module's two calls",
}
# config fields that, above 1, give the blocks several residual streams instead of one (DeepSeek-V4's and HY-V4's
# manifold hyper-connections: (B, T, N, C) between blocks), which the boundary operators (C × C maps) do not map
STREAM_COUNT_FIELDS = ("hc_mult",)
# config fields that, above 1, run some blocks several times per forward (Dory's recurrent loops, Inkling-2's looped
# passes): a removed block would leave every pass, and a boundary inside the loop is crossed once per pass
LOOP_FIELDS = ("n_recurrent_loops", "loop_num_passes")


def stream_refusal(config) -> str | None:
    """Why a causal LM's blocks are not one residual stream into a final norm (None: they are)."""
    model_type = str(getattr(config, "model_type", None))
    if model_type in NOT_ONE_STREAM:
        return NOT_ONE_STREAM[model_type]
    for field in STREAM_COUNT_FIELDS:
        if isinstance(count := getattr(config, field, None), int) and count > 1:
            return (f"its blocks carry {count} residual streams ({field} {count}: hyper-connections), and the "
                    "boundary operators map one")
    for field in LOOP_FIELDS:
        if isinstance(count := getattr(config, field, None), int) and count > 1:
            return (f"some of its blocks run {count} times per forward ({field} {count}: a loop), so a cut would remove "
                    "a block from every pass and a boundary inside the loop is crossed once per pass")
    return None


def generic_architecture(model_type: str) -> Architecture:
    """The entry of a decoder with no table entry: its blocks run, its folds are refused (see `refusal`)."""
    return Architecture(model_type, model_type, residual_writers=(), branch=None, mlp=None, down_proj=None,
                        generic=True)


def architecture_of(config, strict: bool = False) -> Architecture:
    """The table entry of a model's config, or the generic one where the table has none; `strict`: GhostedError
    naming the table's families instead."""
    model_type = str(getattr(config, "model_type", None))
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    if strict:
        raise GhostedError(f"no architecture-table entry for {model_type!r}; the table has {families()}")
    return generic_architecture(model_type)
