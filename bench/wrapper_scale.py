"""A multimodal checkpoint at a real text width, through the command line: cut, recovered, exported whole, reloaded.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/wrapper_scale.py     # bench/results/wrapper_scale.json

A random Gemma-3-style multimodal checkpoint (Gemma3ForConditionalGeneration) whose text decoder has the 12B's
block shape at C = 4096 (16 heads of 256, 8 kv heads, I = 15360) and 3 blocks, SmolLM2's vocabulary (49,152) and
its tokenizer, and a small SigLIP tower (2 blocks of 256): fp32, about 3.7 GB. The CLI removes the middle block (a
manual cut, so that magcomp's scale folds into the first block's writers rather than vanishing in the final norm),
fits none and magcomp (the stock fold Gemma-3 takes) on 16 × 512 tokens of PTB, scores perplexity on 2,048 tokens,
generates, and saves both variants as stock checkpoints. Measured: the process's peak resident size
(VmHWM, reset after imports; the checkpoint is built in a child process) above the process before the CLI,
against the memory plan the run printed (its total, weights included), the time per stage, and, in a fresh
process that imports only transformers, that each saved folder loads as Gemma3ForConditionalGeneration with the
tower's tensors unchanged and gives the CLI's greedy text. Memory grows with C² × blocks (weights) and C × tokens
(activations, statistics); time with tokens × C² × blocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from bench_paths import result_path  # noqa: E402  (bench/ is the script's folder)
TEXT = dict(hidden_size=4096, intermediate_size=15360, num_hidden_layers=3, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, sliding_window=512, max_position_embeddings=4096,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
VISION = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, image_size=64,
              patch_size=16)
PROMPT = "The market"

# Runs in a fresh process that cannot import ghosted_core: the saved folder as users load it.
RELOAD = r"""
import json, sys, torch
sys.modules["ghosted_core"] = None
from transformers import AutoModelForImageTextToText, AutoTokenizer
folder, prompt, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
tower = {k: float(v.double().sum()) for k, v in model.state_dict().items() if "vision_tower" in k}
print(json.dumps({"class": type(model).__name__, "text": tokenizer.decode(out[0, ids.shape[1]:]),
                  "blocks": model.config.text_config.num_hidden_layers, "tower_sum": sum(tower.values()),
                  "tower_tensors": len(tower)}))
"""


def build(folder: Path, tokenizer) -> dict:
    """The random checkpoint, saved; its tower's checksum (what the export must keep)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=TEXT | {"vocab_size": len(tokenizer)}, vision_config=VISION,
                                       mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tower = {k: float(v.double().sum()) for k, v in model.state_dict().items() if "vision_tower" in k}
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "tower_sum": sum(tower.values()), "tower_tensors": len(tower)}


def smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    from ghosted_core.model.embedded import EMBEDDED

    spec = EMBEDDED["smollm2-135m"]
    return AutoTokenizer.from_pretrained(importlib.util.find_spec(spec.package).submodule_search_locations[0],
                                         gguf_file=spec.gguf_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)  # the child that writes the checkpoint
    args = parser.parse_args()
    if args.build:  # in its own process, so that building leaves nothing in the measured one
        print(json.dumps(build(Path(args.build), smollm2_tokenizer())))
        return
    from ghosted_core import cli
    from process_memory import reset_peak, status_bytes

    record: dict = {"text": TEXT, "vision": VISION}
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "dense", Path(tmp) / "out"
        started = time.perf_counter()
        built = subprocess.run([sys.executable, __file__, "--build", str(folder)], capture_output=True, text=True,
                               check=True)
        record["dense"] = json.loads(built.stdout.strip().splitlines()[-1])
        record["build_seconds"] = round(time.perf_counter() - started, 1)
        reset_peak()
        base = status_bytes("VmRSS")  # the process with torch, transformers and ghosted_core imported
        started = time.perf_counter()
        code = cli.main(["--model", str(folder), "--pruning_method", "manual", "--layers", "1",
                         "--total_num_prune", "1", "--insert_type", "none,magcomp", "--calibration_data", "ptb",
                         "--train_size", "16", "--seqlen", "512", "--eval_ppl", "ptb", "--eval_max_tokens", "2048",
                         "--prompt", PROMPT, "--max_new_tokens", "8", "--save_model", str(out / "models"),
                         "--export", "stock", "--outdir", str(out), "--no_speed", "--device", "cpu"])
        record["cli_seconds"] = round(time.perf_counter() - started, 1)
        if code not in (0, None):
            raise SystemExit(f"the CLI refused (exit {code})")
        result = json.loads((out / "results.json").read_text())
        record["peak_rss_gib"] = round(status_bytes("VmHWM") / 2**30, 2)
        record["rss_before_cli_gib"] = round(base / 2**30, 2)
        record["peak_above_start_gib"] = round((status_bytes("VmHWM") - base) / 2**30, 2)
        plan = result["memory_plan"]
        record["plan_total_gib"] = round(plan["total"] / 2**30, 2)
        record["stage_seconds"] = result.get("timings", {})
        record["variants"] = {}
        for name in ("none", "magcomp"):
            reloaded = subprocess.run([sys.executable, "-c", RELOAD, str(out / "models" / name), PROMPT, "8"],
                                      capture_output=True, text=True, check=True, cwd="/")
            seen = json.loads(reloaded.stdout.strip().splitlines()[-1])
            cli_text = result["variants"][name].get("generation")
            seen["same_text_as_cli"] = seen["text"] == cli_text
            seen["tower_unchanged"] = (seen["tower_tensors"] == record["dense"]["tower_tensors"]
                                       and abs(seen["tower_sum"] - record["dense"]["tower_sum"]) < 1e-6 * max(
                                           1.0, abs(record["dense"]["tower_sum"])))
            record["variants"][name] = seen
    path = result_path("wrapper_scale", out=args.out)
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k not in ("text", "vision")}, indent=1))
    print(f"peak RSS {record['peak_rss_gib']} GiB ({record['peak_above_start_gib']} above the process before the CLI) "
          f"against the plan's {record['plan_total_gib']} GiB "
          f"({record['peak_above_start_gib'] / record['plan_total_gib']:.2f}x); written {path}")


if __name__ == "__main__":
    main()
