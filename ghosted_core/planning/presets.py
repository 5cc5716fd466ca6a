"""Curated Hugging Face Hub models for a GPU Space, from 0.36B to 70B parameters, dense, experts and windowed.

Each preset carries the numbers the memory plan and the time estimate need, written down
here because offline we cannot fetch a config: they are copied from each model's published
`config.json` on the Hub (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings, and in `extra`
what a family adds: experts, windows, partial rotary). Each is double-checked in
tests/planning/test_presets.py: the parameter count of the model transformers builds from these numbers
(on the meta device) must match the size the model card publishes (`published_params`) within 1.5%, or,
where the card gives only a rounded size ("7B"), within that rounding.

`preset_status` says, before anything downloads, whether a preset can run here and why not
(offline, gated without a token, too big for the device); `check_preset` raises that reason as
a GhostedError.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass

from transformers import AutoConfig, PretrainedConfig

from ghosted_core.architectures import KINDS, architecture_of
from ghosted_core.errors import GhostedError
from ghosted_core.memory import MemoryPlan
from ghosted_core.planning.estimate import DeviceInfo, TimeEstimate, current_device, estimate_memory, \
    estimate_time, gpu_duration
from ghosted_core.hub import hub_reachable
from ghosted_core.memory import HEADROOM
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.model.loading import peek_config
from ghosted_core.model.wrapper import planning_config
from ghosted_core.run.options import RunOptions


MULTIMODAL = "multimodal"  # a checkpoint whose text decoder sits in a wrapper beside a vision tower
PRESET_KINDS = (*KINDS, MULTIMODAL)


@dataclass(frozen=True)
class Preset:
    """One curated Hub model and the config numbers that size it."""

    key: str  # short name shown in the app
    hub_id: str
    family: str  # the architecture table's family name (Llama, Qwen3-MoE, gpt-oss, ...)
    model_type: str  # transformers' config model_type
    published_params: float  # the size on the model card (e.g. 7.61e9)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    license: str
    gated: bool = False  # the Hub asks to accept terms first: a token of an account that did is needed
    published_non_embedding: float | None = None  # where the model card also states it (Qwen)
    extra: tuple[tuple[str, object], ...] = ()  # further config.json numbers the family has (experts, windows)
    rounded: bool = False  # the card gives only a rounded size ("7B"): the count is held to that rounding
    vision: tuple[tuple[str, object], ...] = ()  # a multimodal checkpoint's vision_config numbers (its tower)
    audio: tuple[tuple[str, object], ...] = ()  # and its audio_config numbers, where it has an audio tower (Gemma 4 E*)
    card_decoder_only: bool = False  # the card's size counts the text decoder alone (its tower listed apart)

    def config(self) -> PretrainedConfig:
        """A transformers config with these numbers (for the memory plan and the time estimate); a multimodal
        checkpoint's text config, counting the tower beside its decoder (`model.wrapper.planning_config`)."""
        text = self._text()
        if not self.vision:
            return AutoConfig.for_model(self.model_type, **text)
        return copy.deepcopy(_wrapper_config(self.model_type, _frozen(text), _frozen(dict(self.vision)),
                                             _frozen(dict(self.audio))))

    def checkpoint_config(self) -> PretrainedConfig:
        """The config of the whole checkpoint: `config()` for a text model, the multimodal wrapper's otherwise."""
        if not self.vision:
            return self.config()
        return AutoConfig.for_model(self.model_type, text_config=self._text(), **self._towers())

    def _towers(self) -> dict:
        return {"vision_config": dict(self.vision)} | ({"audio_config": dict(self.audio)} if self.audio else {})

    def _text(self) -> dict:
        return dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                    intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                    tie_word_embeddings=self.tied_embeddings, **dict(self.extra))

    @property
    def params(self) -> int:
        """Parameters of the model transformers builds from these numbers (counted on the meta device)."""
        return estimate_parameters(self.config())

    @property
    def kind(self) -> str:
        """How the app groups it: its family's kind (dense, mixture of experts, hybrid), or multimodal."""
        return MULTIMODAL if self.vision else architecture_of(self.config()).kind

    @property
    def label(self) -> str:
        """'Qwen2.5-7B (7.6B, Qwen2)' and a lock for gated models."""
        return f"{self.hub_id.split('/')[1]} ({self.published_params / 1e9:.2g}B, {self.family})" + \
            (" 🔒 needs a token" if self.gated else "")


def _frozen(values: dict) -> tuple:
    """`values` as a hashable key (lists as tuples), for `_wrapper_config`'s cache; `_thawed` undoes it."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items())


def _thawed(values: tuple) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values}


@functools.cache
def _wrapper_config(model_type: str, text: tuple, vision: tuple, audio: tuple = ()) -> PretrainedConfig:
    """The text config a multimodal preset plans with (its wrapper built once on the meta device, every tower)."""
    towers = {"vision_config": _thawed(vision)} | ({"audio_config": _thawed(audio)} if audio else {})
    return planning_config(AutoConfig.for_model(model_type, text_config=_thawed(text), **towers))


def _p(key, hub_id, family, model_type, published, c, layers, heads, kv, head_dim, inter, vocab, tied, license,
       gated=False, non_embedding=None, rounded=False, vision=None, audio=None, card_decoder_only=False,
       **extra) -> Preset:
    return Preset(key, hub_id, family, model_type, published, c, layers, heads, kv, head_dim, inter, vocab, tied,
                  license, gated, non_embedding, tuple(extra.items()), rounded, tuple((vision or {}).items()),
                  tuple((audio or {}).items()), card_decoder_only)


SIGLIP = dict(hidden_size=1152, num_hidden_layers=27, intermediate_size=4304, num_attention_heads=16, image_size=896,
              patch_size=14)  # Gemma-3 4B-27B's tower: 417M (Gemma 3 technical report, Table 1)
QWEN35_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16)
# Gemma 4 E2B/E4B (their config.json): per-layer embeddings of 256 per block, the last blocks sharing KV, a vision
# and an audio tower beside the decoder
GEMMA4_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                     num_key_value_heads=12, head_dim=64, global_head_dim=64, patch_size=16, pooling_kernel_size=3,
                     position_embedding_size=10240, use_clipped_linears=True, standardize=False)
GEMMA4_AUDIO = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
                    conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                    residual_weight=0.5, use_clipped_linears=True)
GEMMA4_SMALL = dict(global_head_dim=512, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                    sliding_window=512, final_logit_softcapping=30.0)
# Gemma 4 26B-A4B (its config.json, as several public fixtures copy it): 128 experts of 704 beside a dense MLP of 2112
# on every block, keys as values on the full-attention blocks (2 KV heads of 512), 8 KV heads of 256 on the sliding
# ones; its card's 25.2B counts the decoder, the ~550M vision encoder listed apart
GEMMA4_26B = dict(num_global_key_value_heads=2, global_head_dim=512, attention_k_eq_v=True, enable_moe_block=True,
                  num_experts=128, top_k_experts=8, moe_intermediate_size=704, hidden_size_per_layer_input=0,
                  sliding_window=1024, final_logit_softcapping=30.0,
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5)
GEMMA4_LARGE_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           num_key_value_heads=16, head_dim=72, global_head_dim=72, patch_size=16)


PRESETS: dict[str, Preset] = {p.key: p for p in (
    #  key              hub id                            family     type     size     C    L   H   KV  hd   I      vocab   tied
    _p("smollm2-360m", "HuggingFaceTB/SmolLM2-360M", "Llama", "llama", 362e6, 960, 32, 15, 5, 64, 2560, 49152, True,
       "apache-2.0"),
    _p("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B", "Llama", "llama", 1.71e9, 2048, 24, 32, 32, 64, 8192, 49152, True,
       "apache-2.0"),
    _p("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "Qwen2", "qwen2", 0.49e9, 896, 24, 14, 2, 64, 4864, 151936, True,
       "apache-2.0", non_embedding=0.36e9),
    _p("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", "Qwen2", "qwen2", 1.54e9, 1536, 28, 12, 2, 128, 8960, 151936, True,
       "apache-2.0", non_embedding=1.31e9),
    _p("qwen2.5-3b", "Qwen/Qwen2.5-3B", "Qwen2", "qwen2", 3.09e9, 2048, 36, 16, 2, 128, 11008, 151936, True,
       "qwen-research", non_embedding=2.77e9),
    _p("qwen2.5-7b", "Qwen/Qwen2.5-7B", "Qwen2", "qwen2", 7.61e9, 3584, 28, 28, 4, 128, 18944, 152064, False,
       "apache-2.0", non_embedding=6.53e9),
    _p("qwen3-1.7b", "Qwen/Qwen3-1.7B", "Qwen3", "qwen3", 1.7e9, 2048, 28, 16, 8, 128, 6144, 151936, True,
       "apache-2.0", non_embedding=1.4e9),
    _p("qwen3-4b", "Qwen/Qwen3-4B", "Qwen3", "qwen3", 4.0e9, 2560, 36, 32, 8, 128, 9728, 151936, True, "apache-2.0",
       non_embedding=3.6e9),
    _p("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3", "qwen3", 8.2e9, 4096, 36, 32, 8, 128, 12288, 151936, False,
       "apache-2.0", non_embedding=6.95e9),
    _p("mistral-7b", "mistralai/Mistral-7B-v0.3", "Mistral", "mistral", 7.25e9, 4096, 32, 32, 8, 128, 14336, 32768,
       False, "apache-2.0 (the Hub asks to accept Mistral's terms first)", gated=True),
    _p("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "Llama", "llama", 1.24e9, 2048, 16, 32, 8, 64, 8192, 128256, True,
       "llama3.2", gated=True),
    _p("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "Llama", "llama", 3.21e9, 3072, 28, 24, 8, 128, 8192, 128256, True,
       "llama3.2", gated=True),
    _p("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Llama", "llama", 8.03e9, 4096, 32, 32, 8, 128, 14336, 128256,
       False, "llama3.1", gated=True),
    # 2025-26: dense with windows, post-norms or RoPE-free blocks; mixtures of experts
    _p("gemma-3-1b", "google/gemma-3-1b-pt", "Gemma3", "gemma3_text", 1.0e9, 1152, 26, 4, 1, 256, 6912, 262144, True,
       "gemma", gated=True, non_embedding=0.698e9, sliding_window=512),
    _p("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", "SmolLM3", "smollm3", 3e9, 2048, 36, 16, 4, 128, 11008, 128256,
       True, "apache-2.0", rounded=True),
    _p("phi-4-mini", "microsoft/Phi-4-mini-instruct", "Phi-3", "phi3", 3.8e9, 3072, 32, 24, 8, 128, 8192, 200064,
       True, "mit", partial_rotary_factor=0.75),
    _p("olmo-3-7b", "allenai/Olmo-3-1025-7B", "OLMo-3", "olmo3", 7e9, 4096, 32, 32, 32, 128, 11008, 100278, False,
       "apache-2.0", rounded=True, sliding_window=4096),
    _p("olmo-3-32b", "allenai/Olmo-3-1125-32B", "OLMo-3", "olmo3", 32e9, 5120, 64, 40, 8, 128, 27648, 100278, False,
       "apache-2.0", rounded=True, sliding_window=4096),
    _p("gpt-oss-20b", "openai/gpt-oss-20b", "gpt-oss", "gpt_oss", 20.9e9, 2880, 24, 64, 8, 64, 2880, 201088, False,
       "apache-2.0", num_local_experts=32, num_experts_per_tok=4, sliding_window=128),
    _p("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "Qwen3-MoE", "qwen3_moe", 30.5e9, 2048, 48, 32, 4, 128, 6144, 151936,
       False, "apache-2.0", non_embedding=29.9e9, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    _p("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "Llama", "llama", 70.6e9, 8192, 80, 64, 8, 128, 28672,
       128256, False, "llama3.3", gated=True),
    # multimodal checkpoints: the decoder inside is cut, the tower is kept (and counted)
    _p("gemma-3-4b", "google/gemma-3-4b-pt", "Gemma3", "gemma3", 4.3e9, 2560, 34, 8, 4, 256, 10240, 262208, True,
       "gemma", gated=True, vision=SIGLIP, sliding_window=1024),
    _p("gemma-3-12b", "google/gemma-3-12b-pt", "Gemma3", "gemma3", 12.2e9, 3840, 48, 16, 8, 256, 15360, 262208, True,
       "gemma", gated=True, vision=SIGLIP, sliding_window=1024),
    _p("gemma-3-27b", "google/gemma-3-27b-pt", "Gemma3", "gemma3", 27.4e9, 5376, 62, 32, 16, 128, 21504, 262208,
       True, "gemma", gated=True, vision=SIGLIP, sliding_window=1024, query_pre_attn_scalar=168),
    _p("gemma-4-e2b", "google/gemma-4-E2B", "Gemma4", "gemma4", 5.1e9, 1536, 35, 8, 1, 256, 6144, 262144, True,
       "apache-2.0", vision=GEMMA4_VISION, audio=GEMMA4_AUDIO | {"output_proj_dims": 1536}, **GEMMA4_SMALL,
       num_kv_shared_layers=20, use_double_wide_mlp=True,
       layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7),
    _p("gemma-4-e4b", "google/gemma-4-E4B", "Gemma4", "gemma4", 8e9, 2560, 42, 8, 2, 256, 10240, 262144, True,
       "apache-2.0", rounded=True, vision=GEMMA4_VISION, audio=GEMMA4_AUDIO | {"output_proj_dims": 2560},
       **GEMMA4_SMALL, num_kv_shared_layers=18, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7),
    _p("gemma-4-26b-a4b", "google/gemma-4-26B-A4B", "Gemma4", "gemma4", 25.2e9, 2816, 30, 16, 8, 256, 2112, 262144,
       True, "apache-2.0", vision=GEMMA4_LARGE_VISION, card_decoder_only=True, **GEMMA4_26B),
    _p("qwen3.5-9b", "Qwen/Qwen3.5-9B", "Qwen3.5", "qwen3_5", 9e9, 4096, 32, 16, 4, 256, 12288, 248320, False,
       "apache-2.0", rounded=True, vision=QWEN35_VISION | {"out_hidden_size": 4096}, linear_num_value_heads=32),
    _p("qwen3.5-27b", "Qwen/Qwen3.5-27B", "Qwen3.5", "qwen3_5", 27e9, 5120, 64, 24, 4, 256, 17408, 248320, False,
       "apache-2.0", rounded=True, vision=QWEN35_VISION | {"out_hidden_size": 5120}, linear_num_value_heads=48),
)}


def get_preset(name: str) -> Preset:
    """A preset by key or Hub id; GhostedError listing the known ones."""
    for preset in PRESETS.values():
        if name in (preset.key, preset.hub_id):
            return preset
    raise GhostedError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")


def config_for(model: str, local_folders: bool = True) -> PretrainedConfig:
    """The config of a run's model: a preset's written-down numbers (no download), else `model.loading.peek_config`."""
    for preset in PRESETS.values():
        if model in (preset.key, preset.hub_id):
            return preset.config()
    return peek_config(model, local_folders)


def gpu_seconds(options: RunOptions, depths: tuple[int, ...] | None = None) -> int:
    """The `@spaces.GPU(duration=…)` of one run (or sweep) of `options`, from its model's config (see
    `planning.estimate.gpu_duration`); GhostedError when it would exceed what a ZeroGPU call may hold."""
    return gpu_duration(config_for(options.model, options.load.local_folders), options, depths)


def hub_token() -> str | None:
    """The Hugging Face token this process would use (HF_TOKEN, or a saved login), None without one."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


@dataclass(frozen=True)
class PresetStatus:
    """Whether a preset can run here, why not, and what it would cost (estimates)."""

    preset: Preset
    available: bool
    reason: str  # empty when available
    memory: MemoryPlan
    seconds: TimeEstimate
    device: DeviceInfo

    def to_json(self) -> dict:
        return {"key": self.preset.key, "hub_id": self.preset.hub_id, "family": self.preset.family,
                "params": self.preset.params, "published_params": self.preset.published_params,
                "gated": self.preset.gated, "available": self.available, "reason": self.reason,
                "memory": self.memory.to_json(), "seconds": self.seconds.to_json(), "device": self.device.to_json()}


def preset_status(preset: Preset, options: RunOptions = RunOptions(), device: DeviceInfo | None = None,
                  depths: tuple[int, ...] | None = None, token: str | None = None,
                  online: bool | None = None) -> PresetStatus:
    """Memory and time estimates of `options` on `preset`, and whether it can run here (no download)."""
    device = device or current_device()
    online = hub_reachable() if online is None else online
    token = token if token is not None else hub_token()
    config = preset.config()
    memory = estimate_memory(config, options, depths, device)
    seconds = estimate_time(config, options, device, depths)
    plan = memory
    model_bytes = plan.weights_bytes + plan.activation_bytes + plan.logits_bytes  # evaluation runs it on the device
    reason = ""
    if not online:
        reason = "the Hugging Face Hub cannot be reached from here, so its weights cannot be downloaded"
    elif preset.gated and not token:
        reason = (f"{preset.hub_id} is gated: accept its terms at https://huggingface.co/{preset.hub_id} and give "
                  "a token of that account (HF_TOKEN, or hf auth login)")
    elif model_bytes > HEADROOM * device.memory_bytes:
        reason = (f"{preset.hub_id} is too big for {device.name}: its weights and one batch take about "
                  f"{model_bytes / 2**30:.1f} GiB of its {device.memory_bytes / 2**30:.1f} GiB; pick a smaller model")
    elif memory.on_device > HEADROOM * device.memory_bytes or not plan.fits:
        reason = (f"{preset.hub_id} with these settings needs about {memory.on_device / 2**30:.1f} GiB on "
                  f"{device.name} (statistics {plan.stats_bytes / 2**30:.1f} GiB for {plan.boundaries} boundaries) "
                  f"of its {device.memory_bytes / 2**30:.1f} GiB; remove fewer blocks, sweep fewer depths or ask "
                  "for fewer operators")
    return PresetStatus(preset, not reason, reason, memory, seconds, device)


def preset_statuses(options: RunOptions = RunOptions(), device: DeviceInfo | None = None,
                    depths: tuple[int, ...] | None = None) -> list[PresetStatus]:
    """Every preset's status for the app's model list (one Hub check, one device measurement)."""
    device = device or current_device()
    online, token = hub_reachable(), hub_token()
    return [preset_status(p, options, device, depths, token, online) for p in PRESETS.values()]


def check_preset(name: str, options: RunOptions = RunOptions(), device: DeviceInfo | None = None,
                 depths: tuple[int, ...] | None = None, token: str | None = None) -> Preset:
    """The preset, or a GhostedError saying why it cannot run here, before anything downloads (`token`: the
    access to judge gating by; None: this machine's own, "": none)."""
    status = preset_status(get_preset(name), options, device, depths, token)
    if not status.available:
        raise GhostedError(status.reason)
    return status.preset
