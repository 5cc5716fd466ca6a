"""Tiny random multimodal checkpoints (a text decoder of 6 blocks inside its wrapper, a 2-block vision tower),
saved as local folders: what the multimodal tests cut and export."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForImageTextToText

from conftest import LINEAR_ATTENTION, TINY_INNER, TINY_WIDTH

TEXT = dict(hidden_size=TINY_WIDTH, intermediate_size=TINY_INNER, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, head_dim=6, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
# wrapper type -> (text config values beyond TEXT, wrapper values, the stock folds its text family takes)
WRAPPERS = {
    "gemma3": (dict(sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
               dict(mm_tokens_per_image=4), "magcomp"),  # ReplaceMe does not fold past the post-norm
    "mistral3": (dict(sliding_window=None), {}, "magcomp,replaceme"),
    "gemma4": (dict(sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                    global_head_dim=12, num_global_key_value_heads=1, attention_k_eq_v=True,
                    hidden_size_per_layer_input=0), dict(vision=dict(num_key_value_heads=4, head_dim=8)), "magcomp"),
    # E2B/E4B: per-layer embeddings of the tokens, and the last 2 blocks attending with blocks 2's and 3's keys
    "gemma4 (E2B)": (dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                                                   "full_attention"],
                          global_head_dim=12, hidden_size_per_layer_input=4, num_kv_shared_layers=2,
                          use_double_wide_mlp=True), dict(vision=dict(num_key_value_heads=4, head_dim=8)), ""),
    # (magcomp is refused: its blocks gate the per-layer embeddings with the raw stream)
    # Gemma 4 Unified: Gemma 4's dense blocks with shared KV (blocks 2 and 3 store it for the last two)
    "gemma4_unified": (dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                                                    "full_attention"],
                            global_head_dim=12, num_kv_shared_layers=2,
                            moe_intermediate_size=None), {}, "magcomp"),  # (as its checkpoints' config.json)
    "llama4": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=48, moe_layers=[1, 3, 5],
                    no_rope_layers=[1, 1, 1, 0, 1, 1], attention_chunk_size=8),
               dict(vision=dict(vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)), "magcomp"),
    "qwen3_5": (dict(LINEAR_ATTENTION, layer_types=["linear_attention", "full_attention"] * 3), {},
                "magcomp,replaceme"),
    "qwen3_5_moe": (dict(LINEAR_ATTENTION, layer_types=["linear_attention", "full_attention"] * 3, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24), {},
                    "magcomp"),
}


def tiny_wrapper_folder(model_type: str, tokenizer, folder):
    """A random multimodal checkpoint of `model_type` (6 text blocks), saved with SmolLM2's tokenizer."""
    text_values, outer, _ = WRAPPERS[model_type]
    outer = dict(outer)
    vision_values = outer.pop("vision", {})
    config_cls = transformers.CONFIG_MAPPING[model_type.split()[0]]
    defaults = config_cls()
    text = {k: v for k, v in defaults.text_config.to_dict().items() if k not in ("layer_types", "per_layer_config")}
    # (Gemma 4's vision tower is optional: its class's defaults then)
    vision = (defaults.vision_config or config_cls.sub_configs["vision_config"]()).to_dict()
    vocab = {"vocab_size": len(tokenizer)} | ({"vocab_size_per_layer_input": len(tokenizer)}
                                              if text_values.get("hidden_size_per_layer_input") else {})
    config = config_cls(text_config=text | TEXT | text_values | vocab,
                        vision_config=vision | {k: v for k, v in VISION.items() if k in vision} | vision_values,
                        **outer)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
