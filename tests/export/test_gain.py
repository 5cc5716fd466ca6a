"""What pruning buys: sizes equal the files an export writes; speeds are measured, positive, and relative to dense."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import FAMILIES, make_tiny_model, recovered_variants
from ghosted_core.errors import GhostedError
from ghosted_core.export.folder import export_variant
from ghosted_core.export.gain import REFERENCE, SpeedOptions, measure_gain, variant_size
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.run.sweep import run_sweep

QUICK = SpeedOptions(measure=True, prefill_tokens=16, decode_tokens=4, repeats=2)


def written_tensors(folder) -> tuple[int, int]:
    """(elements, bytes) of every tensor in the export's safetensors files, read by safetensors itself."""
    elements = size = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                elements += tensor.numel()
                size += tensor.numel() * tensor.element_size()
    return elements, size


@pytest.mark.parametrize("family", FAMILIES)
def test_sizes_equal_the_tensors_each_export_writes(family, tmp_path):
    """Stock variants (plain pruning, a map folded into down_proj, magcomp's scales) and remote-code ones (ghost,
    diag): parameters and bytes are those of the checkpoint the export writes, in the format it chooses."""
    model = make_tiny_model(family)
    _plan, variants = recovered_variants(model, (1, 2, 5))
    for name in ("none", "replaceme", "magcomp", "ghost", "diag"):
        size = variant_size(variants[name])
        done = export_variant(variants[name], None, tmp_path / name, mode="auto")
        assert size.format == done.mode, name
        assert (size.parameters, size.weight_bytes) == written_tensors(done.folder), name
        assert size.blocks == 3
    dense = variant_size(model)
    assert dense.format == "stock" and dense.parameters == sum(p.numel() for p in model.parameters())  # tied: once
    # a remote-code variant carries its operators: C×C (+ its bias, if any) more per boundary than plain pruning
    width, boundaries = model.config.hidden_size, 2
    extra = variant_size(variants["ghost"]).parameters - variant_size(variants["none"]).parameters
    assert boundaries * width * width <= extra <= boundaries * (width * width + width)


def test_sizes_read_no_weight_an_8b_model_on_the_meta_device_is_counted():
    """Sizes come from shapes alone: Llama-3-8B's config built on the meta device (no data at all) is counted, and
    agrees with the parameter count the memory plan derives from the config independently."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ghosted_core.memory_parts import estimate_parameters

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=32, vocab_size=128256, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    size = variant_size(model)
    assert size.parameters == estimate_parameters(config) == 8_030_261_248  # Llama-3-8B's published count
    assert size.weight_bytes == 2 * size.parameters and size.format == "stock" and size.blocks == 32


def test_measured_speeds_are_positive_and_relative_to_dense(tiny_llama):
    _plan, variants = recovered_variants(tiny_llama, (1, 2, 5))
    models = {REFERENCE: tiny_llama, "none": variants["none"], "ghost": variants["ghost"]}
    report = measure_gain(models, QUICK)
    for name in models:
        entry = report.variant_json(name)
        for key in ("prefill", "decode"):
            rate = entry[f"{key}_tokens_per_s"]
            assert 0 < rate["min"] <= rate["median"] <= rate["max"] and rate["samples"] == QUICK.repeats
            assert entry[f"{key}_vs_dense"] > 0
    dense = report.variant_json(REFERENCE)
    assert dense["prefill_vs_dense"] == dense["decode_vs_dense"] == dense["size_vs_dense"] == 1.0
    assert report.variant_json("none")["size_vs_dense"] < 1.0
    settings = report.settings_json()
    assert settings["measured"] and settings["reference"] == REFERENCE and settings["batch"] == 1
    assert settings["measured_on"]["threads"] >= 1 and settings["measured_on"]["device"] == "cpu"


def test_speed_off_reports_sizes_only(tiny_llama):
    report = measure_gain({REFERENCE: tiny_llama}, SpeedOptions(measure=False))
    entry = report.variant_json(REFERENCE)
    assert entry["parameters"] > 0 and "decode_tokens_per_s" not in entry and not report.settings_json()["measured"]


def test_speed_default_follows_the_environment(monkeypatch):
    monkeypatch.setenv("GHOSTED_SPEED", "0")
    assert not RunOptions().speed.measure
    monkeypatch.setenv("GHOSTED_SPEED", "1")
    assert RunOptions().speed.measure and SpeedOptions(measure=False).measure is False


@pytest.mark.parametrize("bad", [dict(prefill_tokens=0), dict(decode_tokens=1), dict(repeats=0)])
def test_impossible_speed_settings_are_refused(bad):
    with pytest.raises(GhostedError, match="speed measurement needs"):
        SpeedOptions(**bad)


def test_results_json_carries_size_and_speed_for_every_variant(tiny_model_folder):
    options = RunOptions(model=str(tiny_model_folder), criterion="streamline", num_prune=2,
                         variants=parse_variants("none,ghost,magcomp"), calibration="ptb", train_size=4, seqlen=32,
                         eval_corpora=("ptb",), eval_max_tokens=128, drift_windows=0, quiet=True, speed=QUICK)
    report = json.loads(json.dumps(run(options).to_json()))
    assert set(report["variants"]) == {"dense", "none", "ghost", "magcomp"}
    for name, entry in report["variants"].items():
        gain = entry["gain"]
        assert gain["parameters"] > 0 and gain["weight_bytes"] > 0
        assert gain["prefill_tokens_per_s"]["median"] > 0 and gain["decode_tokens_per_s"]["median"] > 0
        assert gain["blocks"] == (6 if name == "dense" else 4)
    dense = report["variants"]["dense"]["gain"]
    assert dense["prefill_vs_dense"] == dense["decode_vs_dense"] == dense["size_vs_dense"] == 1.0
    assert report["variants"]["ghost"]["gain"]["format"] == "remote_code"
    assert report["variants"]["magcomp"]["gain"]["format"] == "stock"
    assert report["gain"]["prefill_tokens"] == QUICK.prefill_tokens and "size and speed" in report["timings"]


def test_every_depth_of_a_sweep_carries_size_and_speed(tiny_model_folder):
    options = RunOptions(model=str(tiny_model_folder), criterion="streamline", variants=parse_variants("none,ghost"),
                         calibration="ptb", train_size=4, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=128,
                         quiet=True, speed=QUICK)
    report = run_sweep(options, (1, 3)).to_json()
    for depth in report["sweep"]["results"]:
        assert depth["dense_gain"]["decode_vs_dense"] == 1.0 and depth["dense_gain"]["blocks"] == 6
        for entry in depth["variants"].values():
            assert entry["gain"]["blocks"] == 6 - depth["n"] and entry["gain"]["decode_tokens_per_s"]["median"] > 0


@pytest.mark.parametrize("depth", ["2", "1:2"])
def test_cli_prints_and_records_size_and_speed(depth, tiny_model_folder, tmp_path, capsys, monkeypatch):
    from ghosted_core.cli import main

    monkeypatch.setenv("GHOSTED_SPEED", "1")  # the suite turns speed off by default; a user's run measures it
    code = main(["--model", str(tiny_model_folder), "--pruning_method", "streamline", "--total_num_prune", depth,
                 "--insert_type", "none,ghost", "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
                 "--eval_ppl", "ptb", "--eval_max_tokens", "128", "--speed_repeats", "2", "--outdir", str(tmp_path),
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "size as saved (x dense)" in out and "median of 2 rounds beside dense" in out
    report = json.loads((tmp_path / "results.json").read_text())
    gains = [r["variants"]["ghost"]["gain"] for r in report["sweep"]["results"]] if ":" in depth else \
        [report["variants"]["ghost"]["gain"]]
    assert all(g["decode_tokens_per_s"]["samples"] == 2 and g["format"] == "remote_code" for g in gains)
    ghost_row = next(line for line in out.splitlines() if "ghost" in line.split()[:3] and "|" not in line
                     and not line.startswith("Best"))  # a table row: variant first, or n, blocks, variant
    assert "remote code" in ghost_row


def test_cli_no_speed_keeps_sizes(tiny_model_folder, tmp_path, monkeypatch):
    from ghosted_core.cli import main

    monkeypatch.setenv("GHOSTED_SPEED", "1")
    assert main(["--model", str(tiny_model_folder), "--pruning_method", "streamline", "--total_num_prune", "2",
                 "--insert_type", "none", "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
                 "--eval_ppl", "ptb", "--eval_max_tokens", "128", "--no_speed", "--outdir", str(tmp_path),
                 "--quiet"]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["gain"]["measured"] is False and report["variants"]["none"]["gain"]["weight_bytes"] > 0
    assert "decode_vs_dense" not in report["variants"]["none"]["gain"]
