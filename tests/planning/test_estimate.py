"""Memory and time estimates: the statistics formula against what calibration allocates, and how estimates scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import TINY_WIDTH, random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.planning.estimate import ZEROGPU_MAX_SECONDS, ZEROGPU_MIN_SECONDS, DeviceInfo, current_device, \
    estimate_memory, estimate_time, gpu_duration, workload
from ghosted_core.run.options import statistics_bytes_per_boundary
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.recovery.operators import needs_of
from ghosted_core.run.options import RunOptions
from ghosted_core.plan import Boundary
from ghosted_core.planning.presets import get_preset

DEVICE = DeviceInfo("test GPU", "cuda", 80 * 2**30, 400e12, 30e12, "assumed (test)")


def test_statistics_formula_equals_what_calibration_allocates(tiny_llama):
    ids = random_tokens(4, 16)
    options = RunOptions(train_size=4)
    needs = needs_of(v.operator for v in options.variants)
    live = []
    collect_stats(tiny_llama, [Boundary(0, 1), Boundary(1, 3), Boundary(4, 5)], make_batches(ids, ids[:2], 2),
                  CalibrationOptions(quiet=True), needs, live)
    config = tiny_llama.config  # the default operators include the down_proj refit: its I×I statistics count
    assert [acc.nbytes() for acc in live] == [statistics_bytes_per_boundary(TINY_WIDTH, options, False, config),
                                              *2 * [statistics_bytes_per_boundary(TINY_WIDTH, options, True, config)]]


def test_memory_estimate_plans_every_boundary_of_a_sweep_at_once():
    config = get_preset("llama-3.1-8b").config()
    options = RunOptions(model="meta-llama/Llama-3.1-8B", train_size=64)
    single = estimate_memory(config, options, device=DEVICE)
    per_boundary = statistics_bytes_per_boundary(4096, options, config=config)
    assert single.weights_bytes == estimate_parameters(config) * 2 and single.stats_bytes == per_boundary
    assert single.stats_bytes_per_boundary == per_boundary and single.kept_states_bytes == 0
    sweep = estimate_memory(config, options, (2, 4, 6, 8, 10), device=DEVICE)
    assert sweep.stats_bytes == 5 * single.stats_bytes  # streamline: one boundary per depth, all alive in the pass
    assert sweep.kept_states_bytes == 5 * 2 * 8192 * 4096 * 2  # two corpora × 8192 tokens × C × bf16 per depth
    assert sweep.on_device == sweep.device_bytes >= single.device_bytes + sweep.kept_states_bytes
    shortgpt = estimate_memory(config, replace(options, criterion="shortgpt"), (2, 4), device=DEVICE)
    assert shortgpt.stats_bytes == 6 * single.stats_bytes  # worst case: a boundary per removed block
    cpu = estimate_memory(config, options)
    assert cpu.weights_bytes == 2 * single.weights_bytes and cpu.on_device == cpu.host_bytes  # fp32 on the CPU


def test_time_estimate_scales_with_tokens_depths_and_device():
    config = get_preset("qwen2.5-7b").config()
    options = RunOptions(train_size=64, seqlen=512)
    base = estimate_time(config, options, DEVICE)
    double = estimate_time(config, replace(options, train_size=128), DEVICE)
    assert double.score == pytest.approx(2 * base.score)
    assert base.calibrate < double.calibrate < 2.2 * base.calibrate
    sweep = estimate_time(config, options, DEVICE, (2, 4, 6, 8, 10))
    assert sweep.score == base.score and sweep.perplexity > base.perplexity and sweep.fit == pytest.approx(5 * base.fit)
    slower = estimate_time(config, options, replace(DEVICE, matmul_flops=DEVICE.matmul_flops / 4))
    assert slower.score == pytest.approx(4 * base.score)
    assert workload(config, options).fit_tokens == 64 * 512


def test_gpu_duration_is_clamped_and_refuses_what_no_call_can_hold():
    small = get_preset("qwen2.5-0.5b").config()
    assert gpu_duration(small, RunOptions(train_size=8, seqlen=256), device=DEVICE) == ZEROGPU_MIN_SECONDS
    big = get_preset("qwen3-8b").config()
    slow = replace(DEVICE, matmul_flops=20e12)
    seconds = gpu_duration(big, RunOptions(train_size=16, seqlen=512), device=slow)
    assert ZEROGPU_MIN_SECONDS < seconds <= ZEROGPU_MAX_SECONDS
    assert seconds >= 1.5 * estimate_time(big, RunOptions(train_size=16, seqlen=512), slow).total - 1
    with pytest.raises(GhostedError, match="more than the"):
        gpu_duration(big, RunOptions(train_size=512, seqlen=2048, eval_max_tokens=None), (2, 4, 6, 8), device=slow)


def test_current_device_measures_this_cpu():
    device = current_device("cpu")
    assert device.kind == "cpu" and device.memory_bytes > 2**30 and "measured" in device.source
    assert device.matmul_flops > 1e8 and device.fp64_flops > 1e8
    zero = current_device("zerogpu")
    assert zero.kind == "cuda" and "assumed" in zero.source and zero.memory_bytes == 70 * 10**9
