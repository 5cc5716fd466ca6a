"""One GPU check of at most 8 minutes: the whole pipeline at Llama-3.1-8B's shape, timed, its peak against the plan.

    python bench/gpu_check.py                 # on the lent GPU (bf16, random weights of Llama-3.1-8B's shape)
    python bench/gpu_check.py --tiny          # the same script on this CPU at a tiny shape (checks it runs)

A random Llama with Llama-3.1-8B's shapes (hidden 4096, intermediate 14336, 32 blocks, 32 heads, 8 KV
heads, vocabulary 128256, untied: 8.03 B parameters) is built on the GPU in bf16, with nothing read from
disk or the Hub (the device machine reaches neither). The calibration text is synthetic (Zipf-distributed
words through a word-level tokenizer, passed as the user's own text): this checks devices, dtypes,
time and memory, not quality. The run: streamline removes 8 blocks; 128 × 2048 calibration tokens; every
registered operator's fit; one distilled variant for 20 steps; perplexity on 8 × 2048 tokens; and the
size-and-speed stage. Printed and written to bench/results/gpu_check.json: each stage's seconds, the peak
GPU memory allocated against the memory plan's device figure, and the variants' perplexities.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import numpy as np  # noqa: E402
import torch  # noqa: E402

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=1024)
WORDS = 30_000  # synthetic vocabulary


def synthetic_text(words: int, seed: int = 0) -> str:
    """Zipf-distributed words w0 … w29999, in lines of 24 (so that the word-level tokenizer's ids vary as text's do)."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, size=words) - 1, WORDS - 1)
    return "\n".join(" ".join(f"w{i}" for i in ids[k:k + 24]) for k in range(0, words, 24))


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(WORDS)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (a check that the script runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from ghosted_core.data.user_text import USER_CORPUS, UserText
    from ghosted_core.distill.options import DistillOptions
    from ghosted_core.export.gain import SpeedOptions
    from ghosted_core.model.loading import LoadedModel, LoadOptions
    from ghosted_core.recovery.operators import OPERATORS
    from ghosted_core.run.options import RunOptions, parse_variants
    from ghosted_core.run.pipeline import run_stages

    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.tiny else LLAMA_31_8B
    seqlen, sequences = (256, 16) if args.tiny else (2048, 128)
    clock = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()
    model.requires_grad_(False)
    build_s = time.perf_counter() - clock
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens_needed = (sequences + sequences // 8 + 40) * seqlen + 8 * seqlen * 2
    text = UserText(synthetic_text(int(tokens_needed * 1.1)), "synthetic words", 1)
    loaded = LoadedModel("random Llama-3.1-8B shape", "local", "random weights, Llama-3.1-8B's shapes", model,
                         word_tokenizer())
    variants = ",".join([*OPERATORS, "ghost_capped+kd"])
    options = RunOptions(
        model="random", load=LoadOptions(device=device, dtype="bfloat16" if cuda else "float32"),
        criterion="streamline", num_prune=8 if not args.tiny else 2, variants=parse_variants(variants),
        calibration=USER_CORPUS, train_size=sequences, seqlen=seqlen, eval_corpora=(USER_CORPUS,),
        eval_max_tokens=8 * seqlen, drift_windows=0, distill=DistillOptions(steps=20), speed=SpeedOptions(),
        user_text=text, quiet=True)
    stages: dict[str, float] = {}
    last = time.perf_counter()
    result = None
    for stage, result in run_stages(options, loaded):
        now = time.perf_counter()
        stages[stage] = stages.get(stage, 0.0) + now - last
        last = now
        print(f"{stage}: {stages[stage]:.1f} s" + (f", peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                                                   if cuda else ""), flush=True)
    plan = result.memory_plan.to_json() if result.memory_plan else {}
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
        "dtype": str(dtype), "parameters": sum(p.numel() for p in model.parameters()), "build_s": build_s,
        "calibration": f"{sequences} × {seqlen} synthetic tokens", "removed": list(result.plan.removed),
        "variants": variants.split(","), "stages_s": stages, "total_s": sum(stages.values()),
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "plan": plan, "perplexity": result.perplexity, "notes": result.notes, "load_average": os.getloadavg(),
    }
    out = result_path("gpu_check", args.tiny, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    planned = plan.get("device_bytes") if cuda else plan.get("host_bytes")
    print(f"total {report['total_s']:.0f} s on {report['device']}; peak GPU allocated "
          f"{(report['peak_gpu_allocated_bytes'] or 0) / 2**30:.2f} GiB against the plan's "
          f"{(planned or 0) / 2**30:.2f} GiB ({plan.get('peak_phase')}); written {out}")


if __name__ == "__main__":
    main()
