"""Multimodal checkpoints (Gemma-3 4B–27B, Mistral-3, Qwen3.5, …): the text decoder sits inside a wrapper
(`model.language_model`) beside a vision tower and a projector. The studio cuts that decoder as a causal LM of its
own and keeps everything else as it is.

- `text_view(wrapper)`: the text family's causal-LM class over the wrapper's own language model and LM head (no
  copy). Every stage (scoring, calibration, operators, distillation, evaluation) runs on it as on a text model;
  variants built from it carry the wrapper along (`wrapped`).
- An export of such a variant is the whole checkpoint again (`export.folder`): the cut decoder under the wrapper's
  names (`Wrapped.key`), the other tensors unchanged (`Wrapped.other_tensors`), the wrapper's config with the
  sliced text_config; transformers loads it as the same multimodal class.
- `planning_config`: the text config that plans and checks read, with the parameters beside the decoder
  (`wrapper_parameters`, counted on the meta device) so the memory plan counts what loads with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

WRAPPER_PARAMETERS = "wrapper_parameters"  # a text config's attribute: parameters loaded beside its decoder


@dataclass(frozen=True)
class Wrapped:
    """The multimodal model a text view was taken from, and where its decoder and head sit in it."""

    module: PreTrainedModel
    prefix: str  # the language model's path ("model.language_model")
    head: str  # the LM head's path ("lm_head")

    def key(self, name: str) -> str:
        """A text view's state-dict key under the wrapper's name for the same tensor."""
        if name.startswith("model."):
            return f"{self.prefix}.{name.removeprefix('model.')}"
        return f"{self.head}.{name.removeprefix('lm_head.')}" if name.startswith("lm_head.") else name

    def holds(self, name: str) -> bool:
        """Whether the wrapper's parameter `name` is the decoder's or the head's (what the text view has)."""
        return name.startswith((f"{self.prefix}.", f"{self.head}."))

    def parameters_beside(self) -> int:
        """Parameters outside the decoder and the head (what loads and exports beside them)."""
        return sum(p.numel() for name, p in self.module.named_parameters() if not self.holds(name))

    def other_tensors(self) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors outside the decoder and the head (vision tower, projector, …), one top-level part per chunk."""
        chunks: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.module.state_dict(keep_vars=False).items():
            if not self.holds(name):
                chunks.setdefault(".".join(name.split(".")[:2]), {})[name] = tensor.detach()
        yield from chunks.values()


def is_wrapper_config(config: PretrainedConfig) -> bool:
    """A multimodal checkpoint's config: a text_config, and a type transformers builds as image-text-to-text."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "text_config", None) is not None
            and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def from_wrapper(config: PretrainedConfig) -> bool:
    """`planning_config`'s answer for a wrapper: the text config of a multimodal checkpoint."""
    return getattr(config, WRAPPER_PARAMETERS, None) is not None


def wrapped(model: nn.Module) -> Wrapped | None:
    """The wrapper a text view (or a variant built from one) stands for; None for a text model."""
    return model.__dict__.get("ghosted_wrapped")


# where a wrapper holds its text decoder: beside the vision tower in its base model (Gemma-3, Mistral-3, Qwen3.5), or
# inside a causal LM of its own (Llama-4)
DECODER_PATHS = ("model.language_model", "language_model.model")


def language_model(wrapper: PreTrainedModel) -> tuple[str, nn.Module]:
    """The wrapper's text decoder (without head) and its path (one of DECODER_PATHS)."""
    for path in DECODER_PATHS:
        module = wrapper
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, nn.Module) and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return path, module
    raise ValueError(f"{type(wrapper).__name__} has no text decoder at "
                     + " or ".join(f"{path}.layers" for path in DECODER_PATHS))


def text_view(wrapper: PreTrainedModel) -> PreTrainedModel:
    """The text family's causal LM over `wrapper`'s decoder and LM head, sharing them (a meta skeleton of the
    causal-LM class whose two children are replaced: nothing is allocated)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ghosted_core.model.shallow import shallow_view

    text_config = wrapper.config.get_text_config()
    prefix, decoder = language_model(wrapper)
    head = wrapper.get_output_embeddings()
    head_name = next(name for name, child in wrapper.named_modules() if child is head)
    with torch.device("meta"):
        skeleton = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)](text_config)
    view = shallow_view(skeleton, model=decoder, lm_head=head)
    own = {id(p) for p in wrapper.parameters()}
    left = [name for name, p in view.named_parameters() if id(p) not in own]
    if left:
        raise ValueError(f"the text view of {type(wrapper).__name__} has parts the wrapper lacks: {left[:3]}")
    view.config = text_config
    # the wrapper's config says whether its head is tied, not the text config's flag (Mistral-3's may disagree)
    text_config.tie_word_embeddings = head.weight is decoder.get_input_embeddings().weight
    outer = Wrapped(wrapper, prefix, head_name)
    setattr(text_config, WRAPPER_PARAMETERS, outer.parameters_beside())
    view.generation_config = wrapper.generation_config
    view.__dict__["ghosted_wrapped"] = outer
    wrapper.eval().requires_grad_(False)  # the vision tower and projector are kept as they are
    view.eval()
    return view


def planning_config(config: PretrainedConfig) -> PretrainedConfig:
    """What plans, checks and estimates read: a text model's config as it is; a wrapper's text config, with the
    parameters beside its decoder (counted on the meta device)."""
    if not is_wrapper_config(config):
        return config
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(config)
    return text_view(skeleton).config


def wrapper_export_config(wrapped_model: Wrapped, text_values: dict) -> dict:
    """The wrapper's config.json for an export: its own values, the (sliced) text config in its place."""
    values = wrapped_model.module.config.to_diff_dict()
    for key in ("ghosted", "_name_or_path", "_commit_hash"):
        values.pop(key, None)
    text = {k: v for k, v in text_values.items() if k not in ("architectures", WRAPPER_PARAMETERS)}
    return values | {"text_config": text, "architectures": [type(wrapped_model.module).__name__]}
