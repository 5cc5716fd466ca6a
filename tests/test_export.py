"""Save → load round trip of recovered variants reproduces their logits exactly."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from conftest import random_tokens
from ghosted_core.errors import GhostedError
from ghosted_core.export import archive_recovered, load_recovered, save_recovered
from ghosted_core.plan import PruningPlan
from test_surgery import recovered_variants


@pytest.mark.parametrize("removed", [(1, 2), (0, 3, 5)])
def test_round_trip_reproduces_logits(tiny_model, tmp_path, removed):
    plan, variants = recovered_variants(tiny_model, removed)
    ids = random_tokens(2, 12, seed=9)
    for name in ("none", "diag", "ghost", "replaceme"):
        variant = variants[name]
        folder = save_recovered(variant, None, tmp_path / name)
        loaded, _tokenizer = load_recovered(folder)
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, variant(ids).logits), name
        config = json.loads((folder / "config.json").read_text())
        assert config["num_hidden_layers"] == 6 - len(plan.removed)
        assert config["ghosted"]["removed_layers"] == list(plan.removed)
        saved_blocks = {k.split(".")[2] for k in _keys(folder) if k.startswith("model.layers.")}
        assert len(saved_blocks) == 6 - len(plan.removed)  # only the surviving blocks


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_dense_model_cannot_be_saved_as_a_variant(tiny_llama, tmp_path):
    with pytest.raises(GhostedError, match="only pruned variants"):
        save_recovered(tiny_llama, None, tmp_path / "dense")


def test_loading_a_plain_folder_is_refused(tmp_path):
    with pytest.raises(GhostedError, match="not a saved recovered model"):
        load_recovered(tmp_path)


def test_zip_archive_unpacks_to_a_loadable_model(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    path = archive_recovered(variants["ghost"], None, tmp_path / "ghost.zip")
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == ["ghost/config.json", "ghost/model.safetensors"]
        archive.extractall(tmp_path / "unpacked")
    loaded, _ = load_recovered(tmp_path / "unpacked" / "ghost")
    ids = random_tokens(1, 10, seed=3)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, variants["ghost"](ids).logits)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # staging folder removed


def test_reloaded_variant_generates_like_the_in_memory_one(tiny_gemma, tmp_path):
    _plan, variants = recovered_variants(tiny_gemma, (2, 3))
    loaded, _ = load_recovered(save_recovered(variants["ghost"], None, tmp_path / "ghost"))
    ids = random_tokens(1, 6)
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(loaded.generate(ids, **greedy), variants["ghost"].generate(ids, **greedy))  # KV cache, layer_types
