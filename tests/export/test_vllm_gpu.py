"""Stock exports served by vLLM (CUDA and a vLLM install only; skipped elsewhere, with the reason).

vLLM 0.33 pins torch 2.14 and transformers <5.21, so it cannot live in the project's venv: set
GHOSTED_VLLM_PYTHON to the Python of an environment where `import vllm` works. Each export is a
tiny random model with serving-sized heads (vLLM's attention kernels need head_dim 64 here), recovered
by a fold of this project (magcomp_refit; Gemma-3: magcomp, which moves the scale into its post-norm
gains and, tied, into the final norm). vLLM's log-probability of every prompt token (teacher forcing: every
position of every block runs) must equal transformers' to 1e-3, and its greedy tokens must too (random
tiny models repeat one token under greedy decoding, hence the per-position check).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.export.folder import export_variant
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec

VLLM_PYTHON = os.environ.get("GHOSTED_VLLM_PYTHON", "")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),  # vLLM's own start-up and its 900 s subprocess limit
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not VLLM_PYTHON, reason="needs GHOSTED_VLLM_PYTHON: a Python with vLLM (it pins "
                                                        "torch and transformers versions this venv does not have)")]

NEW_TOKENS = 8

# Per folder and prompt, in vLLM from token ids (no tokenizer): the log-probability of each prompt token
# given the ones before it, and the greedy continuation (EOS ignored).
VLLM_RUN = r"""
import json, sys
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
out = {}
for name, folder in job["folders"].items():
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              gpu_memory_utilization=0.2, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=job["new_tokens"], ignore_eos=True, detokenize=False,
                            prompt_logprobs=0)
    result = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params)
    out[name] = [{"tokens": list(r.outputs[0].token_ids),
                  "logprobs": [None if lp is None else lp[ids[t]].logprob for t, lp in enumerate(r.prompt_logprobs)]}
                 for r, ids in zip(result, job["prompts"])]
    del llm
json.dump(out, open(job["out"], "w"))
"""


# The 2025-26 families at serving shapes (64-wide heads; the conftest's tiny config otherwise), recovered by the
# fold each takes (or none): written for the GPU, not yet run on one (no GPU was lent to the session that wrote them).
SERVING_FAMILIES = {"smollm3": "magcomp", "olmo3": "none", "mixtral": "magcomp", "qwen3_moe": "magcomp",
                    "olmoe": "magcomp", "gpt_oss": "magcomp", "qwen3_next": "magcomp", "lfm2": "magcomp",
                    "granitemoehybrid": "magcomp"}


def serving_model(family: str):
    """A random 6-block model with 64-wide heads (eval mode, fp32, tied embeddings)."""
    if family in SERVING_FAMILIES:
        from conftest import make_tiny_model

        return make_tiny_model(family, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                               tie_word_embeddings=family not in ("olmo3", "mixtral", "olmoe", "gpt_oss"),
                               **({"mamba_n_heads": 8} if family == "granitemoehybrid" else {}))
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
                                                   layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                                   + ["sliding_attention"] * 2 + ["full_attention"]))
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("family, operator", [("llama", "magcomp_refit"), ("qwen2", "magcomp_refit"),
                                              ("gemma3", "magcomp"), *SERVING_FAMILIES.items()])
def test_vllm_serves_a_stock_export_with_the_greedy_tokens_of_transformers(family, operator, tmp_path):
    model = serving_model(family)
    plan = PruningPlan(6, (2, 3), "manual")  # Gemma-3 keeps s s s f: its layer_types must follow the kept blocks
    stats = collect_stats(model, plan.boundaries, make_batches(random_tokens(8, 32), None, 4),
                          CalibrationOptions(quiet=True), get_operator(operator).needs)
    fits = [get_operator(operator).fit(s, FitOptions()) for s in stats]
    variant = build_recovered(model, plan, VariantSpec(operator, operator), fits)
    folder = export_variant(variant, None, tmp_path / operator, mode="stock").folder
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and len(config.get("layer_types") or [0] * 4) == 4
    prompts = random_tokens(2, 24, seed=3) % 512  # (2, 24)
    with torch.no_grad():
        greedy = variant.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        logprobs = torch.log_softmax(variant(prompts).logits.double(), -1)  # (2, 24, V)
    job = {"folders": {operator: str(folder)}, "prompts": prompts.tolist(), "new_tokens": NEW_TOKENS,
           "out": str(tmp_path / "vllm.json")}
    done = subprocess.run([VLLM_PYTHON, "-c", VLLM_RUN, json.dumps(job)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    for row, served in enumerate(json.loads(Path(job["out"]).read_text())[operator]):
        expected = [float(logprobs[row, t - 1, prompts[row, t]]) for t in range(1, prompts.shape[1])]
        assert served["logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(served["logprobs"][1:], expected)) < 1e-3
        assert served["tokens"] == greedy[row, prompts.shape[1]:].tolist()
