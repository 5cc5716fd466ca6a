"""Hub presets: the written-down config numbers agree with the published sizes, and a preset that cannot run says why."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.planning.estimate import DeviceInfo
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.run.options import RunOptions
from ghosted_core.planning.presets import PRESETS, check_preset, config_for, get_preset, preset_status, \
    preset_statuses

BIG_GPU = DeviceInfo("test GPU", "cuda", 80 * 2**30, 400e12, 30e12, "assumed (test)")
SMALL_GPU = DeviceInfo("small test GPU", "cuda", 8 * 2**30, 100e12, 5e12, "assumed (test)")
# 24 GiB: the default operators include the down_proj refit, whose I×I statistics (Qwen2.5-3B: 1.3 GiB per
# boundary) put a 7-boundary ShortGPT run of a 3B model past 12 GiB
MID_GPU = DeviceInfo("mid test GPU", "cuda", 24 * 2**30, 100e12, 5e12, "assumed (test)")


@pytest.mark.parametrize("key", list(PRESETS))
def test_parameter_count_from_the_shapes_matches_the_published_size(key):
    preset = PRESETS[key]
    with torch.device("meta"):  # the real architecture, no memory: count what transformers would allocate
        model = (AutoModelForImageTextToText if preset.vision else AutoModelForCausalLM).from_config(
            preset.checkpoint_config())  # a multimodal checkpoint whole: decoder, tower and projector
    counted = sum(p.numel() for p in model.parameters())  # tied embeddings appear once
    assert counted == preset.params  # estimate_parameters counts what transformers builds
    # the card's count: the whole checkpoint, or the text decoder alone where the card lists the tower apart
    carded = sum(p.numel() for name, p in model.named_parameters()
                 if ".language_model." in name or name.startswith("lm_head")) if preset.card_decoder_only else counted
    if preset.rounded:  # "7B": anything that rounds to it
        assert abs(carded - preset.published_params) <= 0.5e9
    else:
        assert carded == pytest.approx(preset.published_params, rel=0.015)  # cards round to 2-3 digits
    if preset.published_non_embedding:
        embeddings = preset.vocab_size * preset.hidden_size * (1 if preset.tied_embeddings else 2)
        assert counted - embeddings == pytest.approx(preset.published_non_embedding, rel=0.015)
    assert model.config.model_type == preset.model_type
    assert model.config.get_text_config().num_hidden_layers == preset.num_layers == preset.config().num_hidden_layers


def test_presets_span_the_curated_list():
    sizes = [p.published_params for p in PRESETS.values()]
    assert min(sizes) == pytest.approx(0.36e9, rel=0.01) and max(sizes) == pytest.approx(70.6e9)
    families = {p.family for p in PRESETS.values()}
    assert {"Qwen3-MoE", "gpt-oss", "OLMo-3", "SmolLM3", "Phi-3", "Gemma3", "Qwen3.5"} <= families  # 2025-26
    assert {p.key for p in PRESETS.values() if p.vision} == {"gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "qwen3.5-9b",
                                                               "qwen3.5-27b", "gemma-4-e2b", "gemma-4-e4b",
                                                               "gemma-4-26b-a4b"}  # multimodal
    gated = {p.key for p in PRESETS.values() if p.gated}
    assert {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"} <= gated
    assert not {p.key for p in PRESETS.values() if p.family == "Qwen3" or "smollm2" in p.key} & gated
    assert get_preset("Qwen/Qwen2.5-7B") is get_preset("qwen2.5-7b")
    with pytest.raises(GhostedError, match="unknown preset"):
        get_preset("gpt-5")


def test_offline_every_preset_is_unavailable_and_says_why():
    statuses = preset_statuses(RunOptions(), BIG_GPU)  # HF_HUB_OFFLINE=1 in the tests
    assert len(statuses) == len(PRESETS)
    for status in statuses:
        assert not status.available and "cannot be reached" in status.reason
        assert status.memory.weights_bytes == status.preset.params * 2  # bf16 on a GPU
        assert status.seconds.total > 0
        assert status.to_json()["available"] is False


def test_gated_without_a_token_or_too_big_is_refused_before_any_download():
    llama = get_preset("llama-3.1-8b")
    no_token = preset_status(llama, RunOptions(), BIG_GPU, token="", online=True)
    assert not no_token.available and "gated" in no_token.reason and "token" in no_token.reason
    assert preset_status(llama, RunOptions(), BIG_GPU, token="hf_x", online=True).available
    too_big = preset_status(get_preset("qwen2.5-7b"), RunOptions(), SMALL_GPU, token="", online=True)
    assert not too_big.available and "too big for small test GPU" in too_big.reason and "8.0 GiB" in too_big.reason
    on_gpu = RunOptions(criterion="shortgpt", calibrate=CalibrationOptions(stats_device="cuda"))
    qwen3b = get_preset("qwen2.5-3b")
    assert preset_status(qwen3b, on_gpu, MID_GPU, token="", online=True).available
    crowded = preset_status(qwen3b, on_gpu, MID_GPU, (2, 4, 6, 8, 10), token="", online=True)
    assert crowded.memory.boundaries == 2 + 4 + 6 + 8 + 10  # ShortGPT at its worst: a boundary per block
    assert not crowded.available and "sweep fewer depths" in crowded.reason  # every depth's statistics at once
    small = preset_status(get_preset("qwen2.5-0.5b"), RunOptions(), SMALL_GPU, token="", online=True)
    assert small.available and small.reason == ""
    with pytest.raises(GhostedError, match="cannot be reached"):
        check_preset("qwen2.5-0.5b", RunOptions(), SMALL_GPU)


def test_config_for_uses_the_preset_numbers_without_the_hub():
    config = config_for("Qwen/Qwen3-8B")
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (4096, 36, 128)
    assert estimate_parameters(config) == get_preset("qwen3-8b").params
    assert config_for("smollm2-135m").num_hidden_layers == 30  # the embedded model's own config
