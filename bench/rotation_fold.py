"""An orthogonal boundary map folded exactly into a stock checkpoint, by a change of basis upstream.

A general map x ↦ xW on the residual stream does not fold into stock weights: every RMSNorm
after it would see ‖xW‖ instead of ‖x‖. An orthogonal Q keeps the norm, so the whole model
upstream of the boundary can work in the rotated basis h ↦ hQ (computational invariance, as
in SliceGPT and QuaRot): each RMSNorm gain is absorbed into the linears that read it, the
readers get Q on their input side (W ↦ W diag(g) Q), the writers to the residual stream on
their output side (W ↦ Qᵀ W, b ↦ b Q) and the embeddings E ↦ E Q. The stream then arrives at
the cut already rotated, and everything downstream is untouched. Because the LM head is
downstream and the embeddings upstream, tied embeddings must be untied (one more V×C matrix).

`procrustes_map` gives the orthogonal Q closest to the boundary's least-squares problem
(min ‖X_pre Q − X_post‖, from XᵀX and XᵀΔ); `fold_upstream_rotation` builds the stock model.
Llama-style blocks only (Llama, Mistral, Qwen2, Qwen3): Gemma3 normalizes each branch output
before adding it, which this change of basis does not carry through.
"""

from __future__ import annotations

import copy
import logging

import torch
from accelerate import init_empty_weights
from transformers import PreTrainedModel

from ghosted_core.errors import GhostedError
from ghosted_core.export.fold import stock_blockers, stock_tensors
from ghosted_core.statistics import BoundaryStats

log = logging.getLogger(__name__)

LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}  # norm → the linears that read its output
WRITERS = ("self_attn.o_proj", "mlp.down_proj")  # linears that write to the residual stream


def procrustes_map(stats: BoundaryStats, tokens: str = "capped") -> torch.Tensor:
    """(C, C) orthogonal Q minimizing ‖X_pre Q − X_post‖_F over a token set: Q = U Vᵀ, U S Vᵀ = X_preᵀ X_post.

    X_preᵀ X_post = XᵀX + XᵀΔ comes from the statistics; "capped" keeps attention sinks from
    deciding the answer, as for ghost_capped. Time O(C³) (one SVD), memory 3·C²·8 B.
    """
    moments = stats.token_set(tokens, "residual")
    u, _, vh = torch.linalg.svd(moments.xtx + moments.xtd)  # (C, C) each
    return u @ vh


def fold_upstream_rotation(pruned: PreTrainedModel, first_after_cut: int, rotation: torch.Tensor,
                           record: dict | None = None) -> PreTrainedModel:
    """A stock model computing `pruned` with x ↦ xQ applied to the stream entering its block `first_after_cut`.

    `pruned`: a pruned variant that folds into stock weights (plain pruning, or ReplaceMe folded
    upstream of the cut); `first_after_cut`: the index, in its layer list, of the first block after
    the cut. Returns a new model: the embeddings and blocks before the cut are rotated copies
    (memory: those weights once more, plus an untied LM head where the embeddings were tied); the
    blocks after the cut share the pruned model's tensors.
    """
    config = pruned.config
    if config.model_type not in LLAMA_STYLE:
        raise GhostedError(f"an orthogonal fold needs Llama-style blocks ({', '.join(LLAMA_STYLE)}); "
                           f"{config.model_type} normalizes its branch outputs")
    if stock_blockers(pruned):
        raise GhostedError("the model to rotate must already fold into a stock checkpoint")
    q = rotation.to(torch.float64)  # (C, C)
    state = {}
    for chunk in stock_tensors(pruned):
        state.update(chunk)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = state["model.embed_tokens.weight"]
    if tied:
        state["lm_head.weight"] = embed  # the head stays in the original basis: untie
    state["model.embed_tokens.weight"] = _rotate(embed, right=q)  # E Q
    for i in range(first_after_cut):
        prefix = f"model.layers.{i}."
        for norm, readers in READERS.items():
            gain = state[f"{prefix}{norm}.weight"].double()  # (C,)
            for name in readers:
                key = f"{prefix}{name}.weight"  # (out, C): input side gets diag(g) Q
                state[key] = _rotate(state[key], right=q, scale=gain)
            state[f"{prefix}{norm}.weight"] = torch.ones_like(state[f"{prefix}{norm}.weight"])
        for name in WRITERS:
            key = f"{prefix}{name}.weight"  # (C, in): output side gets Qᵀ
            state[key] = _rotate(state[key], left=q.T)
            if f"{prefix}{name}.bias" in state:
                state[f"{prefix}{name}.bias"] = _rotate(state[f"{prefix}{name}.bias"][None], right=q)[0]
    new_config = copy.deepcopy(config)
    new_config.tie_word_embeddings = False
    if record is not None:
        new_config.ghosted = dict(record)
    with init_empty_weights(include_buffers=False):  # parameters on meta, filled below; buffers (rotary) computed
        model = type(pruned)(new_config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def _rotate(weight: torch.Tensor, left: torch.Tensor | None = None, right: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """left · W · diag(scale) · right in float64, back in W's dtype (a new tensor)."""
    w = weight.double()
    if scale is not None:
        w = w * scale  # columns: W diag(g)
    if left is not None:
        w = left @ w
    if right is not None:
        w = w @ right
    return w.to(weight.dtype).contiguous()


def orthogonal_fold_variants(dense: PreTrainedModel, plan, stats: BoundaryStats, batches, options,
                             refit: str | None = "replaceme_keepsink") -> dict[str, PreTrainedModel]:
    """Stock-foldable approximations of ghost at a plan's single boundary (the fold-gap experiment).

    - "ghost_orth": the Procrustes rotation of the boundary (capped tokens), folded upstream;
    - "ghost_orth+<refit>": that model plus the `refit` operator (a ReplaceMe-family fit) on block
      s−1's MLP branch, fitted on the rotated model's own activations against the dense target,
      so that it fits what the rotation left. Both are stock checkpoints (untied embeddings).
    Each returned model has its own (rotated) embeddings: evaluate them with themselves as the
    base, not with the dense model's prefix.
    """
    from ghosted_core.architectures import architecture_of
    from ghosted_core.calibration.collect import collect_boundary_stats
    from ghosted_core.recovery.modules import branch_replacement
    from ghosted_core.recovery.operators import get_operator, needs_of
    from ghosted_core.run.options import VariantSpec
    from ghosted_core.run.fitting import build_recovered, choose_fit
    from ghosted_core.model.surgery import build_variant

    if len(plan.boundaries) != 1:
        raise GhostedError("the orthogonal fold is built for one boundary (a contiguous run of removed blocks)")
    (boundary,) = plan.boundaries
    record = {"dense_layers": plan.num_layers, "removed_layers": list(plan.removed),
              "boundaries": [[boundary.start, boundary.end]], "operator": "ghost_orth", "sequential": False}
    pruned = build_recovered(dense, plan, VariantSpec("none", "none"), [])
    rotated = fold_upstream_rotation(pruned, boundary.start, procrustes_map(stats), record)
    variants = {"ghost_orth": rotated}
    if refit is not None and boundary.start > 0:
        source_start = boundary.start  # the first block after the cut, in the pruned layer list
        branch_stats = collect_boundary_stats(rotated, source_start, dense, boundary, batches, options.calibrate,
                                              needs_of([refit]))
        fit = choose_fit(dense, get_operator(refit).fit(branch_stats, options.fit), batches, options, rotated,
                         source_start)
        replacement = branch_replacement(fit, rotated.model.layers[source_start - 1],
                                         architecture_of(rotated.config))
        variants[f"ghost_orth+{refit}"] = build_variant(rotated, (), replacements={source_start - 1: replacement},
                                                        record=record | {"operator": f"ghost_orth+{refit}"})
    return variants
