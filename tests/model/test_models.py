"""Models: resolving names, clear refusals, architecture support, memory estimates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from conftest import ALL_FAMILIES, TINY_FAMILIES, TINY_LAYERS, _tiny_config, make_tiny_model, random_tokens
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.generation import GenerationOptions
from ghosted_core.export.folder import export_variant, load_recovered
from ghosted_core.hub import hub_reachable
from ghosted_core.model.embedded import EMBEDDED
from ghosted_core.model.loading import LoadOptions, decoder_blocks, load_model, placement, \
    resolve_dtype
from ghosted_core.memory import check_fits
from ghosted_core.memory_parts import estimate_parameters
from ghosted_core.recovery.assessment import Diagnostics
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions
from ghosted_core.distill.targets import TRAINABLES
from ghosted_core.recovery.operators import OPERATORS
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run, run_stages
from ghosted_core.architectures import ARCHITECTURES, architecture_of
from fresh_process import assert_same_model, load_in_fresh_process


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
    with pytest.raises(GhostedError, match="unsupported architecture 'gpt2': no decoder blocks at model.layers.*"
                                           "found transformer.*dense: .*Llama"):
        load_model(str(tmp_path))


def test_a_type_laid_out_as_one_stream_but_not_computing_one_is_refused_before_loading(tmp_path):
    """NanoChat's blocks sit at model.layers with a final norm model.norm, but that norm also runs before the first
    block: refused from the config, before any weight is read (it failed inside the similarity criterion before)."""
    import transformers

    transformers.NanoChatConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                intermediate_size=32, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(GhostedError, match="unsupported architecture 'nanochat': its final norm module also runs on "
                                           "the embeddings before the first block"):
        load_model(str(tmp_path))


def test_blocks_with_several_residual_streams_are_refused_before_loading(tmp_path):
    """DeepSeek-V4's manifold hyper-connections carry hc_mult streams of width C between blocks: no C × C boundary
    map applies, refused from the config (it failed inside the similarity criterion before)."""
    import transformers

    transformers.DeepseekV4Config(num_hidden_layers=2, hidden_size=32, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(GhostedError, match=r"unsupported architecture 'deepseek_v4': its blocks carry \d+ residual "
                                           "streams \(hc_mult"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("config", ["DoryConfig", "Inkling2LoopTextConfig"])
def test_blocks_that_run_several_times_per_forward_are_refused_before_loading(tmp_path, config):
    """Dory's recurrent blocks and Inkling-2's looped passes run some blocks several times per forward: a cut would
    remove a block from every pass. Refused from the config (they failed inside the command line before)."""
    import transformers

    getattr(transformers, config)().save_pretrained(tmp_path)
    with pytest.raises(GhostedError, match=r"unsupported architecture '.*': some of its blocks run \d+ times per "
                                           r"forward \((n_recurrent_loops|loop_num_passes) \d+: a loop\)"):
        load_model(str(tmp_path))


def test_a_head_that_runs_layers_before_its_vocabulary_projection_is_refused(tmp_path):
    """ModernBERT-decoder's lm_head is a dense layer and a norm, its vocabulary projection another module: refused in
    one line at load (the perplexity took the head's C outputs for logits and failed on the first target before)."""
    import transformers

    config = transformers.ModernBertDecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2, pad_token_id=0,
                                                  bos_token_id=1, eos_token_id=2, cls_token_id=3, sep_token_id=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(GhostedError, match=r"^unsupported architecture 'modernbert-decoder': its LM head "
                                           r"\(ModernBertDecoderPredictionHead\) runs layers before the vocabulary"):
        load_model(str(tmp_path), LoadOptions(device="cpu"))


def test_a_gemma4_e2b_cut_that_loses_shared_keys_and_values_is_refused_and_sleb_keeps_them(tiny_folder):
    """Gemma 4 E2B's last blocks attend with the keys and values of the last earlier block of their kind: a manual
    cut that removes such a block is refused in one line before any calibration or fit; sleb, which runs blocks
    one at a time from cached streams (carrying the stored keys and values), runs and keeps them."""
    def options(criterion: str, layers: tuple[int, ...]) -> RunOptions:
        return RunOptions(model=str(tiny_folder("gemma4_e2b")), criterion=criterion, layers=layers, num_prune=2,
                          variants=parse_variants("none"), calibration="ptb", train_size=2, seqlen=16,
                          eval_corpora=("ptb",), quiet=True, load=LoadOptions(device="cpu"))
    stages = []
    with pytest.raises(GhostedError, match=r"^block 3 must stay: the keys and values it computes are reused by the "
                                           r"last 2 blocks") as caught:
        for stage, _ in run_stages(options("manual", (3,))):
            stages.append(stage)
    assert "\n" not in str(caught.value) and stages == ["load model"]
    result = None
    for _stage, result in run_stages(options("sleb", ())):
        pass
    removed = result.plan.removed
    assert len(removed) == 2 and not set(removed) & {2, 3, 5}, removed


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


def test_unknown_or_absent_device_is_refused():
    with pytest.raises(GhostedError, match="unknown device"):
        load_model("smollm2-135m", LoadOptions(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(GhostedError, match="no CUDA GPU"):
            load_model("smollm2-135m", LoadOptions(device="cuda"))


def test_dtype_is_fp32_on_cpu_bf16_on_gpu_unless_asked(tiny_model_folder, monkeypatch):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == torch.float16 and resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto", "map") == torch.bfloat16  # an accelerate map with a GPU in it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "map") == torch.float32
    with pytest.raises(GhostedError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", "cpu")
    loaded = load_model(str(tiny_model_folder), LoadOptions(device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}


def test_placement_loads_straight_onto_the_device(monkeypatch):
    """One device: from_pretrained gets device_map=<device> (each tensor lands there, no whole-model CPU copy)."""
    assert placement("m", LoadOptions(device="cpu")) == {"dtype": torch.float32, "device_map": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert placement("m", LoadOptions()) == {"dtype": torch.bfloat16, "device_map": "cuda"}
    assert placement("m", LoadOptions(device="cuda:1", dtype="float32")) == {"dtype": torch.float32,
                                                                           "device_map": "cuda:1"}
    mapped = placement("org/m", LoadOptions(device="map", max_memory={0: 2**30, "cpu": 2**31}, offload_folder="/x"))
    assert mapped == {"dtype": torch.bfloat16, "device_map": "auto", "max_memory": {0: 2**30, "cpu": 2**31},
                      "offload_folder": "/x"}
    assert placement("org/m", LoadOptions(device="map"))["offload_folder"].endswith("offload/org_m")
    with pytest.raises(GhostedError, match="apply to --device map only"):
        placement("m", LoadOptions(device="cpu", max_memory={"cpu": 2**30}))


def test_every_family_in_the_table_has_a_tiny_config():
    assert {_tiny_config(family)[1].model_type for family in TINY_FAMILIES} == set(ARCHITECTURES)


def family_variants(family: str) -> str:
    """The least-squares fits, the sequential fit and every fold the family takes (refused ones are not asked)."""
    config = _tiny_config(family)[1]
    arch = architecture_of(config)
    folds = [name for name, need in (("magcomp", "scale"), ("replaceme", "branch")) if arch.refusal(need, name, config) is None]
    return ",".join(["none", "ghost", "ghost+seq", *folds])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_runs_the_whole_pipeline(tiny_folder, smollm2_tokenizer, family, tmp_path):
    """Every family in the table: load → score → calibrate → fit → perplexity, drift, generation, tasks → export →
    reload. Stock exports reload in plain transformers in a process that cannot import ghosted_core, as the same
    class, with the same logits and greedy tokens; the others reload through their modeling file, exactly (to
    rounding where the cut rescales depth-scaled writers, folded into the saved weights: MiniCPM3)."""
    loaded = load_model(str(tiny_folder(family)), LoadOptions(device="cpu"))
    # the folder's tokenizer is SmolLM2's; the session's copy has its corpus tokens cached on disk across runs
    loaded = dataclasses.replace(loaded, tokenizer=smollm2_tokenizer)
    variants = family_variants(family)
    options = RunOptions(model=str(tiny_folder(family)), criterion="shortgpt", num_prune=2,
                         variants=parse_variants(variants), calibration="ptb", train_size=4, seqlen=32,
                         eval_corpora=("ptb",), eval_max_tokens=128, prompt="The market", tasks=("copa",),
                         task_limit=3, generation=GenerationOptions(max_new_tokens=4), quiet=True,
                         load=LoadOptions(device="cpu"), diagnostics=Diagnostics())
    result = run(options, loaded)
    assert result.model_description.startswith("local folder") and result.num_layers == TINY_LAYERS
    stock_class = type(result.models["dense"]).__name__
    assert stock_class == _tiny_config(family)[0].__name__
    for name, ppl in result.perplexity["ptb"].items():
        assert 1 < ppl < float("inf"), name
    for name in ("none", "ghost", "ghost+seq", *(["replaceme"] if "replaceme" in variants else [])):
        for report in result.fits[name]:  # a least-squares fit: W = I is feasible, so never worse on its own tokens
            assert report.fit_error <= 1 + 1e-9, (family, name, report)
    assert set(result.generations) == set(result.models) and set(result.drift) == set(result.models) - {"dense"}
    assert {name: scores.scores[0].n for name, scores in result.tasks.items()} == dict.fromkeys(result.models, 3)
    ids = random_tokens(2, 20, seed=2)
    stock = {}
    for name in variants.split(","):
        variant = result.models[name]
        with torch.no_grad():
            full = variant(ids, use_cache=False).logits
            prefill = variant(ids[:, :12], use_cache=True)
            step = variant(ids[:, 12:13], past_key_values=prefill.past_key_values, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], full[:, 12], rtol=1e-4, atol=1e-4, msg=f"{family} {name} cache")
        exported = export_variant(variant, result.tokenizer, tmp_path / name.replace("+", "_"))
        if exported.mode == "stock":
            stock[name] = exported.folder
        else:
            reloaded, _ = load_recovered(exported.folder)
            if architecture_of(variant.config).depth_scaled:  # the view scales its writers' outputs; the file, weights
                torch.testing.assert_close(reloaded(ids).logits, full, rtol=1e-5, atol=1e-4, msg=f"{family} {name}")
            else:
                assert torch.equal(reloaded(ids).logits, full), f"{family} {name} reload"
    assert set(stock) >= {"none"} | ({"magcomp"} & set(variants.split(",")))
    fresh = load_in_fresh_process(tmp_path / "fresh", stock, ids, trust_remote_code=False)
    for name, folder in stock.items():
        assert fresh[name]["class"] == stock_class, name
        assert_same_model(fresh[name], result.models[name], ids)


EVERY_VARIANT = ",".join([*(name for name in OPERATORS), "ghost+seq", *(f"ghost+kd_{t}" for t in TRAINABLES
                                                                       if t != OPERATOR_TARGET), "ghost+kd"])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_operator_and_distillation_target_runs_on_every_family_or_is_refused_in_one_line(tiny_folder,
                                                                                               smollm2_tokenizer, family):
    """Every recovery operator, the sequential fit and every distillation target (two steps each) on every family:
    those the family takes all come out of one run with finite logits; each of the others is refused alone, in one
    line, before any work (`check_family`). The whole-pipeline test above runs a few of them to export and reload."""
    from ghosted_core.run.options import check_family

    loaded = load_model(str(tiny_folder(family)), LoadOptions(device="cpu"))
    loaded = dataclasses.replace(loaded, tokenizer=smollm2_tokenizer)  # its corpus tokens are cached across runs
    taken, refused = [], {}
    for variant in parse_variants(EVERY_VARIANT):
        try:
            check_family(RunOptions(variants=(variant,)), loaded.model.config)
            taken.append(variant)
        except GhostedError as err:
            refused[variant.name] = str(err)
    assert all("\n" not in why for why in refused.values()), refused
    assert {"none", "ghost", "ghost+seq", "diag", "ghost+kd_lora"} <= {v.name for v in taken}, (family, refused)
    options = RunOptions(model=str(tiny_folder(family)), criterion="shortgpt", num_prune=2, variants=tuple(taken),
                         calibration="ptb", train_size=4, seqlen=32, eval_corpora=(), quiet=True,
                         load=LoadOptions(device="cpu"), distill=DistillOptions(steps=2, batch_size=1, val_sequences=1))
    result = run(options, loaded)
    assert set(result.models) == {"dense", *(v.name for v in taken)}
    ids = random_tokens(2, 12, seed=2)
    for name, model in result.models.items():
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all(), (family, name)


def test_embedded_registry():
    assert {"smollm2-135m", "gemma3-270m"} <= set(EMBEDDED)


@pytest.mark.parametrize("model_type", [*ARCHITECTURES, "starcoder2", "cohere"])  # in the table, and not
def test_remote_code_classes_wrap_whatever_class_the_config_names(model_type):
    """modeling_ghosted writes no class per family: the names an export's auto_map points at are built from the stock
    class of the same name, and the config's model type says which."""
    import transformers

    from ghosted_core.model import modeling_ghosted

    config_cls, model_cls = modeling_ghosted.ghosted_classes(model_type)
    stock_config = transformers.CONFIG_MAPPING[model_type]
    assert config_cls.model_type == f"ghosted_{model_type}" and issubclass(config_cls, stock_config)
    assert getattr(modeling_ghosted, config_cls.__name__) is config_cls  # what transformers' getattr finds
    assert getattr(modeling_ghosted, model_cls.__name__) is model_cls and model_cls.config_class is config_cls
    assert modeling_ghosted.ghosted_classes(f"ghosted_{model_type}") == (config_cls, model_cls)
    with pytest.raises(AttributeError):
        modeling_ghosted.GhostedNoSuchModelForCausalLM
