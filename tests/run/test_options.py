"""Tests for ghosted_core.run.options: the memory plan before and after loading is the same plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from ghosted_core import memory
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.model.loading import load_model
from ghosted_core.run.options import RunOptions, memory_plan, parse_variants, planned
from ghosted_core.run.pipeline import run

GIB = 2**30
# Qwen2.5-14B's published shapes: 14.8B parameters, 27.5 GiB in bf16, 55 GiB in fp32
QWEN_14B = Qwen2Config(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)
VOLATILE = {"device_available", "host_available"}  # measured, not counted


def _counts(plan: memory.MemoryPlan) -> dict:
    """Everything the plan counted or chose (what it measured left out)."""
    return {k: v for k, v in dataclasses.asdict(plan).items() if k not in VOLATILE} | {"fits": plan.fits}


def test_qwen_14b_on_a_47_gib_gpu_plans_the_same_before_and_after_loading():
    options = RunOptions(model="Qwen/Qwen2.5-14B", train_size=64)
    weights = estimate_parameters(QWEN_14B) * 2  # bf16
    before = memory_plan(options, QWEN_14B, "cuda", torch.bfloat16, device_available=47 * GIB,
                         host_available=64 * GIB)
    after = memory_plan(options, QWEN_14B, "cuda", torch.bfloat16, device_available=47 * GIB - weights,
                        host_available=64 * GIB, resident=(0, weights))
    assert before.pipeline == "full" and before.fits
    assert _counts(after) == _counts(before)  # full, not the slower blocks; the same bytes everywhere


def test_qwen_14b_on_a_100_gib_cpu_fits_after_loading_too():
    options = RunOptions(model="Qwen/Qwen2.5-14B", train_size=64)
    weights = estimate_parameters(QWEN_14B) * 4  # fp32: about 55 GiB
    assert 54 * GIB < weights < 56 * GIB
    before = memory_plan(options, QWEN_14B, "cpu", torch.float32, host_available=100 * GIB)
    after = memory_plan(options, QWEN_14B, "cpu", torch.float32, host_available=100 * GIB - weights,
                        resident=(weights, 0))
    assert before.fits and _counts(after) == _counts(before)


def test_a_run_plans_the_same_before_and_after_loading_the_model(tiny_model_folder, monkeypatch):
    """On a machine whose free memory drops by what the loaded model holds, the plan made after loading
    (by `planned`, and the one results.json records) equals the plan made before: pipeline, verdict, bytes."""
    options = RunOptions(model=str(tiny_model_folder), num_prune=2, variants=parse_variants("none,ghost,replaceme"),
                         calibration="ptb", train_size=4, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=64,
                         quiet=True, calibrate=CalibrationOptions(quiet=True))
    loaded_models = []

    def free(device: str) -> int:  # what is free falls by what every loaded model holds
        return budget - sum(memory.resident_bytes(m)[0] for m in loaded_models)

    monkeypatch.setattr(memory, "available_bytes", free)
    budget = 1 << 62
    _, sized_plan = planned(options)
    weights = sized_plan.weights_bytes
    budget = int(sized_plan.host_bytes / memory.HEADROOM + weights / 2)  # fits, but not with the weights twice
    placed, before = planned(options)
    loaded = load_model(options.model)
    loaded_models.append(loaded.model)
    assert memory.resident_bytes(loaded.model)[0] >= weights * 0.9
    placed_after, after = planned(options, loaded)
    assert before.fits and _counts(after) == _counts(before)
    assert placed_after == placed
    result = run(options, loaded)  # its results.json plan is made once the blocks are chosen, model loaded
    recorded = result.memory_plan
    assert recorded.fits and recorded.pipeline == before.pipeline
    assert recorded.host_bytes == memory_plan(options, loaded.model.config, "cpu", torch.float32,
                                              boundaries=1, host_available=budget).host_bytes


@pytest.mark.parametrize("device, gpu, fits, expected", [
    ("cpu", False, True, "full"), ("cuda", True, True, "full"), ("cuda", True, False, "blocks"),
    ("map", True, True, "blocks"), ("map", False, True, "full")])
def test_auto_is_resolved_by_one_rule(device, gpu, fits, expected):
    assert memory.choose_pipeline("auto", device, gpu, fits) == expected
    assert memory.choose_pipeline("blocks", device, gpu, fits) == "blocks"
