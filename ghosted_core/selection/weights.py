"""`weights`: forward-free selection from the weights alone (no calibration text, no forward pass).

OUR design, from the idea of Weight-Redundancy Pruning as its abstract states it (compare the
attention-output and MLP down-projection weights across layers, combine the pairwise
similarities with the relative scale of the projections, choose from the all-pairs matrix).
No code of WRP is public; this is not WRP's implementation and is never labelled as it.

- What a branch writes: A = W_o (C × H·d) for attention (or the out projection of a linear-
  attention, convolution or Mamba mixer), W_down (C × I) for the MLP (experts: every expert's
  down projection side by side, and a shared expert's). Where a norm follows the branch
  (Gemma's, OLMo's post-norms), A = diag(offset + γ) W, the norm's gains on the rows. Raw elementwise similarities of these matrices mean little across layers (heads and
  hidden units are defined only up to permutation), so we compare the spaces they write to: the
  Gram G = A Aᵀ (C × C), with sim(i, j) = ⟨G_i, G_j⟩_F / (‖G_i‖_F ‖G_j‖_F), in [0, 1] (a CKA on
  the output side), averaged over the two branches.
- Scale: ρ_l = (Σ_branch r²)^½ with r = ‖A‖_F, or, behind a post-norm, r = ‖offset + γ‖ (the
  norm fixes the output's size). Only a proxy: the inputs of o_proj and down_proj are not
  normalized, and tied embeddings couple the residual to the head.
- The all-pairs matrix R_ij = sim(i, j) · ρ_j / (ρ_i + ρ_j): high when layer i writes where
  layer j writes and j carries more of the pair's scale. A layer's redundancy is max over the
  surviving j ≠ i of R_ij; n rounds each remove the most redundant layer (ties to the lower
  index), so every removed layer is covered by one that stays.

Cost: no forward pass. O(L · C² · (H·d + I)) multiply-adds for the Grams and O(L² · C²) for their
inner products; memory: 2 · L Grams of C × C in float32 (SmolLM2: 80 MB; an 8B model: 4.3 GB).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.architectures import Architecture, architecture_of
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.model.scaling import present_writers
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes
from ghosted_core.config_values import mlp_width, per_layer_width

COST = "no forward pass: L·C²·(H·d + I) multiply-adds for the write-space Grams; memory: 2·L Grams of C × C (float32)"
LABEL = "ours, inspired by WRP's abstract (no WRP code is public)"
ATTENTION_SIDE = ("self_attn", "linear_attn", "conv", "mamba")  # a block's mixer: its first branch (the rest: MLP)
# the projection a post-norm normalizes (Gemma 4 E2B/E4B: the per-layer-input branch, counted on the MLP side)
BEHIND_NORM = {"post_attention_layernorm": "self_attn.o_proj", "post_feedforward_layernorm": "mlp.down_proj",
               "post_per_layer_input_norm": "per_layer_projection"}


def _columns(module: nn.Module, transposed: bool) -> torch.Tensor:
    """What a writer writes with, as C × k float32 columns: a Linear's weight (out, in), or fused experts' down
    projections side by side ((E, C, I) or, transposed, (E, I, C) → C × E·I)."""
    if isinstance(module, nn.Linear):
        return module.weight.detach().float()
    down = module.down_proj.detach().float()
    return (down.permute(2, 0, 1) if transposed else down.permute(1, 0, 2)).reshape(down.shape[2 if transposed else 1], -1)


def _write_matrix(block: nn.Module, arch: Architecture, side: int) -> tuple[torch.Tensor, float]:
    """(A (C × k) float32, its scale r) for one branch of one block: side 0 the mixer (attention, linear attention,
    convolution or Mamba, whichever the block has), side 1 the MLP (a down_proj, or every expert and a shared one,
    side by side: memory C × (E·I + I_shared) float32 for experts, none beyond the weight for one fp32 Linear)."""
    matrices, gains = [], []
    for writer in present_writers(block, arch.residual_writers):
        if (writer.split(".")[0] in ATTENTION_SIDE or writer == "post_attention_layernorm") != (side == 0):
            continue
        if arch.post_norms:  # the projection behind the norm, rows scaled by the norm's gains
            gains.append(block.get_submodule(writer).weight.detach().float() + arch.norm_gain_offset)  # (C,)
            matrices.append(gains[-1][:, None] * _columns(block.get_submodule(BEHIND_NORM[writer]), False))
        else:
            matrices.append(_columns(block.get_submodule(writer), arch.experts_transposed))
    a = matrices[0] if len(matrices) == 1 else torch.cat(matrices, dim=1)  # (C, k)
    return a, float(a.norm() if not gains else torch.cat(gains).norm())  # behind norms: their gains fix the size


def weight_similarity(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(sim (L × L), the mean over both branches of the write-space Gram cosine; ρ (L,), each layer's scale)."""
    arch = architecture_of(model.config)
    refusal = arch.refusal("writers", "the weights criterion")
    if refusal:
        raise GhostedError(refusal)
    blocks = decoder_blocks(model)
    sims, scales = [], []
    for side in (0, 1):
        grams, rs = [], []
        for block in blocks:
            a, r = _write_matrix(block, arch, side)
            grams.append((a @ a.T).reshape(-1))  # (C²,) memory: C² float32 per layer
            rs.append(r)
        flat = torch.stack(grams)  # (L, C²)
        flat = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
        sims.append((flat @ flat.T).double())  # (L, L)
        scales.append(torch.tensor(rs, dtype=torch.float64))
    return (sims[0] + sims[1]) / 2, torch.stack(scales).pow(2).sum(0).sqrt()


def redundancy(sim: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """R_ij = sim(i, j) · ρ_j / (ρ_i + ρ_j), with R_ii = 0 (L × L)."""
    share = scale[None, :] / (scale[:, None] + scale[None, :]).clamp_min(1e-30)
    matrix = sim * share
    matrix.fill_diagonal_(0.0)
    return matrix


def choose(matrix: torch.Tensor, n: int, keep: Sequence[int] = ()) -> tuple[list[int], list[float]]:
    """n rounds of: remove the layer i (not one in `keep`) with the largest max over surviving j of R_ij (ties to
    the lower i). Returns the removal order and round 1's redundancy per layer."""
    alive = list(range(matrix.shape[0]))
    order: list[int] = []
    first: list[float] = []
    for _ in range(n):
        best = {i: max(float(matrix[i, j]) for j in alive if j != i) for i in alive}
        if not first:
            first = [best[i] for i in range(matrix.shape[0])]
        pick = max((i for i in alive if i not in keep), key=lambda i: (best[i], -i))
        order.append(pick)
        alive.remove(pick)
    return order, first


def write_columns(config) -> int:
    """k of the MLP branch's write matrix: I, or every expert's and a shared expert's intermediate side by side."""
    experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
    if not experts:  # (Gemma 4 E2B/E4B: a double-wide MLP on the KV-sharing blocks, the per-layer-input branch)
        return mlp_width(config) * (2 if getattr(config, "use_double_wide_mlp", False) else 1) + per_layer_width(config)
    inner = int(getattr(config, "moe_intermediate_size", None) or mlp_width(config))
    shared = int(getattr(config, "shared_expert_intermediate_size", None) or getattr(config, "shared_intermediate_size",
                                                                                   None) or 0)
    return experts * inner + shared


def weights_bytes(shapes: ScoreShapes) -> Footprint:
    """One branch at its peak: the L flattened Grams, their stacked copy and its normalized copy (C² float32
    each per layer), and the float32 write matrix of a branch where it is a copy (a dtype other than float32, experts)."""
    s = shapes
    columns = write_columns(s.config)
    copy = 0 if s.item == 4 and columns == mlp_width(s.config) else s.width * max(columns, s.width) * 4
    return Footprint((3 * s.layers + 2) * s.width * s.width * 4 + copy)  # + a Gram being made and its flat view


@register_criterion("weights", paper="Weight-Redundancy Pruning's idea (abstract only; our design)", needs="weights",
                    cost=COST, memory=weights_bytes, label=LABEL)
def select_weights(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The n layers whose write spaces are best covered by a surviving, larger-scale layer."""
    sim, scale = weight_similarity(scoring.model)
    order, first = choose(redundancy(sim, scale), request.n, request.keep)
    scoring.details["weights"] = {"order": order, "similarity": sim.tolist(), "scale": scale.tolist()}
    return PruningPlan(request.num_layers, tuple(order), "weights", tuple(first),
                       "forward-free redundancy max_j sim(i, j)·ρ_j/(ρ_i + ρ_j), per block (round 1; higher goes first)")
