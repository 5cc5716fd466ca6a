"""Distillation in a run: names, refusals, results.json, the CLI, the memory plan, and stock exports in plain
transformers (a process that cannot import ghosted_core)."""

from __future__ import annotations

import json

import pytest
import torch

from fresh_process import assert_same_model, load_in_fresh_process
from ghosted_core.cli import main
from ghosted_core.errors import GhostedError
from ghosted_core.distill.options import DistillOptions
from ghosted_core.export.folder import export_variant
from ghosted_core.model.loading import LoadOptions
from ghosted_core.run.options import RunOptions, distilled, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.run.sweep import check_sweep


def test_a_distilled_variant_brings_its_start_once():
    specs = parse_variants("ghost+kd,none+kd_mlp,ghost,ghost+kd_lora")
    assert [s.name for s in specs] == ["ghost", "ghost+kd", "none", "none+kd_mlp", "ghost+kd_lora"]
    assert [(s.base, s.distill) for s in specs] == [("ghost", None), ("ghost", "operator"), ("none", None),
                                                    ("none", "mlp"), ("ghost", "lora")]
    assert distilled("ghost,none,magcomp,rotate+kd_norm", []) == ["ghost+kd", "none+kd_mlp", "magcomp+kd_mlp",
                                                                  "rotate+kd_norm"]
    assert distilled("all", ["ghost_capped", "magcomp_refit"]) == ["ghost_capped+kd", "magcomp_refit+kd"]


@pytest.mark.parametrize("names, message", [
    ("none+kd", "none has no weights of its own"), ("magcomp+kd", "magcomp has no weights of its own"),
    ("ghost+kd_foo", "unknown distillation target 'foo'"), ("ghost+kdx", "BASE\\+kd_TARGET"),
    ("nothing+kd", "unknown operator"),
])
def test_names_that_cannot_be_distilled_are_refused_before_any_work(names, message):
    with pytest.raises(GhostedError, match=message):
        parse_variants(names)


def test_a_sweep_refuses_distillation():
    options = RunOptions(variants=parse_variants("ghost,ghost+kd"))
    with pytest.raises(GhostedError, match="distill .*ghost\\+kd.* in a single run"):
        check_sweep(options, (1, 2))


@pytest.fixture(scope="module")
def distilled_run(peaked_model_folder):
    options = RunOptions(model=str(peaked_model_folder), criterion="manual", layers=(2, 3),
                         variants=parse_variants("none,ghost,ghost+kd,none+kd_mlp,none+kd_lora,magcomp_refit+kd"),
                         calibration="ptb", train_size=6, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=128,
                         distill=DistillOptions(steps=3, lr=1e-3, eval_every=1), quiet=True)
    return run(options)


def test_results_carry_each_distillation_beside_its_start(distilled_run):
    report = distilled_run.to_json()
    variants = report["variants"]
    assert list(variants) == ["dense", "none", "ghost", "ghost+kd", "none+kd_mlp", "none+kd_lora", "magcomp_refit",
                              "magcomp_refit+kd"]
    for name in ("ghost+kd", "none+kd_mlp", "none+kd_lora", "magcomp_refit+kd"):
        d = variants[name]["distill"]
        assert d["steps"] == 3 and len(d["loss_curve"]) == 3 and [s for s, _ in d["val_curve"]] == [0, 1, 2, 3]
        assert d["tokens"] == 3 * 2 * 32 and d["best_val"] <= d["start_val"] and d["seconds_per_step"] > 0
        assert d["corpus"] == report["calibration"]["label"] and variants[name]["ppl"]["ptb"] > 1
    assert all(variants[n]["distill"]["best_val"] < variants[n]["distill"]["start_val"] for n in ("none+kd_mlp", "none+kd_lora"))
    stock = {name: variants[name]["distill"]["stock"] for name in ("ghost+kd", "none+kd_mlp", "none+kd_lora",
                                                                   "magcomp_refit+kd")}
    assert stock == {"ghost+kd": False, "none+kd_mlp": True, "none+kd_lora": True, "magcomp_refit+kd": True}
    assert "distill" in report["timings"] and "distill" in report["memory_plan"]["phases"]
    assert report["memory_plan"]["phases"]["distill"]["host"] > 0  # the teacher cache


def test_distilled_stock_variants_load_in_plain_transformers(distilled_run, tmp_path):
    """The trained MLP copy, the merged low-rank changes and the refit's trained down_proj, as stock checkpoints."""
    folders = {}
    for name in ("none+kd_mlp", "none+kd_lora", "magcomp_refit+kd"):
        done = export_variant(distilled_run.models[name], distilled_run.tokenizer, tmp_path / name, "stock")
        assert done.mode == "stock" and "distillation then trained" in done.reason
        card = (tmp_path / name / "README.md").read_text()
        assert "Distilled after the fit" in card and "stays stock" in card and "knowledge-distillation" in card
        folders[name] = done.folder
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(4))
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=False)
    for name in folders:
        assert loaded[name]["class"] == "LlamaForCausalLM"
        assert_same_model(loaded[name], distilled_run.models[name], ids)
    with torch.no_grad():  # training changed something, or the comparison above would prove nothing
        assert not torch.allclose(distilled_run.models["none+kd_lora"](ids).logits,
                                  distilled_run.models["none"](ids).logits)


def test_cli_distills_and_prints_what_each_distillation_did(tiny_model_folder, tmp_path, capsys):
    code = main(["--model", str(tiny_model_folder), "--pruning_method", "manual", "--layers", "2,3",
                 "--insert_type", "none,ghost", "--distill", "ghost,none", "--distill_steps", "2",
                 "--distill_top_k", "0", "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
                 "--eval_ppl", "ptb", "--eval_max_tokens", "64", "--outdir", str(tmp_path), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "ghost+kd: from ghost, trained operator" in out and "none+kd_mlp: from none, trained mlp" in out
    variants = json.loads((tmp_path / "results.json").read_text())["variants"]
    assert variants["ghost+kd"]["distill"]["loss"].endswith("full vocabulary")
    assert variants["ghost+kd"]["distill"]["top_k"] == variants["ghost+kd"]["distill"]["vocabulary"]


def test_cli_refuses_a_bad_distillation_budget_in_one_line(tiny_model_folder, tmp_path, capsys):
    code = main(["--model", str(tiny_model_folder), "--distill", "ghost", "--insert_type", "ghost",
                 "--distill_steps", "0", "--outdir", str(tmp_path)])
    assert code == 2
    assert "--distill_steps must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_distills_smollm2_with_a_small_budget(tmp_path, capsys):
    """The CLI on the embedded SmolLM2: closed-form starts and their distillations beside
    them in results.json, with the curves and before / after perplexities."""
    code = main(["--model", "smollm2-135m", "--pruning_method", "streamline", "--total_num_prune", "7",
                 "--insert_type", "none,ghost_capped", "--distill", "ghost_capped,none,magcomp_refit+kd_mlp",
                 "--distill_steps", "3", "--calibration_data", "mix", "--train_size", "8", "--seqlen", "128",
                 "--eval_ppl", "ptb", "--eval_max_tokens", "256", "--outdir", str(tmp_path), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "ghost_capped+kd: from ghost_capped, trained operator" in out
    variants = json.loads((tmp_path / "results.json").read_text())["variants"]
    for name in ("ghost_capped+kd", "none+kd_mlp", "magcomp_refit+kd_mlp"):
        d = variants[name]["distill"]
        assert d["steps"] == 3 and len(d["loss_curve"]) == 3 and d["best_val"] <= d["start_val"], name
        assert variants[name]["ppl"]["ptb"] > 1 and variants[d["base"]]["ppl"]["ptb"] > 1, name


@pytest.mark.parametrize("flags, message", [
    (["--distill_top_k", "100000"], r"--distill_top_k 100000 is larger than the vocabulary of .* use at most"),
    (["--distill_steps", "-3"], "--distill_steps must be at least 1"),
    (["--distill_tokens", "0"], "--distill_tokens must be at least 1"),
])
def test_cli_refuses_bad_distillation_input_before_loading_weights(tiny_model_folder, tmp_path, capsys, monkeypatch,
                                                                   flags, message):
    import re

    from ghosted_core.model import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded weights before refusing"))
    code = main(["--model", str(tiny_model_folder), "--total_num_prune", "2", "--insert_type", "ghost", "--distill", "ghost",
                 "--outdir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and re.search(message, err), err



def test_gemma4_e2b_distils_after_its_shared_kv_blocks_and_exports_stock(tiny_folder, tmp_path):
    """Gemma 4 E2B's last blocks attend with keys and values stored by earlier blocks on the same pass: training the
    MLP before a removed sharing block (4), block 3, runs its suffix from the first storing block (2), which computes
    them, and the trained model exports stock with its per-layer embeddings cut to the kept blocks, reloading the
    same."""
    options = RunOptions(model=str(tiny_folder("gemma4_e2b")), criterion="manual", layers=(4,),
                         variants=parse_variants("none,none+kd_mlp"), calibration="ptb", train_size=6, seqlen=32,
                         eval_corpora=("ptb",), eval_max_tokens=128, distill=DistillOptions(steps=4, lr=1e-4, eval_every=1),
                         quiet=True, load=LoadOptions(device="cpu"))
    result = run(options)
    d = result.to_json()["variants"]["none+kd_mlp"]["distill"]
    assert d["trained"] == ["model.layers.3.mlp"] and d["prefix"].startswith("dense states")
    assert d["best_val"] < d["start_val"] and d["stock"] is True
    done = export_variant(result.models["none+kd_mlp"], result.tokenizer, tmp_path / "kd", "stock")
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(4))
    loaded = load_in_fresh_process(tmp_path / "fresh", {"kd": done.folder}, ids, trust_remote_code=False)
    assert loaded["kd"]["class"] == "Gemma4ForCausalLM"
    assert_same_model(loaded["kd"], result.models["none+kd_mlp"], ids)
