"""The config of the kept blocks: every block-describing field found on the config and made true again, held by
building a fresh model from the cut config and comparing each of its blocks with the dense block it stands for."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, Qwen2MoeConfig

from conftest import TINY_FAMILIES, TINY_LAYERS, _tiny_config, make_tiny_model
from ghosted_core.errors import GhostedError
from ghosted_core.model.layer_config import layer_fields, required_blocks, sliced_config
from ghosted_core.model.surgery import build_variant

FACTS = ("sliding_window", "is_sliding", "use_rope", "layer_type", "attention_type", "is_causal")


def block_shape(block: torch.nn.Module) -> list:
    """What a block is, independent of its position: every submodule's name and class, each parameter's shape,
    and the per-layer facts attention modules keep (window, RoPE on or off, kind)."""
    shape = []
    for name, module in block.named_modules():
        facts = {f: getattr(module, f) for f in FACTS if isinstance(getattr(module, f, None), (bool, int, str))}
        shape.append((name, type(module).__name__, sorted(facts.items())))
    shape += [(name, tuple(p.shape)) for name, p in block.named_parameters()]
    return shape


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("removed", [(1, 2), (0, 4, 5)])
def test_a_model_built_from_the_cut_config_has_the_kept_blocks(family, removed, tmp_path):
    """Every family: the cut config, saved and read back as transformers reads it, builds blocks of exactly the kind
    each kept dense block is (attention or a linear-attention, convolution or Mamba mixer; experts or a dense MLP;
    sliding window or full; RoPE on or off), and validates."""
    dense = make_tiny_model(family)
    if set(removed) & set(required_blocks(dense.config)):  # the family keeps that block: refused, with the reason
        with pytest.raises(GhostedError, match="must stay"):
            build_variant(dense, removed)
        removed = next(r for r in [(0, 3, 4), (0, 1, 4)] if not set(r) & set(required_blocks(dense.config)))
    kept = [j for j in range(TINY_LAYERS) if j not in removed]
    config = copy.deepcopy(build_variant(dense, removed).config)
    config.__dict__.pop("ghosted", None)
    config.save_pretrained(tmp_path)  # validates, as an export does
    rebuilt = AutoConfig.from_pretrained(tmp_path)  # as from_pretrained reads config.json
    cls, _ = _tiny_config(family)
    torch.manual_seed(0)
    fresh = cls(rebuilt)
    assert len(fresh.model.layers) == len(kept) == rebuilt.num_hidden_layers
    for i, j in enumerate(kept):
        assert block_shape(fresh.model.layers[i]) == block_shape(dense.model.layers[j]), (family, i, j)
    assert dense.config.num_hidden_layers == TINY_LAYERS  # the dense config is never touched


def test_fields_are_found_by_their_values():
    """Per-layer lists by their length, index lists by their name and values, steps by their rule; token-id lists of
    the same length are not about blocks."""
    config = Qwen2MoeConfig(num_hidden_layers=6, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=64, num_experts=4, decoder_sparse_step=2,
                            mlp_only_layers=[1], eos_token_id=[1, 2, 3, 4, 5, 6])
    config.my_layer_flags = [True, False, True, True, False, True]  # an unknown per-layer list: sliced
    config.skip_idxs = [2, 5]  # an unknown index list: renumbered
    fields = layer_fields(config)
    assert set(fields.per_layer) == {"layer_types", "my_layer_flags"}
    assert set(fields.index_lists) == {"mlp_only_layers", "skip_idxs"} and fields.recounts == ("max_window_layers", "decoder_sparse_step")
    cut = sliced_config(config, [0, 2, 3, 5])
    assert cut.num_hidden_layers == 4 and cut.my_layer_flags == [True, True, True, True]
    assert cut.skip_idxs == [1, 3] and cut.eos_token_id == [1, 2, 3, 4, 5, 6]
    # experts on blocks j with (j + 1) % 2 == 0 and j ∉ {1}: blocks 3 and 5; kept 0, 2, 3, 5 → dense at 0, 1
    assert cut.decoder_sparse_step == 1 and cut.mlp_only_layers == [0, 1]
    assert config.num_hidden_layers == 6 and config.mlp_only_layers == [1]  # the dense config is never touched


def test_a_heterogeneous_config_is_read_per_block_and_re_keyed_by_a_cut():
    """Gemma 4's full-attention blocks (2 and 5) have wider heads and fewer kv heads than its sliding ones: a plan
    reads the widest, and a cut re-keys the overrides to the kept blocks' new positions."""
    from ghosted_core.config_values import layer_overrides, widest

    config = _tiny_config("gemma4_text")[1]
    assert set(layer_overrides(config)) == {2, 5} and widest(config, "head_dim") == 12
    assert widest(config, "num_key_value_heads") == 2  # the sliding blocks' 2 over the full blocks' 1
    cut = sliced_config(config, [0, 1, 3, 5])
    assert layer_overrides(cut) == {3: {"head_dim": 12, "num_key_value_heads": 1}}
    assert cut.per_layer_config[3].head_dim == 12 and cut.per_layer_config[2].head_dim == 6
    assert set(layer_overrides(config)) == {2, 5}  # the dense config is never touched


def test_the_mlp_width_is_read_under_each_familys_name_for_it():
    """Plans read the MLP's inner width I whatever the config calls it: Llama's intermediate_size, Moshi's ffn_dim
    (a type outside the table that failed in the memory plan), GPT-2's n_inner, and 4·C where n_inner is None;
    Qwen3.5-MoE's experts where it names no dense width (a real config failed the plan; the tiny fixture sets one);
    a heterogeneous config's widest block."""
    import transformers

    from ghosted_core.config_values import mlp_width

    assert mlp_width(transformers.LlamaConfig(hidden_size=64, intermediate_size=176)) == 176
    assert mlp_width(transformers.MoshiConfig(hidden_size=64, ffn_dim=192)) == 192
    assert mlp_width(transformers.GPT2Config(n_embd=64, n_inner=96)) == 96
    assert mlp_width(transformers.GPT2Config(n_embd=64)) == 256
    moe = transformers.Qwen3_5MoeTextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    assert "intermediate_size" not in moe.to_dict() and mlp_width(moe) == 48  # experts only: the widest of them
    scout = transformers.Llama4TextConfig(hidden_size=64, intermediate_size=80, intermediate_size_mlp=160)
    assert mlp_width(scout) == 160  # its dense MLP blocks are twice as wide as an expert
    _, gemma4 = _tiny_config("gemma4_text", per_layer_config={"2": {"intermediate_size": 200}})
    assert mlp_width(gemma4) == max(200, gemma4.to_dict()["intermediate_size"])
