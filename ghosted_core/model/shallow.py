"""A module that shares every tensor and child with another but the ones given: the one primitive of every view
(`surgery`'s pruned models, `wrapper`'s text view of a multimodal checkpoint)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from torch import nn


def shallow_view(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A new module of the same class sharing every tensor and child with `module`, but `children`.

    The registries (parameters, buffers, submodules, hooks) are copied so that changing the
    view never changes the original. A module dispatched by accelerate gets its hook
    re-attached to the view, so the view's forward runs the view, not the original.
    """
    view = copy.copy(module)
    for key, value in vars(module).items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            view.__dict__[key] = copy.copy(value)
    for name, child in children.items():
        view._modules[name] = child
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        from accelerate.hooks import add_hook_to_module

        for attr in ("forward", "_old_forward", "_hf_hook"):
            view.__dict__.pop(attr, None)
        add_hook_to_module(view, hook)
    return view


def replace_submodules(module: nn.Module, replacements: Mapping[str, nn.Module]) -> nn.Module:
    """A view of `module` with the submodules at the given dotted paths replaced."""
    direct = {path: new for path, new in replacements.items() if "." not in path}
    nested: dict[str, dict[str, nn.Module]] = {}
    for path, new in replacements.items():
        if "." in path:
            head, rest = path.split(".", 1)
            nested.setdefault(head, {})[rest] = new
    for head, inner in nested.items():  # onto the replacement of `head` itself where there is one (a reindexed parent)
        direct[head] = replace_submodules(direct.get(head, module.get_submodule(head)), inner)
    return shallow_view(module, **direct)
