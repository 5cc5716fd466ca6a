"""export_config: the per-layer lists still at the dense length are sliced with the removed blocks, by the same rule
surgery uses (`model.layer_config`); lists that are not about blocks are left as they are."""

from __future__ import annotations

from transformers import Qwen2Config

from ghosted_core.export.checkpoint import export_config


def test_only_per_layer_fields_are_sliced():
    """A 4-block export of a 6-block Qwen2: `layer_types` and a made-up per-layer list lose blocks 1 and 2; the token
    ids, six of them, are left as they are."""
    config = Qwen2Config(num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64, eos_token_id=[10, 11, 12, 13, 14, 15])
    config.layer_types = ["full_attention", "sliding_attention"] * 3  # still at the dense length
    config.my_layer_flags = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    values = export_config(config, {"removed_layers": [1, 2]})
    assert values["num_hidden_layers"] == 4
    assert values["layer_types"] == ["full_attention", "sliding_attention"] * 2  # blocks 0, 3, 4, 5
    assert values["my_layer_flags"] == [0.5, 2.0, 2.5, 3.0]
    assert values["eos_token_id"] == [10, 11, 12, 13, 14, 15]
