"""Depth sweep on a GPU at real width: one-pass sweep against one run per depth, and the time estimate.

    python bench/sweep_gpu.py --out bench/results/sweep_gpu.json            # on a CUDA machine
    .venv/bin/python bench/sweep_gpu.py --device cpu --width 256 --layers 8 --quick   # a smoke run here

No model weights or corpora travel to a bare GPU machine, so this bench builds what it needs
in memory: a random Llama with Llama-3.2-1B's block shapes (C = 2048, 16 blocks, 32/8 heads,
MLP 8192; bf16 on the GPU), a word-level tokenizer over a seeded random text, and that text
as "your text" for calibration and evaluation (disjoint parts). Perplexities of a random
model mean nothing; the bench compares wall time, peak GPU memory and agreement:
- sweep: `run.sweep.run_sweep(options, 2:10:2)`; singles: `run.pipeline.run` per depth, model loaded once;
  the order is sweep, singles, sweep, and each side's mean time is compared;
- the forward pass's share of the measured bf16 matmul rate (`planning.estimate.EFFICIENCY["cuda"]`);
- `planning.estimate.estimate_time` for the sweep against its measured time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEPTHS = (2, 4, 6, 8, 10)
WORDS = 3000  # vocabulary of the random text


def random_text(characters: int, seed: int = 0) -> str:
    """Seeded pseudo-text: words drawn with a Zipf-like law, in sentences and paragraphs."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(WORDS)]
    weights = [1 / (i + 1) for i in range(WORDS)]
    parts, size = [], 0
    while size < characters:
        sentence = " ".join(rng.choices(vocab, weights, k=rng.randint(6, 24))) + "."
        parts.append(sentence + ("\n\n" if rng.random() < 0.1 else " "))
        size += len(parts[-1])
    return "".join(parts)


def word_tokenizer():
    """A fast word-level tokenizer over the random text's vocabulary (built in memory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, ".": 2} | {f"w{i}": i + 3 for i in range(WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    tokenizer.name_or_path = "word-level (bench)"
    return tokenizer


def random_llama(width: int, layers: int, vocab: int, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads, kv = max(width // 64, 1), max(width // 256, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)  # blocks' contributions comparable to the stream, as trained
    model.requires_grad_(False)
    return model


def forward_efficiency(model, device_info, tokens: int, seqlen: int) -> float:
    """Measured FLOP/s of the blocks' forward pass over the measured matmul rate."""
    import torch

    from ghosted_core.memory_parts import estimate_parameters

    ids = torch.randint(0, model.config.vocab_size, (tokens // seqlen, seqlen), device=model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False)
        sync()
        start = time.perf_counter()
        for _ in range(3):
            model.model(input_ids=ids, use_cache=False)
        sync()
        seconds = (time.perf_counter() - start) / 3
    c = model.config.hidden_size
    block_params = (estimate_parameters(model.config) - model.config.vocab_size * c) / model.config.num_hidden_layers
    flops = ids.numel() * model.config.num_hidden_layers * (2 * block_params + 4 * seqlen * c)
    return flops / seconds / device_info.matmul_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="small calibration and evaluation")
    parser.add_argument("--out", default=None, help="results file (default: print only)")
    args = parser.parse_args()

    import ghosted_core  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads
    import torch

    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.planning.estimate import current_device, estimate_time
    from ghosted_core.model.loading import LoadedModel
    from ghosted_core.run.options import RunOptions
    from ghosted_core.run.pipeline import run
    from ghosted_core.run.sweep import run_sweep
    from ghosted_core.data.user_text import USER_CORPUS, from_text

    torch.set_grad_enabled(False)
    cuda = args.device.startswith("cuda")
    device = current_device(args.device)
    tokenizer = word_tokenizer()
    model = random_llama(args.width, args.layers, len(tokenizer), args.device)
    loaded = LoadedModel("random-llama", "local", f"random Llama C={args.width}, {args.layers} blocks", model, tokenizer)
    train, seqlen, eval_tokens = (8, 256, 1024) if args.quick else (64, 512, 8192)
    text = from_text(random_text(int(7 * (train * 1.25 * seqlen + 2 * eval_tokens) * 1.5)), "seeded random words")
    options = RunOptions(model="random-llama", calibration=USER_CORPUS, eval_corpora=(USER_CORPUS,), user_text=text,
                         train_size=train, seqlen=seqlen, eval_max_tokens=eval_tokens, drift_windows=0, quiet=True,
                         calibrate=CalibrationOptions(quiet=True))
    efficiency = forward_efficiency(model, device, 8 * seqlen, seqlen)

    def measure(method: str) -> dict:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        if method == "sweep":
            result = run_sweep(options, DEPTHS, loaded)
            ppl = {str(d.n): d.perplexity[USER_CORPUS] for d in result.results}
            stages = result.timings
        else:
            ppl, stages = {}, {}
            for n in DEPTHS:
                single = run(replace(options, num_prune=n), loaded)
                ppl[str(n)] = {k: v for k, v in single.perplexity[USER_CORPUS].items() if k != "dense"}
                for stage, seconds in single.timings.items():
                    stages[stage] = stages.get(stage, 0.0) + seconds
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
        return {"seconds": seconds, "peak_extra_bytes": peak, "stages": stages, "perplexity": ppl}

    runs = [(m, measure(m)) for m in ("sweep", "singles", "sweep")]
    sweeps = [r for m, r in runs if m == "sweep"]
    singles = runs[1][1]
    sweep_seconds = sum(r["seconds"] for r in sweeps) / len(sweeps)
    difference = max(abs(sweeps[0]["perplexity"][n][v] - singles["perplexity"][n][v]) / singles["perplexity"][n][v]
                     for n in singles["perplexity"] for v in singles["perplexity"][n])
    estimate = estimate_time(model.config, options, device, DEPTHS)
    report = {
        "device": device.to_json(), "model": loaded.description, "depths": list(DEPTHS),
        "calibration": f"your text (seeded random words), {train} x {seqlen} tokens",
        "perplexity_tokens": eval_tokens, "variants": [v.name for v in options.variants],
        "forward_efficiency": efficiency,
        "sweep_seconds": [r["seconds"] for r in sweeps], "singles_seconds": singles["seconds"],
        "speedup": singles["seconds"] / sweep_seconds,
        "sweep_peak_extra_gib": None if not cuda else sweeps[0]["peak_extra_bytes"] / 2**30,
        "singles_peak_extra_gib": None if not cuda else singles["peak_extra_bytes"] / 2**30,
        "perplexity_max_relative_difference": difference,
        "sweep_stages": sweeps[0]["stages"], "singles_stages": singles["stages"],
        "estimate": estimate.to_json(), "sweep_seconds_mean": sweep_seconds,
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("sweep_stages", "singles_stages")}, indent=1))
    print("sweep stages:", {k: round(v, 2) for k, v in sweeps[0]["stages"].items()})
    print("singles stages:", {k: round(v, 2) for k, v in singles["stages"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
