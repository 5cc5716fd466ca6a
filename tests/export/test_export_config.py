"""export_config: only the family's per-layer fields are sliced with the removed blocks."""

from __future__ import annotations

from transformers import Qwen2Config

from ghosted_core.export.checkpoint import export_config


def test_only_per_layer_fields_are_sliced():
    """A 4-block export of a 6-block Qwen2: `layer_types` loses blocks 1 and 2; a list that merely has six
    entries (here a made-up `bad_words_ids`-like field) is left as it is."""
    config = Qwen2Config(num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    config.layer_types = ["full_attention", "sliding_attention"] * 3  # still at the dense length
    config.not_per_layer = [10, 11, 12, 13, 14, 15]
    values = export_config(config, {"removed_layers": [1, 2]})
    assert values["num_hidden_layers"] == 4
    assert values["layer_types"] == ["full_attention", "sliding_attention"] * 2  # blocks 0, 3, 4, 5
    assert values["not_per_layer"] == [10, 11, 12, 13, 14, 15]
