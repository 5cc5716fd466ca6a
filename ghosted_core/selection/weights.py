"""`weights`: forward-free selection from the weights alone (no calibration text, no forward pass).

OUR design, from the idea of Weight-Redundancy Pruning as its abstract states it (compare the
attention-output and MLP down-projection weights across layers, combine the pairwise
similarities with the relative scale of the projections, choose from the all-pairs matrix).
No code of WRP is public; this is not WRP's implementation and is never labelled as it.

- What a branch writes: A = W_o (C × H·d) for attention, W_down (C × I) for the MLP. Where a
  norm follows the branch (Gemma-3's post-norms), A = diag(offset + γ) W, the norm's gains on
  the rows. Raw elementwise similarities of these matrices mean little across layers (heads and
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

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion
from ghosted_core.selection.footprint import Footprint, ScoreShapes

COST = "no forward pass: L·C²·(H·d + I) multiply-adds for the write-space Grams; memory: 2·L Grams of C × C (float32)"
LABEL = "ours, inspired by WRP's abstract (no WRP code is public)"
PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")  # what each branch writes through, before any post-norm


def _write_matrix(block: nn.Module, projection: str, post_norm: str | None, offset: float) -> tuple[torch.Tensor, float]:
    """(A (C × k) float32, its scale r) for one branch of one block."""
    weight = block.get_submodule(projection).weight.detach().float()  # (C, k): nn.Linear is (out, in)
    if post_norm is None:
        return weight, float(weight.norm())
    gain = block.get_submodule(post_norm).weight.detach().float() + offset  # (C,)
    return gain[:, None] * weight, float(gain.norm())


def weight_similarity(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(sim (L × L), the mean over both branches of the write-space Gram cosine; ρ (L,), each layer's scale)."""
    arch = architecture_of(model.config)
    blocks = decoder_blocks(model)
    sims, scales = [], []
    post_norms = arch.residual_writers if arch.post_norms else (None, None)  # Gemma3: the norms after each branch
    for projection, post_norm in zip(PROJECTIONS, post_norms):
        grams, rs = [], []
        for block in blocks:
            a, r = _write_matrix(block, projection, post_norm, arch.norm_gain_offset)
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


def choose(matrix: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """n rounds of: remove the layer i with the largest max over surviving j of R_ij (ties to the lower i).
    Returns the removal order and round 1's redundancy per layer."""
    alive = list(range(matrix.shape[0]))
    order: list[int] = []
    first: list[float] = []
    for _ in range(n):
        best = {i: max(float(matrix[i, j]) for j in alive if j != i) for i in alive}
        if not first:
            first = [best[i] for i in range(matrix.shape[0])]
        pick = max(alive, key=lambda i: (best[i], -i))
        order.append(pick)
        alive.remove(pick)
    return order, first


def weights_bytes(shapes: ScoreShapes) -> Footprint:
    """One branch at its peak: the L flattened Grams, their stacked copy and its normalized copy (C² float32
    each per layer), and the float32 copy of a projection where the model's dtype is not float32."""
    s = shapes
    copy = 0 if s.item == 4 else s.width * max(int(s.config.intermediate_size), s.width) * 4
    return Footprint((3 * s.layers + 2) * s.width * s.width * 4 + copy)  # + a Gram being made and its flat view


@register_criterion("weights", paper="Weight-Redundancy Pruning's idea (abstract only; our design)", needs="weights",
                    cost=COST, memory=weights_bytes, label=LABEL)
def select_weights(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
    """The n layers whose write spaces are best covered by a surviving, larger-scale layer."""
    sim, scale = weight_similarity(scoring.model)
    order, first = choose(redundancy(sim, scale), request.n)
    scoring.details["weights"] = {"order": order, "similarity": sim.tolist(), "scale": scale.tolist()}
    return PruningPlan(request.num_layers, tuple(order), "weights", tuple(first),
                       "forward-free redundancy max_j sim(i, j)·ρ_j/(ρ_i + ρ_j), per block (round 1; higher goes first)")
