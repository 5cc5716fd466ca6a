"""The only place calibration hooks live: record residual streams and MLP branch outputs.

`capture` hooks the residual stream entering the blocks we need (and the MLP branch output of
a block), and `run_forward` stops the forward pass right after the last of them: nothing
downstream is computed. The hooks fire only in the thread that opened the context and are
removed on exit, whatever happens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.model.modeling_ghosted import PatchedBlock
from ghosted_core.model.scaling import writer_path
from ghosted_core.architectures import Architecture, architecture_of
from ghosted_core.model.loading import final_norm


class StopForward(Exception):
    """Raised by a capture hook once everything needed was seen: ends the forward early."""


def branch_module(block: nn.Module, arch: Architecture) -> nn.Module:
    """The module whose output is the MLP branch added to the residual (ReplaceMe regresses it).

    `Architecture.branch` names it per family: the MLP itself, or the norm that follows it
    (Gemma's `post_feedforward_layernorm`).
    """
    if arch.branch is None:
        raise ValueError(f"{arch.family} has no single module computing its MLP branch")
    return unwrap(block).get_submodule(arch.branch)


def down_projection(model: PreTrainedModel, block: nn.Module) -> nn.Module:
    """The module computing block `block`'s MLP output projection (its input: the intermediate a, I features),
    found through a view's wrappers."""
    return block.get_submodule(writer_path(block, architecture_of(model.config).down_proj))


def inner_folds(model: PreTrainedModel) -> bool:
    """A change of down_proj is a change of the stream (no norm after the MLP): the refit's statistics apply."""
    return architecture_of(model.config).branch_folds_into_down_proj


@contextlib.contextmanager
def capture(model: PreTrainedModel, residuals: Iterable[int], branches: Iterable[int] = (),
            on_tensor: Callable[[tuple[str, int], torch.Tensor], None] | None = None,
            inners: Iterable[int] = ()) -> Iterator[dict]:
    """Hook `model` to record residual streams, MLP branch outputs and MLP intermediates during `run_forward`.

    `residuals`: layer-list indices whose incoming residual (as the block sees it, after any
    boundary operator) is wanted; index len(layers) means the input of the final norm.
    `branches`: layer-list indices whose MLP branch output is wanted; `inners`: those whose
    down_proj input (the MLP's intermediate activation) is wanted. Tensors go to
    `on_tensor(key, tensor)` if given, else into the yielded dict under ("residual", j) /
    ("branch", j) / ("inner", j). Hooks fire only in the thread that opened the context (other
    users of a shared model are not disturbed) and are removed on exit, whatever happens.
    """
    residuals, branches, inners = sorted(set(residuals)), sorted(set(branches)), sorted(set(inners))
    layers = model.model.layers
    arch = architecture_of(model.config)
    store: dict[tuple[str, int], torch.Tensor] = {}
    sink = on_tensor or store.__setitem__
    owner = threading.get_ident()
    last = max([*residuals, *(j + 1 for j in (*branches, *inners))], default=-1)
    handles = []

    def residual_hook(j: int):
        def hook(_module, args, kwargs=None):  # kwargs=None: another thread may call it mid-registration
            if threading.get_ident() != owner:
                return None
            sink(("residual", j), (args[0] if args else kwargs["hidden_states"]).detach())
            if j == last:
                raise StopForward
            return None
        return hook

    def branch_hook(j: int):
        def hook(_module, _args, output):
            if threading.get_ident() == owner:
                sink(("branch", j), (output[0] if isinstance(output, tuple) else output).detach())
        return hook

    def inner_hook(j: int):
        def hook(_module, args):
            if threading.get_ident() == owner:
                sink(("inner", j), args[0].detach())
        return hook

    try:
        for j in residuals:
            target = unwrap(layers[j]) if j < len(layers) else unwrap(final_norm(model))
            handles.append(target.register_forward_pre_hook(residual_hook(j), with_kwargs=True))
        for j in branches:
            handles.append(branch_module(layers[j], arch).register_forward_hook(branch_hook(j)))
        for j in inners:
            handles.append(down_projection(model, layers[j]).register_forward_pre_hook(inner_hook(j)))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def run_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """A cache-free forward of the base model (no LM head) that ends early at a capture's last hook."""
    device = model.get_input_embeddings().weight.device
    if device.type == "meta":  # offloaded embeddings: accelerate moves inputs itself
        device = input_ids.device
    with torch.no_grad():
        try:
            model.model(input_ids=input_ids.to(device),
                        attention_mask=None if attention_mask is None else attention_mask.to(device),
                        use_cache=False)
        except StopForward:
            pass


def unwrap(module: nn.Module) -> nn.Module:
    """The decoder block (or norm) inside any boundary wrapper."""
    while isinstance(module, PatchedBlock):
        module = module.inner
    return module
