"""Exports load without ghosted_core and reproduce the in-memory variant: stock and remote-code folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ALL_FAMILIES, FAMILIES, TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.data.assets import cache_dir
from ghosted_core.errors import GhostedError
from ghosted_core.export.model_card import fmt_ppl
from ghosted_core.export.folder import archive_export, check_export, export_mode, export_variant, load_recovered, \
    upload_export
from conftest import recovered_variants
from fresh_process import assert_same_model, fresh_env, load_in_fresh_process, weight_keys

# ---------------------------------------------------------------- stock


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_export_loads_without_ghosted_core_and_matches_the_variant(family, tmp_path):
    model = make_tiny_model(family)
    removed = (1, 2, 5)  # a run inside the model and one reaching its end
    _plan, variants = recovered_variants(model, removed)
    names = ["none", "replaceme"] if family != "gemma3" else ["none"]
    folders = {}
    for name in names:
        result = export_variant(variants[name], None, tmp_path / name, mode="stock")
        assert result.mode == "stock"
        folders[name] = result.folder
        config = json.loads((result.folder / "config.json").read_text())
        assert config["architectures"] == [type(model).__name__] and config["model_type"] == model.config.model_type
        assert config["num_hidden_layers"] == TINY_LAYERS - len(removed)
        assert "auto_map" not in config and "ghosted" not in config and "_name_or_path" not in config
        if "layer_types" in config:
            assert config["layer_types"] == [model.config.layer_types[j] for j in range(TINY_LAYERS) if j not in removed]
        blocks = {k.split(".")[2] for k in weight_keys(result.folder) if k.startswith("model.layers.")}
        assert blocks == {str(i) for i in range(TINY_LAYERS - len(removed))}
        assert not any(".patch." in k or ".inner." in k or ".mlp.0." in k for k in weight_keys(result.folder))
        assert ("lm_head.weight" in weight_keys(result.folder)) == (not model.config.tie_word_embeddings)
    ids = random_tokens(2, 12, seed=9)
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=False)
    for name in names:
        assert loaded[name]["class"] == type(model).__name__
        assert_same_model(loaded[name], variants[name], ids)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_stock_qwen_export_keeps_sliding_windows_on_the_same_blocks(family, tmp_path):
    """Qwen2/Qwen3 with sliding windows above max_window_layers = 3, blocks 1 and 4 removed: the exported
    config.json slices layer_types and re-counts max_window_layers (3 → 2), an engine that reads only
    max_window_layers derives the same layer types, and the export reloaded in plain transformers gives the
    variant's logits on sequences longer than the window (where a misplaced window would change them)."""
    model = make_tiny_model(family, use_sliding_window=True, sliding_window=4, max_window_layers=3)
    assert model.config.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 3
    _plan, variants = recovered_variants(model, (1, 4))
    folders = {}
    for name in ("none", "replaceme"):
        folders[name] = export_variant(variants[name], None, tmp_path / name, mode="stock").folder
        config = json.loads((folders[name] / "config.json").read_text())
        assert config["layer_types"] == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
        assert config["max_window_layers"] == 2 and config["num_hidden_layers"] == 4
        assert config["use_sliding_window"] is True and config["sliding_window"] == 4
        engine = type(model.config).from_dict({k: v for k, v in config.items() if k != "layer_types"})
        assert engine.layer_types == config["layer_types"]
    ids = random_tokens(2, 20, seed=4)  # 20 tokens > the 4-token window
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=False)
    for name in folders:
        assert_same_model(loaded[name], variants[name], ids)


def test_replaceme_on_gemma3_does_not_fold_and_says_why(tiny_gemma, tmp_path):
    _plan, variants = recovered_variants(tiny_gemma, (2, 3))
    with pytest.raises(GhostedError, match="post_feedforward_layernorm"):
        export_variant(variants["replaceme"], None, tmp_path / "stock", mode="stock")
    result = export_variant(variants["replaceme"], None, tmp_path / "auto")
    assert result.mode == "remote_code" and "post_feedforward_layernorm" in result.reason


def test_tied_embeddings_stay_tied(tiny_gemma, tmp_path):
    assert tiny_gemma.config.tie_word_embeddings
    _plan, variants = recovered_variants(tiny_gemma, (4,))
    folder = export_variant(variants["none"], None, tmp_path / "none").folder
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in weight_keys(folder)


def test_safetensors_written_from_the_tensors_memory_read_back_by_safetensors(tmp_path):
    """`write_safetensors` (the shard writer's; no copy of a tensor's bytes, a streamed tensor a piece at a time)
    writes what safetensors' own reader returns exactly, for every dtype an export holds, scalars and empty
    tensors, and a streamed tensor whose pieces are uneven; a streamed tensor whose pieces fall short fails."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ghosted_core.export.checkpoint import write_safetensors
    from ghosted_core.model.side_inputs import StreamedTensor

    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(7, 5, generator=generator).to(torch.bfloat16)
    tensors = {"bf16": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
               "f32": torch.randn(2, 3, 4, generator=generator), "f16": torch.randn(5, generator=generator).half(),
               "f64": torch.randn(2, generator=generator).double(), "i64": torch.arange(6), "bool": torch.tensor([1, 0, 1]).bool(),
               "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4), "transposed": torch.randn(3, 2).T.contiguous(),
               "streamed": StreamedTensor(torch.bfloat16, (7, 5), lambda: iter((whole[:1], whole[1:4], whole[4:])))}
    write_safetensors(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    loaded = load_file(tmp_path / "a.safetensors")
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        expected = whole if key == "streamed" else tensor
        assert loaded[key].dtype == expected.dtype and torch.equal(loaded[key], expected), key
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    short = {"streamed": StreamedTensor(torch.float32, (4,), lambda: iter((torch.zeros(3),)))}
    with pytest.raises(RuntimeError, match="12 bytes written for a tensor of shape"):
        write_safetensors(tmp_path / "b.safetensors", short, {})


def test_sharded_export_writes_an_index_that_transformers_reads(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    result = export_variant(variants["replaceme"], None, tmp_path / "sharded", shard_bytes=40_000)
    shards = sorted(p.name for p in result.folder.glob("*.safetensors"))
    index = json.loads((result.folder / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    ids = random_tokens(2, 10, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(result.folder)(ids).logits,
                                   variants["replaceme"](ids).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- remote code


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_remote_code_export_loads_with_trust_remote_code_without_ghosted_core(family, tmp_path):
    model = make_tiny_model(family)
    removed = (0, 3, 5)  # runs at the embeddings, inside, and at the final norm: every patch site
    _plan, variants = recovered_variants(model, removed)
    names = ["ghost_capped", "diag"] + (["replaceme"] if family == "gemma3" else [])
    folders = {}
    for name in names:
        result = export_variant(variants[name], None, tmp_path / name)
        assert result.mode == "remote_code", result.reason
        folders[name] = result.folder
        config = json.loads((result.folder / "config.json").read_text())
        assert config["model_type"] == f"ghosted_{model.config.model_type}"
        assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
        assert (result.folder / "modeling_ghosted.py").exists()
    ids = random_tokens(2, 12, seed=9)
    loaded = load_in_fresh_process(tmp_path / "fresh", folders, ids, trust_remote_code=True)
    for name in names:
        assert loaded[name]["class"].startswith("Ghosted")
        assert_same_model(loaded[name], variants[name], ids)


def test_remote_code_folder_fails_loudly_in_plain_transformers(tiny_llama, tmp_path):
    """Without trust_remote_code, transformers refuses the folder instead of loading random blocks."""
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    folder = export_variant(variants["ghost"], None, tmp_path / "ghost").folder
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(folder)


def test_load_recovered_runs_our_own_code_and_keeps_operators_in_float32(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    folder = export_variant(variants["ghost"], None, tmp_path / "ghost").folder
    (folder / "modeling_ghosted.py").write_text("raise RuntimeError('the folder code ran')\n")
    model, _ = load_recovered(folder, dtype=torch.bfloat16)
    assert model.model.layers[2].patch.weight.dtype == torch.float32
    assert model.model.layers[2].inner.mlp.down_proj.weight.dtype == torch.bfloat16
    ids = random_tokens(1, 8, seed=2)
    with torch.no_grad():
        full, _ = load_recovered(folder)
        assert torch.equal(full(ids).logits, variants["ghost"](ids).logits)


# ---------------------------------------------------------------- choosing the format


def test_auto_mode_picks_stock_where_the_variant_folds(tiny_qwen2_variants, tmp_path):
    expected = {"none": "stock", "replaceme": "stock", "diag": "remote_code", "rotate": "remote_code",
                "ghost": "remote_code", "ghost_capped": "remote_code", "ghost_nosink": "remote_code"}
    for name, mode in expected.items():
        assert export_variant(tiny_qwen2_variants[name], None, tmp_path / name).mode == mode, name
    with pytest.raises(GhostedError, match="residual stream"):
        export_variant(tiny_qwen2_variants["ghost"], None, tmp_path / "x", mode="stock")
    assert export_variant(tiny_qwen2_variants["none"], None, tmp_path / "rc", mode="remote_code").mode == "remote_code"


@pytest.fixture(scope="module")
def tiny_qwen2_variants():
    return recovered_variants(make_tiny_model("qwen2"), (2, 3))[1]


def test_check_export_refuses_stock_for_operators_that_never_fold():
    check_export(["none", "replaceme"], "stock")
    check_export(["ghost", "diag"], "auto")
    with pytest.raises(GhostedError, match="ghost, diag cannot fold"):
        check_export(["none", "ghost", "diag"], "stock")
    with pytest.raises(GhostedError, match="unknown export format"):
        check_export(["none"], "onnx")


def test_dense_model_and_old_format_are_refused(tiny_llama, tmp_path):
    with pytest.raises(GhostedError, match="only pruned variants"):
        export_variant(tiny_llama, None, tmp_path / "dense")
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"model_type": "llama", "ghosted": {"layout": []}}))
    with pytest.raises(GhostedError, match="earlier Ghosted Layers format"):
        load_recovered(old)
    with pytest.raises(GhostedError, match="not an exported model folder"):
        load_recovered(tmp_path / "nothing")


def test_zip_archive_unpacks_to_a_folder_plain_transformers_loads(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    ids = random_tokens(1, 10, seed=3)
    for name, mode in (("replaceme", "stock"), ("ghost", "remote_code")):
        result = archive_export(variants[name], None, tmp_path / f"{name}.zip")
        assert result.mode == mode and result.archive == tmp_path / f"{name}.zip"
        with zipfile.ZipFile(result.archive) as archive:
            names = archive.namelist()
            assert f"{name}/config.json" in names and f"{name}/README.md" in names
            archive.extractall(tmp_path / "unpacked")
        folder = tmp_path / "unpacked" / name
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=mode == "remote_code")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, variants[name](ids).logits, rtol=1e-5, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # staging folders removed


# ---------------------------------------------------------------- offload (accelerate device map)


def test_offloaded_model_exports_its_real_weights(tiny_model_folder, tmp_path):
    """--device map with a memory cap: blocks sit on disk (meta tensors in the tree); exports read the offload."""
    from ghosted_core.model.loading import LoadOptions, load_model

    loaded = load_model(str(tiny_model_folder), LoadOptions(device="map", max_memory={"cpu": 2_000_000},
                                                            offload_folder=str(tmp_path / "offload")))
    dense = loaded.model
    assert any(p.device.type == "meta" for p in dense.model.layers.parameters())  # really offloaded
    _plan, variants = recovered_variants(dense, (2, 3))
    ids = random_tokens(2, 10, seed=5)
    for name, mode in (("none", "stock"), ("replaceme", "stock"), ("ghost", "remote_code")):
        result = export_variant(variants[name], loaded.tokenizer, tmp_path / name)
        assert result.mode == mode
        reloaded, _ = load_recovered(result.folder)
        assert not any(p.device.type == "meta" for p in reloaded.parameters())
        with torch.no_grad():
            gap = (reloaded(ids).logits - variants[name](ids).logits).abs().max() / variants[name](ids).logits.abs().max()
        assert float(gap) <= 1e-5, (name, float(gap))


# ---------------------------------------------------------------- model card and paths


def test_no_path_of_this_machine_is_in_any_exported_file(tiny_model_folder, tmp_path):
    from ghosted_core.model.loading import load_model

    loaded = load_model(str(tiny_model_folder))
    assert str(tiny_model_folder) in loaded.model.config._name_or_path  # the source does carry a local path
    _plan, variants = recovered_variants(loaded.model, (2, 3))
    local = {str(tiny_model_folder), str(tmp_path), str(cache_dir()), str(Path.home()) + "/", os.getcwd()}
    for name in ("none", "ghost"):
        folder = export_variant(variants[name], loaded.tokenizer, tmp_path / "out" / name).folder
        assert (folder / "tokenizer.json").exists()
        for file in folder.iterdir():
            data = file.read_bytes()
            for path in local:
                assert path.encode() not in data, (file.name, path)


def test_model_card_states_the_run(tiny_model_folder, tmp_path):
    from ghosted_core.run.options import RunOptions, parse_variants
    from ghosted_core.run.pipeline import run

    options = RunOptions(model=str(tiny_model_folder), criterion="manual", layers=(2, 3),
                         variants=parse_variants("none,ghost_capped,replaceme"), calibration="mix", train_size=4,
                         seqlen=32, eval_corpora=("ptb", "wiki"), eval_max_tokens=128, drift_windows=0, quiet=True)
    result = run(options)
    for name, mode in (("replaceme", "stock"), ("ghost_capped", "remote_code")):
        folder = export_variant(result.models[name], result.tokenizer, tmp_path / name).folder
        text = (folder / "README.md").read_text()
        front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
        meta = yaml.safe_load(front)
        assert meta["library_name"] == "transformers" and "ghosted-layers" in meta["tags"]
        assert "base_model" not in meta  # a local folder has no Hub id, and its path must not appear
        assert ("custom_code" in meta["tags"]) == (mode == "remote_code")
        assert "[2, 3] (6 → 4 blocks)" in body and f"`{name}`" in body
        assert "Wikipedia paragraphs" in body and "stand-in" in body and "4 sequences × 32 tokens = 128 tokens" in body
        for corpus in ("ptb", "wiki"):
            assert fmt_ppl(result.perplexity[corpus][name]) in body and fmt_ppl(result.perplexity[corpus]["none"]) in body
        assert ("trust_remote_code=True" in body) == (mode == "remote_code")
        record = json.loads((folder / "ghosted.json").read_text())
        assert record["export"]["mode"] == mode and record["variant"] == name


# ---------------------------------------------------------------- Hub upload


class _RecordingApi:
    """Stands in for huggingface_hub.HfApi (no network here): records calls, fails when asked to."""

    calls: list = []
    fail_with: Exception | None = None

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        type(self).calls.append(("create_repo", repo_id, kwargs, self.token))
        if type(self).fail_with is not None:
            raise type(self).fail_with
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        type(self).calls.append(("upload_folder", kwargs))


def test_upload_sends_the_folder_and_never_reveals_the_token(tiny_llama, tmp_path, monkeypatch, caplog):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    import ghosted_core.export.folder as export

    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    folder = export_variant(variants["replaceme"], None, tmp_path / "replaceme").folder
    token = "hf_secretsecretsecret"
    monkeypatch.setattr(huggingface_hub, "HfApi", _RecordingApi)
    monkeypatch.setattr(export, "hub_reachable", lambda: False)
    with pytest.raises(GhostedError, match="not reachable"):
        upload_export(folder, "me/pruned", token)
    monkeypatch.setattr(export, "hub_reachable", lambda: True)
    _RecordingApi.calls = []
    caplog.set_level("DEBUG")
    assert upload_export(folder, "me/pruned", token) == "https://huggingface.co/me/pruned"
    (create, repo, kwargs, used), (upload, upload_kwargs) = _RecordingApi.calls
    assert (create, repo, used, kwargs["exist_ok"]) == ("create_repo", "me/pruned", token, False)
    assert upload == "upload_folder" and upload_kwargs["folder_path"] == str(folder)
    reply = httpx.Response(409, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
    _RecordingApi.fail_with = HfHubHTTPError(f"409 Conflict: repo exists (token {token})", response=reply)
    try:
        with pytest.raises(GhostedError) as err:
            upload_export(folder, "me/pruned", token)
    finally:
        _RecordingApi.fail_with = None
    assert token not in str(err.value) and "409" in str(err.value)
    assert token not in caplog.text
    with pytest.raises(GhostedError, match="write token"):
        upload_export(folder, "me/pruned", " ")


# ---------------------------------------------------------------- the command line


def test_cli_save_model_says_which_format(tiny_model_folder, tmp_path, capsys):
    from ghosted_core.cli import main

    common = ["--model", str(tiny_model_folder), "--pruning_method", "manual", "--layers", "2,3", "--train_size", "4",
              "--seqlen", "32", "--eval_ppl", "none", "--outdir", str(tmp_path), "--quiet",
              "--save_model", str(tmp_path / "saved")]
    assert main([*common, "--insert_type", "none,ghost_capped,replaceme"]) == 0
    out = capsys.readouterr().out
    assert "saved none as stock" in out and "saved replaceme as stock" in out and "saved ghost_capped as remote_code" in out
    exports = json.loads((tmp_path / "results.json").read_text())["exports"]
    assert {name: e["mode"] for name, e in exports.items()} == {"none": "stock", "ghost_capped": "remote_code",
                                                                "replaceme": "stock"}
    assert export_mode(tmp_path / "saved" / "ghost_capped") == "remote_code"
    assert main([*common, "--insert_type", "none,ghost", "--export", "stock"]) == 2
    assert "ghost cannot fold" in capsys.readouterr().err


# ---------------------------------------------------------------- real model, lm-eval (slow)


@pytest.mark.slow
def test_smollm2_stock_export_loads_without_ghosted_core(smollm2, all_threads, tmp_path):
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
    from ghosted_core.data.corpora import calibration_windows
    from ghosted_core.recovery.operators import FitOptions, get_operator
    from ghosted_core.run.options import VariantSpec
    from ghosted_core.run.fitting import build_recovered
    from ghosted_core.plan import PruningPlan

    plan = PruningPlan(30, tuple(range(12, 19)), "manual")
    fit_ids, _ = calibration_windows(smollm2.tokenizer, "mix", 4, 128, 0, 0)
    stats = collect_stats(smollm2.model, plan.boundaries, make_batches(fit_ids, None, 4), CalibrationOptions(quiet=True))
    fits = [get_operator("replaceme").fit(s, FitOptions()) for s in stats]
    variant = build_recovered(smollm2.model, plan, VariantSpec("replaceme", "replaceme"), fits)
    variant.config.ghosted["base_model"] = {"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "name": "smollm2-135m"}
    result = export_variant(variant, smollm2.tokenizer, tmp_path / "replaceme", mode="stock")
    assert yaml.safe_load((result.folder / "README.md").read_text().split("---\n")[1])["base_model"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    ids = smollm2.tokenizer(["The capital of France is Paris, and the capital of Italy is"], return_tensors="pt").input_ids
    loaded = load_in_fresh_process(tmp_path / "fresh", {"replaceme": result.folder}, ids, trust_remote_code=False)
    assert loaded["replaceme"]["class"] == "LlamaForCausalLM"
    assert_same_model(loaded["replaceme"], variant, ids)


LM_EVAL_TASK = "ghosted_arc_easy_subset"


def write_lm_eval_task(folder: Path, limit: int) -> None:
    """lm-eval's stock arc_easy config reading a seeded `limit`-example subset of the offline data."""
    import lm_eval.tasks

    from ghosted_core.evaluation import task_data, tasks

    stock = yaml.safe_load((Path(lm_eval.tasks.__file__).parent / "arc" / "arc_easy.yaml").read_text())
    ids = tasks.select_examples(tasks.TASKS["arc_easy"].size, limit, seed=0)
    config = {key: stock[key] for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "metric_list")}
    config |= {"task": LM_EVAL_TASK, "dataset_path": "json", "test_split": "test",
               "dataset_kwargs": {"data_files": {"test": str(task_data.subset_jsonl("arc_easy", ids))}}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{LM_EVAL_TASK}.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.slow
def test_lm_eval_runs_on_a_remote_code_export(tiny_model_folder, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` on 5 offline examples."""
    from ghosted_core.model.loading import load_model

    loaded = load_model(str(tiny_model_folder))
    _plan, variants = recovered_variants(loaded.model, (2, 3))
    folder = export_variant(variants["ghost_capped"], loaded.tokenizer, tmp_path / "ghost_capped").folder
    write_lm_eval_task(tmp_path / "tasks", limit=5)
    work = tmp_path / "fresh"
    work.mkdir()
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={folder},trust_remote_code=True,dtype=float32", "--tasks", LM_EVAL_TASK,
                           "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "5",
                           "--output_path", str(work / "results")],
                          cwd=work, env=fresh_env(work), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next((work / "results").rglob("results_*.json")).read_text())
    scores = results["results"][LM_EVAL_TASK]
    assert 0.0 <= scores["acc,none"] <= 1.0
    assert results["n-samples"][LM_EVAL_TASK]["effective"] == 5
    assert results["config"]["model_args"]["trust_remote_code"] in (True, "True")


def test_every_per_layer_config_list_is_sliced(tiny_llama, tmp_path):
    """The family's per-layer lists (`layer_types`) keep the kept blocks' entries in the saved config.json."""
    _plan, variants = recovered_variants(tiny_llama, (1, 4))
    variant = variants["none"]
    kinds = ["full_attention", "sliding_attention", "full_attention", "full_attention", "sliding_attention",
             "full_attention"]
    variant.config.layer_types = kinds  # the variant's own config copy, at the dense length as surgery left it
    config = json.loads((export_variant(variant, None, tmp_path / "none").folder / "config.json").read_text())
    assert config["layer_types"] == [kinds[i] for i in (0, 2, 3, 5)] and config["num_hidden_layers"] == 4


@pytest.mark.parametrize("shape, dtype", [((37, 16), torch.float32), ((5, 6, 7), torch.bfloat16), ((), torch.float32),
                                          ((9,), torch.bfloat16)])
def test_a_fold_in_float64_slabs_equals_the_whole_tensor_at_once(shape, dtype, monkeypatch):
    """The stock fold scales embeddings and fused experts a slab of rows at a time (the float64 transient of a
    49,152 × 4,096 embedding was 1.5 GiB, over the memory plan at C = 4096); every element is exactly what the
    whole tensor in float64 gives."""
    from ghosted_core.export import fold

    monkeypatch.setattr(fold, "SLAB_BYTES", 100)  # a few rows per slab
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    for fn in (lambda w: w * 1.2471, lambda w: (1.0 + w) / 0.8313 - 1.0):
        assert torch.equal(fold.in_float64_slabs(value, fn), fn(value.double()).to(dtype))
