"""Inference cost: prefill and decode throughput of dense, pruned and recovered variants.

    .venv/bin/python bench/inference.py            # SmolLM2, 7 of 30 blocks removed, every operator
    .venv/bin/python bench/inference.py --quick

Same prompts for every variant; prefill = one cache-free forward over `--prefill` tokens
(batch `--batch`), decode = `--decode` greedy steps with the KV cache after a short prompt.
Variants are timed in an interleaved order, `--repeats` times, keeping the median, so
machine load affects them alike. Prints tokens/s, the operator's overhead over plain pruning,
and the speed-up over dense next to the ideal L/(L−n).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.data import corpora
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.model.loading import load_model
from ghosted_core.recovery.operators import OPERATORS, FitOptions, get_operator
from ghosted_core.run.options import VariantSpec
from ghosted_core.run.fitting import build_recovered
from ghosted_core.plan import PruningPlan  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--removed", default="12,13,14,15,16,17,18", help="streamline's choice for n=7 on SmolLM2")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter prompts and fewer repeats")
    parser.add_argument("--out", default=None, help=out_help("inference"))
    args = parser.parse_args()
    args.out = str(result_path("inference", args.quick, args.out))
    if args.quick:
        args.prefill, args.batch, args.decode, args.repeats = 256, 2, 32, 2
    torch.set_grad_enabled(False)

    loaded = load_model(args.model)
    dense = loaded.model
    plan = PruningPlan(loaded.num_layers, tuple(int(i) for i in args.removed.split(",")), "manual")
    fit_ids, _ = corpora.calibration_windows(loaded.tokenizer, "mix", 8, 256, seed=0)
    stats = collect_stats(dense, plan.boundaries, make_batches(fit_ids, None, 8), CalibrationOptions(quiet=True))
    variants = {"dense": dense}
    for name in OPERATORS:
        fits = [get_operator(name).fit(s, FitOptions()) for s in stats]
        variants[name] = build_recovered(dense, plan, VariantSpec(name, name), fits)

    windows = corpora.evaluation_windows(loaded.tokenizer, "wiki", args.prefill)
    prompts = windows[: args.batch]  # (B, prefill)
    prompt = windows[0:1, :32]
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in variants}
    for name, model in variants.items():  # warm-up
        model(prompts[:, :16], use_cache=False)
    for _ in range(args.repeats):
        for name, model in variants.items():
            times[name]["prefill"].append(timed(lambda: model(prompts, use_cache=False)))
            times[name]["decode"].append(timed(lambda: model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.decode, min_new_tokens=args.decode,
                do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id)))
    ideal = loaded.num_layers / (loaded.num_layers - len(plan.removed))
    rows = {}
    for name, measured in times.items():
        prefill_tps = prompts.numel() / statistics.median(measured["prefill"])
        decode_tps = args.decode / statistics.median(measured["decode"])
        rows[name] = {"prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps}
    for name, row in rows.items():
        row["prefill_speedup_vs_dense"] = row["prefill_tokens_per_s"] / rows["dense"]["prefill_tokens_per_s"]
        row["decode_speedup_vs_dense"] = row["decode_tokens_per_s"] / rows["dense"]["decode_tokens_per_s"]
        row["prefill_overhead_vs_none"] = rows["none"]["prefill_tokens_per_s"] / row["prefill_tokens_per_s"] - 1
        row["decode_overhead_vs_none"] = rows["none"]["decode_tokens_per_s"] / row["decode_tokens_per_s"] - 1
    report = {"model": args.model, "removed": list(plan.removed), "ideal_speedup": ideal, "prefill_tokens": args.prefill,
              "batch": args.batch, "decode_tokens": args.decode, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(), "variants": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{args.model}, blocks {list(plan.removed)} removed ({loaded.num_layers} → {loaded.num_layers - len(plan.removed)}); "
          f"prefill {args.batch}x{args.prefill} tokens, decode {args.decode} tokens, median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<14}{'prefill tok/s':>14}{'decode tok/s':>14}{'prefill vs dense':>18}{'decode vs dense':>17}"
          f"{'overhead vs none (prefill/decode)':>36}")
    for name, r in rows.items():
        print(f"{name:<14}{r['prefill_tokens_per_s']:>14.0f}{r['decode_tokens_per_s']:>14.1f}"
              f"{r['prefill_speedup_vs_dense']:>17.2f}x{r['decode_speedup_vs_dense']:>16.2f}x"
              f"{100 * r['prefill_overhead_vs_none']:>+17.1f}% / {100 * r['decode_overhead_vs_none']:+.1f}%")
    print(f"ideal speed-up L/(L−n) = {ideal:.2f}x; written {args.out}")


if __name__ == "__main__":
    main()
