"""What a distillation trains: a registry of targets, each a function that picks modules of a variant.

A target returns, by module path in the variant, the trainable modules that replace the ones
there: copies of what it trains (never the dense model's tensors, which the teacher and every
other variant share) or low-rank changes wrapped around the shared weights. `make_student`
builds the view with them; `finalize` freezes it for evaluation and export. Each entry declares
how many parameters it trains from the config (`parameters`), which the memory plan multiplies
out, and whether a stock variant stays stock with it.

- `operator` (`+kd`): the operator's own weights: ghost's W, diag's scale, rotate's D in H D Hᵀ
  (its structure kept, as LinearPatch trains it), a folded or refitted down_proj.
- `mlp`, `down` (`+kd_mlp`, `+kd_down`): block s−1's MLP, or its down_proj, before each cut.
- `norm` (`+kd_norm`): the norm gains of the blocks on both sides of each cut (Gemma-3's post-norms
  among them).
- `lora` (`+kd_lora`): rank-r changes of every projection in the kept blocks near each cut, merged
  into their weights by an export, as the layer-pruning papers that "heal" with LoRA do.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.memory_parts import attention_shape, plain_linear, skeleton_counts
from ghosted_core.model.loading import final_norm, final_norm_name
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions
from ghosted_core.errors import GhostedError
from ghosted_core.hadamard import hadamard_transform
from ghosted_core.model.low_rank import LowRankLinear
from ghosted_core.model.modeling_ghosted import ResidualLinear, ResidualScale
from ghosted_core.model.scaling import writer_path
from ghosted_core.model.side_inputs import self_contained_start
from ghosted_core.model.surgery import replace_submodules
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import OPERATORS
from ghosted_core.registry import add, check_signature, lookup
from ghosted_core.config_values import mlp_width

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CutSites:
    """Where each cut sits in the variant's own block numbering."""

    before: tuple[int | None, ...]  # the last kept block before each cut (None: the cut starts at block 0)
    after: tuple[int | None, ...]  # the first kept block after each cut (None: the cut reaches the final norm)
    blocks: int  # the variant's blocks

    @classmethod
    def of(cls, plan: PruningPlan) -> CutSites:
        kept = list(plan.kept)
        before = tuple(kept.index(b.start - 1) if b.start > 0 else None for b in plan.boundaries)
        after = tuple(kept.index(b.end) if b.end < plan.num_layers else None for b in plan.boundaries)
        return cls(before, after, len(kept))


Build = Callable[[PreTrainedModel, PreTrainedModel, CutSites, DistillOptions], dict[str, nn.Module]]
Count = Callable[[PretrainedConfig, int, DistillOptions, str], int]


@dataclass(frozen=True)
class TrainableSpec:
    name: str
    build: Build  # (variant, dense, sites, options) -> {path in the variant: trainable module}
    parameters: Count  # (config, boundaries, options, the base operator's kept kind) -> trained parameters
    description: str
    stock: bool  # trains only weights a stock checkpoint has: a stock variant stays stock
    lr: float  # default learning rate (bench/distill.py)
    requires: tuple[str, ...] = ()  # the parts of a block it trains (`Architecture.refusal`): refused where absent


TRAINABLES: dict[str, TrainableSpec] = {}


def register_trainable(name: str, *, parameters: Count, description: str, stock: bool, lr: float,
                       requires: tuple[str, ...] = ()):
    """Add `fn(variant, dense, sites, opts) -> {path: module}` to TRAINABLES; its signature is checked at import."""

    def decorator(fn: Build) -> Build:
        check_signature(fn, f"distillation target {name}", {"variant": PreTrainedModel, "dense": PreTrainedModel,
                                                             "sites": CutSites, "opts": DistillOptions})
        add(TRAINABLES, name, TrainableSpec(name, fn, parameters, description, stock, lr, tuple(requires)),
            "distillation target")
        return fn

    return decorator


def get_trainable(name: str) -> TrainableSpec:
    return lookup(TRAINABLES, name, "distillation target")


class RotatedScale(nn.Module):
    """x ↦ ((x H) ⊙ d) Hᵀ: LinearPatch-R's map with its structure kept while D trains (H fixed, Hadamard).

    Memory: H as an fp32 C×C buffer while training; `to_linear` gives the dense map back for evaluation.
    """

    def __init__(self, rotation: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("rotation", rotation.to(torch.float32))  # (C, C) H
        self.scale = nn.Parameter(scale.to(torch.float32))  # (C,) d

    @classmethod
    def of(cls, linear: ResidualLinear) -> RotatedScale:
        """The rotated scale equal to `linear`'s W = H diag(r) Hᵀ: d = diag(Hᵀ W H)."""
        weight = linear.matrix().double()  # (C, C)
        width = weight.shape[0]
        rotation = hadamard_transform(torch.eye(width, dtype=torch.float64, device=weight.device))  # (C, C) H
        return cls(rotation, torch.diagonal(rotation.T @ weight @ rotation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rotation.to(x.dtype)
        return ((x.to(h.device) @ h) * self.scale.to(x.dtype)) @ h.T

    def to_linear(self) -> ResidualLinear:
        h = self.rotation.double()
        return ResidualLinear((h * self.scale.detach().double()) @ h.T)


def trainable_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of `module` whose parameters train (the original, shared, is never touched)."""
    clone = copy.deepcopy(module).to(torch.float32)
    clone.requires_grad_(True)
    return clone


def _record(variant: PreTrainedModel) -> dict:
    return dict(getattr(variant.config, "ghosted", None) or {})


def _block_path(variant: PreTrainedModel, index: int, inner: str) -> str:
    """The path of `inner` (e.g. "mlp") inside the variant's block `index`, through boundary and after-map wrappers."""
    return f"model.layers.{index}.{writer_path(variant.model.layers[index], inner)}"


def _befores(sites: CutSites, what: str) -> list[int]:
    found = sorted({a for a in sites.before if a is not None})
    if not found:
        raise GhostedError(f"{what} trains block s−1 before each cut, and every cut here starts at block 0; "
                           "use +kd (the operator) or +kd_lora")
    return found


# ---------------------------------------------------------------- the targets


def _operator_parameters(config: PretrainedConfig, boundaries: int, opts: DistillOptions, kept: str) -> int:
    c, inner = config.hidden_size, mlp_width(config)
    per = {"none": 0, "scale": c, "rotated": c, "matrix": c * c, "branch": c * inner, "refit": c * inner}
    return boundaries * per.get(kept, c * c)


@register_trainable(OPERATOR_TARGET, parameters=_operator_parameters, stock=False, lr=1e-4,
                    description="the operator's own weights: ghost's W, diag's scale, rotate's D in H D Hᵀ, "
                                "a folded or refitted down_proj (stock where the operator is)")
def operator_target(variant: PreTrainedModel, dense: PreTrainedModel, sites: CutSites,
                    opts: DistillOptions) -> dict[str, nn.Module]:
    shared = {id(p) for p in dense.parameters()}
    spec = OPERATORS.get(_record(variant).get("operator", ""))
    rotate = spec is not None and spec.cost.kept == "rotated"  # the variant keeps H diag(r) Hᵀ
    found: dict[str, nn.Module] = {}
    for path, module in variant.named_modules():
        if any(id(p) not in shared for p in module.parameters(recurse=False)):
            found[path] = RotatedScale.of(module) if rotate and isinstance(module, ResidualLinear) \
                else trainable_copy(module)
    if not found:
        operator = _record(variant).get("operator", "this variant")
        raise GhostedError(f"{operator} has no weights of its own to distill (a scalar or no map): distill a stock "
                           f"weight instead, e.g. {operator}+kd_mlp or {operator}+kd_lora")
    return found


def _mlp_parameters(config: PretrainedConfig, boundaries: int, opts: DistillOptions, kept: str) -> int:
    """The largest MLP module of the model as transformers builds it (a gated MLP's three projections; a block of
    experts whole: router, every expert, a shared expert and its gate), per cut."""
    counted = skeleton_counts(config)
    return boundaries * (counted.mlp if counted is not None else 3 * config.hidden_size * mlp_width(config))


@register_trainable("mlp", parameters=_mlp_parameters, stock=True, lr=1e-3, requires=("mlp",),
                    description="block s−1's MLP before each cut (gate, up and down projections; a block of experts: "
                                "its router, every expert and a shared expert)")
def mlp_target(variant: PreTrainedModel, dense: PreTrainedModel, sites: CutSites,
               opts: DistillOptions) -> dict[str, nn.Module]:
    mlp = architecture_of(variant.config).mlp
    paths = [_block_path(variant, a, mlp) for a in _befores(sites, "+kd_mlp")]
    return {path: trainable_copy(variant.get_submodule(path)) for path in paths}


def _down_parameters(config: PretrainedConfig, boundaries: int, opts: DistillOptions, kept: str) -> int:
    return boundaries * config.hidden_size * mlp_width(config)


@register_trainable("down", parameters=_down_parameters, stock=True, lr=1e-3, requires=("down_proj",),
                    description="block s−1's down_proj before each cut")
def down_target(variant: PreTrainedModel, dense: PreTrainedModel, sites: CutSites,
                opts: DistillOptions) -> dict[str, nn.Module]:
    down = architecture_of(variant.config).down_proj
    paths = [_block_path(variant, a, down) for a in _befores(sites, "+kd_down")]
    return {path: trainable_copy(variant.get_submodule(path)) for path in paths}


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)


def _norm_parameters(config: PretrainedConfig, boundaries: int, opts: DistillOptions, kept: str) -> int:
    """Two blocks per cut: their two (Gemma-3: four) C-wide norms and the per-head q/k norms where the family has them
    (Qwen3, Gemma-3), plus the final norm."""
    c = config.hidden_size
    head_dim = attention_shape(config)[2]
    per_block = (4 if architecture_of(config).post_norms else 2) * c + 2 * head_dim
    return boundaries * 2 * per_block + c


@register_trainable("norm", parameters=_norm_parameters, stock=True, lr=1e-3,
                    description="the norm gains of the kept blocks on both sides of each cut (and the final norm "
                                "where a cut reaches it)")
def norm_target(variant: PreTrainedModel, dense: PreTrainedModel, sites: CutSites,
                opts: DistillOptions) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}
    for index in sorted({i for i in (*sites.before, *sites.after) if i is not None}):
        for path, module in variant.model.layers[index].named_modules():
            if _is_norm(module):
                found[f"model.layers.{index}.{path}"] = trainable_copy(module)
    if None in sites.after:
        norm = f"model.{final_norm_name(variant)}"
        path = f"{norm}.inner" if not _is_norm(final_norm(variant)) else norm
        found[path] = trainable_copy(variant.get_submodule(path))
    return found


def lora_blocks(sites: CutSites, window: int) -> list[int]:
    """The variant's blocks that get low-rank changes: `window` kept blocks on each side of every cut (0: all)."""
    if window == 0:
        return list(range(sites.blocks))
    chosen: set[int] = set()
    for before, after in zip(sites.before, sites.after):
        if before is not None:
            chosen.update(range(max(0, before - window + 1), before + 1))
        if after is not None:
            chosen.update(range(after, min(sites.blocks, after + window)))
    return sorted(chosen)


def _linear_widths(config: PretrainedConfig) -> int:
    """Σ (in + out) over one block's linear projections, the largest block's (q, k, v, o, gate, up, down; a
    mixer's or a shared expert's where the block has them; fused experts are not linears and get none)."""
    counted = skeleton_counts(config)
    if counted is not None:
        return counted.linear_widths
    c, inner = config.hidden_size, mlp_width(config)
    heads, kv, head_dim = attention_shape(config)
    q, k = heads * head_dim, kv * head_dim
    return (c + q) + 2 * (c + k) + (q + c) + 3 * (c + inner)


def _lora_parameters(config: PretrainedConfig, boundaries: int, opts: DistillOptions, kept: str) -> int:
    blocks = config.num_hidden_layers if opts.lora_window == 0 else min(config.num_hidden_layers,
                                                                          2 * opts.lora_window * boundaries)
    return blocks * opts.lora_rank * _linear_widths(config)


@register_trainable("lora", parameters=_lora_parameters, stock=True, lr=1e-3,
                    description="rank-r changes of every projection in the kept blocks near each cut (merged into "
                                "their weights on export)")
def lora_target(variant: PreTrainedModel, dense: PreTrainedModel, sites: CutSites,
                opts: DistillOptions) -> dict[str, nn.Module]:
    generator = torch.Generator().manual_seed(0)
    found: dict[str, nn.Module] = {}
    for index in lora_blocks(sites, opts.lora_window):
        for path, module in variant.model.layers[index].named_modules():
            if plain_linear(module):  # (not a router that subclasses nn.Linear)
                found[f"model.layers.{index}.{path}"] = LowRankLinear(module, opts.lora_rank, generator=generator)
    return found


# ---------------------------------------------------------------- students


@dataclass
class Student:
    """A variant with trainable modules in place; `parameters` are what the optimizer updates."""

    model: PreTrainedModel
    target: str
    parameters: list[nn.Parameter]
    paths: tuple[str, ...]  # where the trained modules sit in the variant
    # the first block (variant numbering) the training suffix runs from: the first whose computation trains
    # (`blocks`: only the final norm), or earlier where a suffix must start there to compute what its blocks read
    # (`side_inputs.self_contained_start`: Gemma 4's shared KV)
    first_block: int

    @property
    def count(self) -> int:
        return sum(p.numel() for p in self.parameters)


def _first_block(paths, blocks: int) -> int:
    indices = [int(p.split(".")[2]) if p.startswith("model.layers.") else blocks for p in paths]
    return min(indices, default=blocks)


def make_student(variant: PreTrainedModel, dense: PreTrainedModel, plan: PruningPlan, target: str,
                 opts: DistillOptions, record: dict) -> Student:
    """The variant as a view with `target`'s trainable modules in place, its config carrying `record`.

    Memory: the trained copies (float32) or the low-rank factors; every other tensor is shared.
    """
    spec = get_trainable(target)
    replacements = spec.build(variant, dense, CutSites.of(plan), opts)
    view = replace_submodules(variant, replacements)
    config = copy.deepcopy(variant.config)
    config.ghosted = dict(record)
    view.config = view.model.config = config
    parameters = [p for module in replacements.values() for p in module.parameters() if p.requires_grad]
    paths = tuple(sorted(replacements))
    first = min(_first_block(paths, len(variant.model.layers)), self_contained_start(variant.config))
    return Student(view, target, parameters, paths, first)


def finalize(student: Student, dtype: torch.dtype) -> PreTrainedModel:
    """The trained student for evaluation and export: frozen, rotate's D back to its dense map, and the copies of
    stock weights in the model's `dtype` (operator modules and low-rank factors stay float32)."""
    model = student.model
    for path in student.paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)  # a view's own module (replace_submodules made it)
        module = getattr(parent, name)
        if isinstance(module, RotatedScale):
            setattr(parent, name, module.to_linear().to(module.scale.device))
        elif not isinstance(module, (ResidualLinear, ResidualScale, LowRankLinear)):
            module.to(dtype)
    model.requires_grad_(False)
    return model
