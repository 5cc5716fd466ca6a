"""The memory plan: counted from the config before loading, equal to what is allocated, refusing what cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from conftest import TINY_WIDTH, random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.errors import GhostedError
from ghosted_core.memory import MemoryPlan, PlanRequest, plan_memory
from ghosted_core.memory_parts import block_parameters, estimate_parameters, max_boundaries, min_calibration_sequences
from ghosted_core.recovery.operators import needs_of
from ghosted_core.run.options import RunOptions, memory_plan, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.plan import Boundary
from ghosted_core.statistics import StatNeeds

GIB = 2**30
LLAMA_3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LLAMA_3_70B = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LEAN = needs_of(["none", "diag", "rotate", "ghost", "ghost_capped"])


def test_parameter_counts_match_the_published_sizes():
    assert estimate_parameters(LLAMA_3_8B) == pytest.approx(8.03e9, rel=0.01)
    assert estimate_parameters(LLAMA_3_70B) == pytest.approx(70.6e9, rel=0.01)
    assert block_parameters(LLAMA_3_8B) == 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336 + 2 * 4096


def test_plan_statistics_equal_what_the_accumulators_allocate(tiny_llama):
    """The plan's per-boundary bytes (from the config) are what collect_stats allocated, boundary by boundary."""
    for operators in (["none", "diag", "rotate", "ghost", "ghost_capped"], ["replaceme", "ghost_nosink"]):
        options = CalibrationOptions(quiet=True)
        needs = needs_of(operators)
        ids = random_tokens(6, 12)
        live = []
        collect_stats(tiny_llama, [Boundary(1, 2), Boundary(3, 5)], make_batches(ids, None, 3), options, needs, live)
        plan = plan_memory(tiny_llama.config, "tiny", "cpu", torch.float32,
                           PlanRequest(needs, boundaries=2, sequences=6, seqlen=12, batch_size=3,
                                       sink_capacity=options.capacity(6)))
        assert [acc.nbytes() for acc in live] == [plan.stats_bytes_per_boundary] * 2
        assert plan.stats_bytes == 2 * plan.stats_bytes_per_boundary


def test_the_issue_target_at_c_4096():
    """none, diag, rotate, ghost, ghost_capped at one boundary: 2·C²·8 B plus O(C × kept rows)."""
    plan = plan_memory(LLAMA_3_8B, "8B", "cpu", torch.float32, PlanRequest(LEAN, 1, 32, 512, 8, 128),
                       host_available=1 << 50)
    matrices = 2 * 4096**2 * 8
    per_basis = (10 + 1) * 4096 * 8 + 8  # 10 sums and the per-window ratio (C each), and a window count
    assert matrices <= plan.stats_bytes_per_boundary <= matrices + 128 * (2 * 4096 + 1) * 8 + 2 * per_basis + 16
    assert plan.stats_bytes_per_boundary / 2**20 < 280


def test_plan_refuses_a_model_bigger_than_the_gpu_and_names_the_way_out():
    plan = plan_memory(LLAMA_3_8B, "llama-8b", "cuda", torch.bfloat16, PlanRequest(LEAN, 4, 32, 512, 8, 128, pipeline="full"),
                       device_available=12 * GIB, host_available=64 * GIB)
    assert not plan.fits
    with pytest.raises(GhostedError) as err:
        plan.check()
    message = str(err.value)
    assert "\n" not in message
    for way_out in ("--device map", "--stats_device cpu", "--batch_size", "--calibration_pipeline blocks"):
        assert way_out in message


def test_auto_placement_follows_the_room_on_the_gpu():
    def plan(free_gib: float, **kwargs) -> MemoryPlan:
        return plan_memory(LLAMA_3_8B, "llama-8b", "cuda", torch.bfloat16, PlanRequest(LEAN, 4, 32, 512, 8, 128, **kwargs),
                           device_available=int(free_gib * GIB), host_available=64 * GIB)
    roomy = plan(80)
    assert (roomy.pipeline, roomy.stats_device) == ("full", "cuda") and roomy.fits
    tight = plan(18.5)  # 16 GB of weights and a batch fit, 4 boundaries of statistics next to them do not
    assert (tight.pipeline, tight.stats_device) == ("full", "cpu") and tight.fits
    small = plan(6)  # not even the weights: one block at a time
    assert small.pipeline == "blocks" and small.fits and small.hidden_cache_bytes > 0
    assert small.device_bytes < 6 * GIB < small.weights_bytes
    assert plan(80, stats_device="cpu").stats_device == "cpu"


def test_seventy_b_calibrates_block_by_block_on_one_80_gb_gpu():
    plan = plan_memory(LLAMA_3_70B, "llama-70b", "cuda", torch.bfloat16, PlanRequest(LEAN, 1, 128, 2048, 4, 512),
                       device_available=80 * GIB, host_available=512 * GIB)
    assert plan.pipeline == "blocks" and plan.fits
    assert plan.weights_bytes > 80 * GIB > plan.device_bytes


def test_boundary_bounds_and_calibration_size():
    assert max_boundaries("streamline", 32, 7) == 1
    assert max_boundaries("shortgpt", 32, 7) == 7
    assert max_boundaries("shortgpt", 8, 6) == 3
    assert max_boundaries("manual", 32, 0, (3, 4, 9)) == 2
    assert min_calibration_sequences(4096, 512) == 64
    assert min_calibration_sequences(4096, 512, floor=1) == 32
    assert min_calibration_sequences(8192, 256) == 128


def test_run_records_the_plan_and_its_choices(tiny_model_folder):
    options = RunOptions(model=str(tiny_model_folder), num_prune=2, variants=parse_variants("none,ghost"),
                         calibration="ptb", train_size=4, seqlen=32, eval_corpora=(), quiet=True,
                         calibrate=CalibrationOptions(quiet=True))
    result = run(options)
    report = result.to_json()
    plan = report["memory_plan"]
    assert plan["fits"] and plan["pipeline"] == "full" and plan["boundaries"] == 1
    assert plan["stats_needs"] == StatNeeds(residual=True).describe()
    assert report["calibration"]["pipeline"] == "full"
    assert json.loads(json.dumps(report))["memory_plan"]["weights_bytes"] == plan["weights_bytes"]
    assert result.memory_plan.summary().startswith("memory plan: weights")
    assert memory_plan(options, result.models["dense"].config).boundaries == 1


def test_cli_refuses_a_too_big_model_before_loading_it(tmp_path):
    """A folder holding only a config: the plan refuses it, so no weight is ever looked for."""
    LLAMA_3_70B.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    done = subprocess.run([sys.executable, "-m", "ghosted_core", "--model", str(tmp_path), "--device", "cpu",
                           "--eval_ppl", "none"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not fit in memory" in lines[0] and "--device map" in lines[0], lines


def test_tiny_widths_stay_tiny():
    assert plan_memory(LlamaConfig(hidden_size=TINY_WIDTH, intermediate_size=72, num_hidden_layers=6,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=97), "tiny", "cpu",
                       torch.float32, PlanRequest(LEAN, 1, 4, 12, 2, 64)).stats_bytes_per_boundary < 2**20


def test_blocks_pipeline_through_the_run_gives_the_full_runs_numbers(tiny_model_folder):
    def go(pipeline: str):
        options = RunOptions(model=str(tiny_model_folder), num_prune=2, variants=parse_variants("none,ghost,replaceme"),
                             calibration="ptb", train_size=4, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=96,
                             quiet=True, calibrate=CalibrationOptions(quiet=True, pipeline=pipeline))
        return run(options).to_json()
    full, blocks = go("full"), go("blocks")
    assert (full["calibration"]["pipeline"], blocks["calibration"]["pipeline"]) == ("full", "blocks")
    for name in ("ghost", "replaceme"):
        a, b = full["variants"][name], blocks["variants"][name]
        assert b["boundary_error"][0]["heldout"] == pytest.approx(a["boundary_error"][0]["heldout"], rel=1e-8)
        assert b["ppl"]["ptb"] == pytest.approx(a["ppl"]["ptb"], rel=1e-6)


def test_plan_counts_what_every_variant_keeps(tiny_llama, tiny_gemma):
    """The plan's variant bytes equal what the built variants hold per boundary: each realized module's
    tensors (fp32 C×C maps, rotate's dense map, per-channel scales, the folded down_proj copy; Gemma-3's
    replaceme map after the post-norm) and each fit's compacted map for the held-out pass."""
    from ghosted_core.recovery.operators import FitOptions, get_operator
    from ghosted_core.run.fitting import VariantBuild
    from ghosted_core.run.options import VariantSpec, plan_request
    from ghosted_core.memory_parts import kept_bytes

    operators = ["none", "diag", "rotate", "ghost", "ghost_capped", "replaceme", "replaceme_keepsink"]
    for model in (tiny_llama, tiny_gemma):
        boundary = Boundary(2, 4)
        (stats,) = collect_stats(model, [boundary], make_batches(random_tokens(6, 16), None, 3),
                                 CalibrationOptions(quiet=True), needs_of(operators))
        for name in operators:
            build = VariantBuild(VariantSpec(name, name))
            build.add(model, get_operator(name).fit(stats, FitOptions()), stats)
            modules = [*build.patches.values(), *(m for r in build.replacements.values() for m in r.values())]
            if name in ("replaceme", "replaceme_keepsink") and model is tiny_gemma:
                modules = [m[1] for m in modules]  # Sequential(post-norm, map): the norm is the dense model's own
            held = sum(t.numel() * t.element_size() for m in modules for t in m.parameters())
            (map_,) = build.maps
            kept_map = sum(t.numel() * t.element_size() for t in (map_.update, map_.scale) if t is not None)
            assert kept_bytes(get_operator(name).cost, model.config, 4) == (kept_map, held), (model.config.model_type, name)
        options = RunOptions(variants=parse_variants(",".join(operators)), train_size=6, seqlen=16)
        request = plan_request(options, model.config, boundaries=1)
        plan = plan_memory(model.config, "tiny", "cpu", torch.float32, request, host_available=1 << 40)
        assert plan.variant_bytes == sum(sum(kept_bytes(get_operator(n).cost, model.config, 4)) for n in operators)


def test_plan_counts_the_masks_the_blocks_pipeline_records(tiny_llama, tiny_gemma):
    """Gemma-3's sliding-window mask, recorded once per batch and kept broadcast: T² bytes per batch (Llama: none)."""
    from ghosted_core.calibration.pipelines import record_block_inputs
    from ghosted_core.memory_parts import mask_bytes

    for model in (tiny_llama, tiny_gemma):
        batches = make_batches(random_tokens(6, 24), None, 2)
        recorded = 0
        for batch in batches:
            _, calls = record_block_inputs(model, batch, len(model.model.layers))
            masks = {id(kw["attention_mask"]): kw["attention_mask"] for kw in calls
                     if isinstance(kw.get("attention_mask"), torch.Tensor)}
            recorded += sum(m.untyped_storage().nbytes() for m in masks.values())
        assert recorded == mask_bytes(model.config, 6, 2, 24, 4), model.config.model_type
    assert mask_bytes(tiny_gemma.config, 6, 2, 24, 4) == 3 * 24 * 24


def test_the_size_and_speed_phase_is_planned_only_when_speed_is_measured():
    """The run's last stage holds the weights, every variant's operator modules and one batch-1 forward over the
    prompt and new tokens (`speed_bytes`), and only when it times the variants: sizes are counted on the meta device
    and cost nothing."""
    from ghosted_core.export.gain import SpeedOptions
    from ghosted_core.memory_parts import allocator_residue_bytes, kept_bytes, speed_bytes
    from ghosted_core.recovery.operators import get_operator

    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    base = dict(model="x", criterion="manual", layers=(2,), variants=parse_variants("none,ghost"), train_size=8,
                seqlen=64)
    timed = memory_plan(RunOptions(**base, speed=SpeedOptions(measure=True, prefill_tokens=32, decode_tokens=8)),
                        config, "cpu", torch.float32, host_available=1 << 40)
    untimed = memory_plan(RunOptions(**base, speed=SpeedOptions(measure=False)), config, "cpu", torch.float32,
                          host_available=1 << 40)
    assert "size and speed" not in untimed.phases and list(timed.phases)[-1] == "size and speed"
    modules = sum(kept_bytes(get_operator(name).cost, config, 4)[1] for name in ("none", "ghost"))
    speed = speed_bytes(config, 40, torch.float32)  # 32 prefill + 8 decode tokens
    residue = allocator_residue_bytes(config, torch.get_num_threads())
    assert timed.phases["size and speed"]["host"] == timed.weights_bytes + modules + speed + residue
    assert speed_bytes(config, 40, torch.float32) > speed_bytes(config, 20, torch.float32) > 0


def _residue_by_hand(width: int, inner: int, vocab: int, threads: int, forward: bool = True) -> int:
    """`memory_parts.allocator_residue_bytes` written out: per thread two buffers of each kind of product,
    min(6 MiB, 2 KiB × the widest fp32 output) for the forward, and min(12 MiB, 1.25 MiB + 2.5 KiB × n) for each
    float64 product width n (C, and I)."""
    mib = 2**20
    fp32 = min(6 * mib, 2 * 1024 * max(inner, vocab)) if forward else 0
    return 2 * threads * (fp32 + min(12 * mib, 1.25 * mib + 2.5 * 1024 * width)
                          + min(12 * mib, 1.25 * mib + 2.5 * 1024 * inner))


def test_the_allocator_residue_is_held_from_the_calibration_pass_on():
    """Issue 37, point 9: the BLAS's kept buffers are a declared term of every phase from calibration on (the
    score phase is the criterion's declaration alone), per host thread, in the plan's field, JSON and summary."""
    import dataclasses

    from ghosted_core.export.gain import SpeedOptions
    from ghosted_core.run.options import plan_request

    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    options = RunOptions(model="x", criterion="manual", layers=(2,), variants=parse_variants("ghost,magcomp_refit"),
                         train_size=8, seqlen=64, speed=SpeedOptions(measure=True, prefill_tokens=32, decode_tokens=8))
    request = plan_request(options, config, boundaries=1)
    assert request.inner == 704  # the refit's float64 products over I as well as C

    def plan(threads: int, device: str = "cpu", **kwargs) -> MemoryPlan:
        return plan_memory(config, "x", device, torch.float32, dataclasses.replace(request, threads=threads, **kwargs),
                           host_available=1 << 40, device_available=80 * GIB if device == "cuda" else None)

    without, with_three = plan(0), plan(3)
    residue = _residue_by_hand(256, 704, 512, 3)
    assert without.residue_bytes == 0 and with_three.residue_bytes == residue == 2 * 3 * (1408 + 1920 + 3040) * 1024
    assert list(with_three.phases) == ["score blocks", "calibrate", "fit", "held-out", "evaluate", "drift",
                                       "size and speed"]
    for phase, use in with_three.phases.items():
        added = use["host"] - without.phases[phase]["host"]
        assert added == (0 if phase == "score blocks" else residue), phase
    assert without.peak_phase == "fit" and with_three.host_bytes == without.host_bytes + residue
    assert with_three.to_json()["residue_bytes"] == residue
    assert f"allocator residue {residue / 2**20:.0f} MiB" in with_three.summary()
    assert plan_memory(config, "x", "cpu", torch.float32, request, host_available=1 << 40).residue_bytes == \
        _residue_by_hand(256, 704, 512, torch.get_num_threads())  # the threads torch computes with now
    # a GPU run: the host multiplies only where the statistics live there, and runs no forward
    assert plan(3, "cuda", stats_device="cuda").residue_bytes == 0
    on_host = plan(3, "cuda", stats_device="cpu")
    assert on_host.stats_device == "cpu" and on_host.residue_bytes == _residue_by_hand(256, 704, 512, 3, forward=False)
    assert on_host.phases["held-out"]["host"] - plan(0, "cuda", stats_device="cpu").phases["held-out"]["host"] == \
        on_host.residue_bytes
    # at C = 4096, I = 14336 on 2 threads: above the 44 to 78 MiB read from the resident size after the calibration
    # pass (docs/scale.md) and the 49.4 MiB MKL kept there
    llama_8b = plan_memory(LLAMA_3_8B, "8B", "cpu", torch.float32,
                           PlanRequest(needs_of(["magcomp_refit"]), 1, 16, 512, 2, 64, inner=14336, threads=2),
                           host_available=1 << 50)
    assert llama_8b.residue_bytes == _residue_by_hand(4096, 14336, 128256, 2) == 117 * 2**20


def _mkl_pool():
    """(bytes MKL's allocator holds now, its free-buffers call), or None where torch's BLAS is not MKL."""
    import ctypes
    import os

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        stat, free = lib.mkl_serv_mem_stat, lib.mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None
    stat.restype = ctypes.c_int64

    def held() -> int:
        count = ctypes.c_int(0)
        return int(stat(ctypes.byref(count)))
    return held, free


def test_the_residue_bounds_what_the_blas_keeps_after_calibration():
    """What the term stands for, measured: MKL's kept buffers after a calibration pass with the refit's float64
    products over C and I and a whole forward (the LM head's fp32 product), from none, stay within the term."""
    from ghosted_core.memory_parts import allocator_residue_bytes, inner_width

    pool = _mkl_pool()
    if pool is None:
        pytest.skip("torch's CPU BLAS is not MKL here")
    held, free = pool
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    needs = needs_of(["magcomp_refit"])
    batches = make_batches(random_tokens(4, 128) % 4096, None, 2)
    free()
    before = held()
    collect_stats(model, [Boundary(1, 2)], batches, CalibrationOptions(quiet=True), needs)
    with torch.no_grad():
        model(batches[0].input_ids)
    kept = held() - before
    planned = allocator_residue_bytes(config, torch.get_num_threads(), inner_width(config, needs))
    assert 0 < kept <= planned, (kept, planned)
