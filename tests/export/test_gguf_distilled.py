"""A distilled stock variant through llama.cpp's own converter and tools: its trained MLP copy and its merged
low-rank changes run in llama.cpp as in plain transformers (a process that cannot import ghosted_core)."""

from __future__ import annotations

import pytest

from ghosted_core.distill.options import DistillOptions
from ghosted_core.export.gguf import export_gguf, llamacpp_generate
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from test_gguf import NEW_TOKENS, PROMPT, fresh_greedy, llamacpp  # noqa: F401 (llamacpp: a fixture)


@pytest.fixture(scope="module")
def distilled(peaked_model_folder):
    options = RunOptions(model=str(peaked_model_folder), criterion="manual", layers=(2, 3),
                         variants=parse_variants("none+kd_mlp,magcomp_refit+kd_lora"), calibration="ptb",
                         train_size=6, seqlen=32, eval_corpora=(), drift_windows=0,
                         distill=DistillOptions(steps=3, lr=3e-3, eval_every=1, patience=0), quiet=True)
    return run(options)


@pytest.mark.parametrize("name", ["none+kd_mlp", "magcomp_refit+kd_lora"])
def test_distilled_stock_variant_runs_in_llamacpp_as_in_transformers(distilled, name, llamacpp, tmp_path):
    assert distilled.distill[name].best_val < distilled.distill[name].start_val  # it did train
    result = export_gguf(distilled.models[name], distilled.tokenizer, tmp_path / name, "f16")
    assert result.mode == "stock" and result.gguf.exists()
    assert "Distilled after the fit" in (result.folder / "README.md").read_text()
    generated = llamacpp_generate(result.gguf, PROMPT, max_new_tokens=NEW_TOKENS)
    expected = fresh_greedy(result.folder, tmp_path / "fresh")
    assert expected["class"] == "LlamaForCausalLM"
    assert list(generated.prompt_tokens) == expected["prompt"]
    assert list(generated.tokens) == expected["tokens"]
