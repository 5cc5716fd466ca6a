"""Multimodal checkpoints: the text decoder inside the wrapper is cut, recovered and evaluated as a text model; the
export is the whole checkpoint again (vision tower and projector byte for byte, the sliced text config) and loads
in plain transformers, in a process that cannot import ghosted_core, as the same multimodal class with the
variant's logits and greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from safetensors import safe_open

from conftest import random_tokens
from fresh_process import assert_same_model, load_in_fresh_process
from tiny_multimodal import WRAPPERS, tiny_wrapper_folder
from ghosted_core import cli
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.generation import GenerationOptions
from ghosted_core.export.folder import export_variant
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.model.loading import LoadOptions, load_model, peek_config
from ghosted_core.model.wrapper import WRAPPER_PARAMETERS, wrapped
from ghosted_core.recovery.assessment import Diagnostics
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run

@pytest.mark.parametrize("model_type", WRAPPERS)
def test_multimodal_checkpoint_is_cut_and_exported_whole(model_type, smollm2_tokenizer, tmp_path):
    original = tiny_wrapper_folder(model_type, smollm2_tokenizer, tmp_path / "dense")
    beside = {n: p.clone() for n, p in original.named_parameters() if ".language_model." not in f".{n}"
              and not n.startswith("lm_head")}
    towers = {}  # what transformers' own save wrote outside the decoder (its names: some wrappers rename on save)
    for file in (tmp_path / "dense").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            towers |= {k: handle.get_tensor(k) for k in handle.keys() if "language_model" not in k
                       and not k.startswith("lm_head")}
    assert len(towers) == len(beside)
    planned = peek_config(str(tmp_path / "dense"))
    assert planned.num_hidden_layers == 6 and getattr(planned, WRAPPER_PARAMETERS) == sum(p.numel() for p in
                                                                                           beside.values())
    assert estimate_parameters(planned) == sum(p.numel() for p in original.parameters())  # the whole checkpoint
    loaded = load_model(str(tmp_path / "dense"), LoadOptions(device="cpu"))
    loaded = dataclasses.replace(loaded, tokenizer=smollm2_tokenizer)
    assert wrapped(loaded.model) is not None and type(wrapped(loaded.model).module) is type(original)
    ids = random_tokens(2, 20, seed=2)
    with torch.no_grad():  # the text view is the wrapper's own text path
        torch.testing.assert_close(loaded.model(ids).logits, wrapped(loaded.model).module(input_ids=ids).logits)
    folds = WRAPPERS[model_type][2]
    variants = ",".join(["none", "ghost", *filter(None, folds.split(","))])
    options = RunOptions(model=str(tmp_path / "dense"), criterion="shortgpt", num_prune=2,
                         variants=parse_variants(variants), calibration="ptb", train_size=4, seqlen=32,
                         eval_corpora=("ptb",), eval_max_tokens=128, prompt="The market",
                         generation=GenerationOptions(max_new_tokens=4), quiet=True,
                         load=LoadOptions(device="cpu"), diagnostics=Diagnostics())
    result = run(options, loaded)
    for name, ppl in result.perplexity["ptb"].items():
        assert 1 < ppl < float("inf"), name
    stock = {}
    for name in ["none", *filter(None, folds.split(","))]:
        exported = export_variant(result.models[name], smollm2_tokenizer, tmp_path / name, mode="auto")
        assert exported.mode == "stock"
        stock[name] = exported.folder
        config = transformers.AutoConfig.from_pretrained(exported.folder)
        assert type(config).__name__ == type(original.config).__name__
        assert config.get_text_config().num_hidden_layers == 4
        saved = {}
        for file in exported.folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as handle:
                saved |= {key: handle.get_tensor(key) for key in handle.keys()}
        for key, tensor in towers.items():  # the vision tower and projector, unchanged, under save_pretrained's names
            assert torch.equal(saved[key], tensor), key
    with pytest.raises(GhostedError, match="exports as stock only"):
        export_variant(result.models["ghost"], smollm2_tokenizer, tmp_path / "ghost", mode="auto")
    fresh = load_in_fresh_process(tmp_path / "fresh", stock, ids, trust_remote_code=False,
                                  auto="AutoModelForImageTextToText")
    for name in stock:
        assert fresh[name]["class"] == type(original).__name__, name
        assert_same_model(fresh[name], result.models[name], ids)


def test_cli_refuses_a_remote_code_save_of_a_multimodal_checkpoint_before_work(smollm2_tokenizer, tmp_path, capsys):
    tiny_wrapper_folder("gemma3", smollm2_tokenizer, tmp_path / "dense")
    code = cli.main(["--model", str(tmp_path / "dense"), "--total_num_prune", "1", "--insert_type", "none,ghost",
                     "--save_model", str(tmp_path / "saved"), "--outdir", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "exports as stock only" in err[-1] and "not ghost" in err[-1]
    assert not (tmp_path / "saved").exists()
