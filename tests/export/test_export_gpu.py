"""Exports from a GPU: weights spread over GPU, CPU and disk by accelerate, and bf16 remote-code models (CUDA only)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_tiny_model, random_tokens
from ghosted_core.export.folder import export_variant, load_recovered
from ghosted_core.model.loading import LoadOptions, load_model
from conftest import recovered_variants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_export_gathers_weights_from_gpu_cpu_and_disk(tmp_path):
    folder = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(folder)
    loaded = load_model(str(folder), LoadOptions(device="map", dtype="float32",
                                                 max_memory={0: 150_000, "cpu": 150_000},
                                                 offload_folder=str(tmp_path / "offload")))
    placed = set(loaded.model.hf_device_map.values())
    assert {0, "cpu", "disk"} <= placed or {0, "disk"} <= placed, placed
    _plan, variants = recovered_variants(loaded.model, (2, 3))
    ids = random_tokens(2, 10, seed=5)
    for name, mode in (("none", "stock"), ("replaceme", "stock"), ("replaceme_keepsink", "stock"),
                       ("ghost_capped", "remote_code")):
        result = export_variant(variants[name], None, tmp_path / name)
        assert result.mode == mode
        reloaded, _ = load_recovered(result.folder)  # on the CPU
        with torch.no_grad():
            expected = variants[name](ids.to("cuda:0")).logits.cpu()
            gap = float((reloaded(ids).logits - expected).abs().max() / expected.abs().max())
        assert gap <= 1e-4, (name, gap)


def test_bf16_remote_code_export_loads_on_the_gpu_with_float32_operators(tmp_path):
    folder = tmp_path / "tiny"
    make_tiny_model("qwen2").save_pretrained(folder)
    loaded = load_model(str(folder), LoadOptions(device="cuda", dtype="bfloat16"))
    _plan, variants = recovered_variants(loaded.model, (2, 3))
    result = export_variant(variants["ghost_capped"], None, tmp_path / "ghost_capped")
    model = AutoModelForCausalLM.from_pretrained(result.folder, trust_remote_code=True, dtype=torch.bfloat16,
                                                 device_map="cuda:0")
    assert model.model.layers[2].patch.weight.dtype == torch.float32
    assert model.model.layers[2].inner.mlp.down_proj.weight.dtype == torch.bfloat16
    ids = random_tokens(2, 10, seed=6).to("cuda:0")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, variants["ghost_capped"](ids).logits, rtol=0, atol=0)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **greedy), variants["ghost_capped"].generate(ids[:1], **greedy))
