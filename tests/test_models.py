"""Models: resolving names, clear refusals, architecture support, memory estimates."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from conftest import TINY_LAYERS, make_tiny_model
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from ghosted_core.models import EMBEDDED, LoadOptions, check_fits, decoder_blocks, estimate_parameters, load_model


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_reachable.cache_clear()
    yield
    hub_reachable.cache_clear()


def test_unknown_model_names_the_alternatives():
    with pytest.raises(GhostedError, match="unknown model 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model")


def test_hub_id_offline_says_what_to_do():
    with pytest.raises(GhostedError, match="Hub is not reachable.*local model folder or an embedded model"):
        load_model("meta-llama/Llama-3.1-8B")


def test_folder_without_config(tmp_path):
    with pytest.raises(GhostedError, match="without config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_is_refused(tmp_path):
    GPT2Config(n_layer=2, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(GhostedError, match="unsupported architecture 'gpt2'.*Gemma3, Llama, Mistral, Qwen2, Qwen3"):
        load_model(str(tmp_path))


def test_local_folder_loads_in_eval_mode(tiny_model_folder):
    loaded = load_model(str(tiny_model_folder), LoadOptions(device="cpu"))
    assert loaded.source == "local" and loaded.num_layers == TINY_LAYERS
    assert not loaded.model.training and loaded.model.dtype == torch.float32
    assert not any(p.requires_grad for p in loaded.model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_parameter_estimate_matches_the_model(family):
    model = make_tiny_model(family)
    assert len(decoder_blocks(model)) == TINY_LAYERS
    actual = sum(p.numel() for p in model.parameters())
    assert estimate_parameters(model.config) == pytest.approx(actual, rel=0.02)


def test_a_model_too_big_is_refused_before_loading():
    huge = LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                       num_attention_heads=128, num_key_value_heads=8)
    with pytest.raises(GhostedError, match="needs about .* GiB.*--device map"):
        check_fits(huge, "cpu", torch.float32, "meta-llama/Llama-3.1-405B")
    check_fits(huge, "map", torch.float32, "meta-llama/Llama-3.1-405B")  # offload may take it


def test_bad_device_and_dtype():
    with pytest.raises(GhostedError, match="unknown device"):
        load_model("smollm2-135m", LoadOptions(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(GhostedError, match="no CUDA GPU"):
            load_model("smollm2-135m", LoadOptions(device="cuda"))


def test_embedded_registry():
    assert {"smollm2-135m", "gemma3-270m"} <= set(EMBEDDED)
