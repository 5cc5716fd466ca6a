"""The GGUF types people download (f16, q8_0, q6_k, q5_k_m, q4_k_m), written by llama.cpp's own converter and
llama-quantize, scored by llama-perplexity beside transformers' fp32 on the same windows.

Skipped without `make llamacpp`, except in CI (CI=true), where a missing build fails (see test_gguf.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_tiny_model
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.data.corpora import load_corpus
from ghosted_core.evaluation.perplexity import llamacpp_windowed_perplexity
from ghosted_core.export.gguf import GGUFOptions, convert_to_gguf, export_gguf
from ghosted_core.export.llamacpp import llamacpp_generate, llamacpp_perplexity
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec
from test_gguf import PROMPT, export_pruned, llamacpp  # noqa: F401 (llamacpp: a fixture)


def tiny_wide(tokenizer):
    """A tiny random Llama whose rows are 256 wide (llama.cpp's k-quants work on blocks of 256)."""
    return make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True,
                           hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ptb_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "ptb.txt"
    path.write_text(load_corpus("ptb").text[:12_000])  # ~2700 SmolLM2 tokens
    return path


def test_windowed_perplexity_in_transformers_equals_llama_perplexity_on_f32(llamacpp, smollm2_tokenizer, ptb_text,
                                                                            tmp_path):
    """The same windows, the same scored half: transformers fp32 and llama.cpp on an f32 GGUF agree to 1e-4."""
    model = make_tiny_model("llama", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                            tie_word_embeddings=True)
    folder = export_pruned(model, smollm2_tokenizer, (2,), "none", tmp_path / "tiny",
                           torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0)))
    gguf = convert_to_gguf(folder, tmp_path / "tiny-f32.gguf", "f32").path
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for context, chunks in ((64, 5), (128, None)):
        ours = llamacpp_windowed_perplexity(loaded, tokenizer, ptb_text.read_text(), context, chunks)
        theirs = llamacpp_perplexity(gguf, ptb_text, context, chunks)
        assert theirs.context == context and theirs.chunks == (chunks or len(tokenizer(ptb_text.read_text()).input_ids)
                                                               // context)
        print(f"context {context}: transformers fp32 {ours:.6f}, llama.cpp f32 {theirs.value:.6f}")
        assert ours == pytest.approx(theirs.value, rel=1e-4), (context, ours, theirs.value)
    # a window that starts elsewhere changes the number: the agreement is not a coincidence of one constant
    assert llamacpp_windowed_perplexity(loaded, tokenizer, ptb_text.read_text()[500:], 64, 5) != \
        pytest.approx(theirs.value, rel=1e-3)


def test_special_token_strings_in_the_text_are_read_as_llama_cpp_reads_them(llamacpp, ptb_text, tmp_path):
    """Gemma-3's tokenizer has "<unk>" as a special token, and PTB writes "<unk>" for rare words: transformers'
    default reads it as the unknown token (one unpredictable id every ~20 tokens), llama.cpp as plain text. A tiny
    random Gemma-3 with that tokenizer: transformers' reference equals llama-perplexity on an f32 GGUF of the same
    model, and is not what the default tokenization would give."""
    from ghosted_core.evaluation.perplexity import llamacpp_tokens
    from ghosted_core.model.embedded import convert_embedded

    gemma_tokenizer = AutoTokenizer.from_pretrained(convert_embedded("gemma3-270m"))
    text = ptb_text.read_text()
    assert "<unk>" in text and gemma_tokenizer.unk_token == "<unk>"
    assert gemma_tokenizer.unk_token_id not in llamacpp_tokens(gemma_tokenizer, text)
    assert gemma_tokenizer.unk_token_id in gemma_tokenizer(text, add_special_tokens=False)["input_ids"]
    model = make_tiny_model("gemma3", vocab_size=len(gemma_tokenizer), max_position_embeddings=512,
                            tie_word_embeddings=True, query_pre_attn_scalar=6)
    folder = export_pruned(model, gemma_tokenizer, (2,), "none", tmp_path / "tiny",
                           torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0)))
    gguf = convert_to_gguf(folder, tmp_path / "tiny-f32.gguf", "f32").path
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = llamacpp_windowed_perplexity(loaded, AutoTokenizer.from_pretrained(folder), text, 64, 5)
    theirs = llamacpp_perplexity(gguf, ptb_text, 64, 5)
    assert ours == pytest.approx(theirs.value, rel=1e-4), (ours, theirs.value)


def test_windowed_perplexity_refuses_a_short_text(tiny_llama, smollm2_tokenizer):
    from ghosted_core.errors import GhostedError

    with pytest.raises(GhostedError, match="need at least 256"):
        llamacpp_windowed_perplexity(tiny_llama, smollm2_tokenizer, "A short text.", 128)


def test_export_gguf_writes_every_type_asked_with_perplexities(llamacpp, smollm2_tokenizer, ptb_text, tmp_path):
    """q4_k_m and q8_0 from one f16 conversion (not kept: not asked), the k-quant with an importance matrix; each
    file runs in llama.cpp, has its llama-perplexity, and the card and the record list them all."""
    model = tiny_wide(smollm2_tokenizer)
    plan = PruningPlan(model.config.num_hidden_layers, (2, 3), "manual")
    ids = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(3))
    stats = collect_stats(model, plan.boundaries, make_batches(ids, None, 4), CalibrationOptions(quiet=True),
                          get_operator("magcomp_refit").needs)
    fits = [get_operator("magcomp_refit").fit(s, FitOptions()) for s in stats]
    variant = build_recovered(model, plan, VariantSpec("magcomp_refit", "magcomp_refit"), fits)
    options = GGUFOptions(imatrix_text=load_corpus("mix", "calibration").text[:20_000], imatrix_label="mix (test)",
                          eval_text=ptb_text, eval_label="ptb (test)", context=128, ppl_chunks=4, imatrix_chunks=4)
    result = export_gguf(variant, smollm2_tokenizer, tmp_path / "magcomp_refit", "q4_k_m,q8_0", options)

    names = ["magcomp_refit-q4_k_m.gguf", "magcomp_refit-q8_0.gguf"]
    assert [g.path.name for g in result.ggufs] == names and result.gguf == result.folder / names[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["magcomp_refit"]  # the f16 and its folder are gone
    assert not any(f.endswith("f16.gguf") for f in result.files) and set(names) <= set(result.files)
    q4, q8 = result.ggufs
    assert q4.bytes < q8.bytes and q4.outtype == "q4_k_m" and q8.outtype == "q8_0"
    assert result.imatrix == "mix (test)" and result.reference_ppl is not None
    for g in result.ggufs:
        assert g.perplexity.context == 128 and g.perplexity.chunks == 4 and math.isfinite(g.perplexity.value)
        assert len(llamacpp_generate(g.path, PROMPT, max_new_tokens=4).tokens) == 4
    assert q8.perplexity.value == pytest.approx(result.reference_ppl, rel=0.02)  # 8 bits: close to fp32

    card = (result.folder / "README.md").read_text()
    for g in result.ggufs:
        assert f"| `{g.path.name}` | {g.outtype}" in card and f"{g.perplexity.value:.3f}" in card
    assert "importance matrix (`llama-imatrix`) computed on mix (test)" in card and "ptb (test)" in card
    assert f"{result.reference_ppl:.3f}" in card
    record = json.loads(json.dumps(result.to_json()))
    assert [g["type"] for g in record["ggufs"]] == ["q4_k_m", "q8_0"] and record["imatrix"] == "mix (test)"
    assert record["gguf_eval"] == {"text": "ptb (test)", "context": 128, "chunks": 4,
                                   "transformers_fp32_ppl": result.reference_ppl}
    assert record["ggufs"][0]["ppl"] == q4.perplexity.value and record["ggufs"][0]["bytes"] == q4.bytes
    assert record["ggufs"][0]["seconds"] == round(q4.seconds, 2)  # the time to write it, not to score it
    assert record["ggufs"][0]["ppl_seconds"] == round(q4.perplexity.seconds, 2)
    for path in result.folder.iterdir():  # no path of this machine in any file (the imatrix's names are bare)
        assert str(tmp_path).encode() not in path.read_bytes(), path.name


def test_export_gguf_keeps_f16_when_asked_and_skips_a_useless_imatrix(llamacpp, smollm2_tokenizer, tmp_path):
    """f16 asked: kept, beside q8_0. An importance matrix only k-quants use is not computed for q8_0 and f16."""
    model = tiny_wide(smollm2_tokenizer)
    plan = PruningPlan(model.config.num_hidden_layers, (1,), "manual")
    stats = collect_stats(model, plan.boundaries, make_batches(torch.randint(0, 1000, (4, 16)), None, 4),
                          CalibrationOptions(quiet=True))
    variant = build_recovered(model, plan, VariantSpec("none", "none"), [get_operator("none").fit(s, FitOptions())
                                                                         for s in stats])
    result = export_gguf(variant, smollm2_tokenizer, tmp_path / "none", ["q8_0", "f16"],
                         GGUFOptions(imatrix_text="no k-quant asked, so never read"))
    assert [g.outtype for g in result.ggufs] == ["q8_0", "f16"] and result.imatrix is None
    assert all(g.perplexity is None for g in result.ggufs) and result.reference_ppl is None
    assert (result.folder / "none-f16.gguf").stat().st_size > result.ggufs[0].bytes
    assert "perplexity (llama.cpp)" not in (result.folder / "README.md").read_text()


# ---------------------------------------------------------------- the embedded SmolLM2 through the CLI (slow)


@pytest.mark.slow
def test_cli_smollm2_q4_k_m_and_q8_0_run_in_llamacpp(llamacpp, tmp_path, capsys):
    """`--export gguf --gguf_type q4_k_m,q8_0 --gguf_imatrix --gguf_imatrix_chunks 8` on SmolLM2-135M without
    blocks 12-15 (magcomp_refit): each file loads in llama.cpp, q8_0's greedy tokens equal the f16's, every
    perplexity is finite, printed and recorded beside transformers' fp32 on the same windows."""
    from ghosted_core.cli import main

    torch.set_num_threads(2)
    try:
        code = main(["--model", "smollm2-135m", "--device", "cpu", "--pruning_method", "manual",
                     "--layers", "12,13,14,15", "--insert_type", "magcomp_refit", "--train_size", "8",
                     "--seqlen", "128", "--eval_ppl", "ptb", "--eval_max_tokens", "512", "--outdir",
                     str(tmp_path / "out"), "--save_model", str(tmp_path / "saved"), "--export", "gguf",
                     "--gguf_type", "q4_k_m,q8_0", "--gguf_imatrix", "--gguf_imatrix_chunks", "8", "--quiet"])
    finally:
        torch.set_num_threads(1)
    printed = capsys.readouterr().out
    assert code == 0
    export = json.loads((tmp_path / "out" / "results.json").read_text())["exports"]["magcomp_refit"]
    folder = Path(export["folder"])
    files = {g["type"]: g for g in export["ggufs"]}
    assert list(files) == ["q4_k_m", "q8_0"] and not (folder / "magcomp_refit-f16.gguf").exists()
    assert export["imatrix"].startswith("the run's calibration text") and export["imatrix"].endswith(
        "(up to 8 windows of 512 tokens)") and export["gguf_eval"]["text"].startswith("PTB")
    reference = export["gguf_eval"]["transformers_fp32_ppl"]
    print(f"SmolLM2 magcomp_refit: transformers fp32 {reference:.3f}; "
          + "; ".join(f"{t} {g['bytes'] / 1e6:.1f} MB ppl {g['ppl']:.3f} ± {g['ppl_error']:.3f}" for t, g in files.items()))
    for t, g in files.items():
        assert math.isfinite(g["ppl"]) and g["ppl"] > 1 and (folder / g["file"]).stat().st_size == g["bytes"]
        assert f"{g['file']}  {t}  {g['bytes'] / 1e6:.1f} MB  ppl {g['ppl']:.3f}" in printed
    assert f"transformers fp32 on the same windows: {reference:.3f}" in printed
    assert abs(files["q8_0"]["ppl"] / reference - 1) < 0.02  # 8 bits: within 2% of fp32
    assert abs(files["q4_k_m"]["ppl"] / reference - 1) < 0.25 and files["q4_k_m"]["bytes"] < files["q8_0"]["bytes"]

    f16 = convert_to_gguf(folder, tmp_path / "f16.gguf", "f16").path  # the reference the types are judged against
    expected = llamacpp_generate(f16, PROMPT, max_new_tokens=8)
    q8 = llamacpp_generate(folder / files["q8_0"]["file"], PROMPT, max_new_tokens=8)
    q4 = llamacpp_generate(folder / files["q4_k_m"]["file"], PROMPT, max_new_tokens=8)
    assert q8.prompt_tokens == q4.prompt_tokens == expected.prompt_tokens
    assert q8.tokens == expected.tokens, (q8.text, expected.text)
    assert len(q4.tokens) == 8 and q4.text.strip()
    card = (folder / "README.md").read_text()
    assert all(f"`{g['file']}`" in card and f"{g['ppl']:.3f}" in card for g in files.values())
