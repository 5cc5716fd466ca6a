"""Every supported model family's facts in one table: where its parts are and what a cut must keep consistent.

Loading, capture, surgery, export and the model card read this table instead of knowing
families themselves (the way mergekit describes each architecture once, as data). To support a
new family, add one `Architecture` here, its remote-code classes in `model.modeling_ghosted`
(self-contained on purpose, so it keeps its own list; a test holds the two equal), and a tiny
config in `tests/conftest.py` (see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ghosted_core.errors import GhostedError


@dataclass(frozen=True)
class Architecture:
    """One decoder-only family whose blocks are pre-norm residual blocks (h ↦ h + attn(·) + mlp(·))."""

    model_type: str  # config.model_type
    family: str  # the name users see ("Llama", "Gemma3", ...)
    blocks: str = "model.layers"  # the decoder blocks (an nn.ModuleList)
    final_norm: str = "model.norm"  # the norm before the LM head: a cut reaching the end maps its input
    embeddings: str = "model.embed_tokens"
    # the module whose output is the MLP branch added to the residual (ReplaceMe regresses it); "mlp" unless a
    # norm sits between the MLP and the residual (Gemma3's post_feedforward_layernorm)
    branch: str = "mlp"
    # config lists with one entry per block, sliced with the blocks when some are removed
    per_layer_fields: tuple[str, ...] = ("layer_types",)
    # config counts of leading blocks with some property, re-counted over the kept blocks (Qwen2/3's
    # max_window_layers: blocks below it use full attention, the rest sliding windows when enabled)
    leading_count_fields: tuple[str, ...] = ()
    # the RMSNorm computes x̂ · (offset + γ): 0 for Llama-style norms, 1 for Gemma's (1 + γ)
    norm_gain_offset: float = 0.0
    # every block normalizes its attention and MLP outputs before the residual add (Gemma3's post-norms), so a
    # scale on the residual stream is not carried by o_proj/down_proj alone
    post_norms: bool = False
    # the modules of a block whose outputs are added to the residual stream as they are: scaling their outputs by s
    # scales the stream leaving the block by s (the magnitude compensation's fold sites). Linears (weight and bias
    # scale) or, where post_norms, norms (gain: offset + γ scales)
    residual_writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    # the MLP's output projection: its input is the MLP's intermediate activation a (I features), on which the
    # down_proj refit regresses; the refit folds only where the projection writes to the stream (`branch == "mlp"`)
    down_proj: str = "mlp.down_proj"

    @property
    def branch_folds_into_down_proj(self) -> bool:
        """ReplaceMe's map on the MLP output folds exactly into down_proj (no norm after the MLP)."""
        return self.branch == "mlp"


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture("llama", "Llama"),
        Architecture("mistral", "Mistral"),
        Architecture("qwen2", "Qwen2", leading_count_fields=("max_window_layers",)),
        Architecture("qwen3", "Qwen3", leading_count_fields=("max_window_layers",)),
        Architecture("gemma3_text", "Gemma3", branch="post_feedforward_layernorm", norm_gain_offset=1.0,
                     post_norms=True, residual_writers=("post_attention_layernorm", "post_feedforward_layernorm")),
    )
}


def families() -> str:
    """The supported families, for messages ("Gemma3, Llama, Mistral, Qwen2, Qwen3")."""
    return ", ".join(sorted({arch.family for arch in ARCHITECTURES.values()}))


def architecture_of(config) -> Architecture:
    """The table entry of a model's config; GhostedError naming the supported families otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise GhostedError(f"unsupported architecture {model_type!r}; supported families: {families()}")
    return ARCHITECTURES[model_type]
