"""Which blocks? Every selection criterion on the embedded models: the blocks, the cost, what each operator gives back.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/selection.py          # SmolLM2 n=7,10; Gemma-3 n=4,6
    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/selection.py --quick  # SmolLM2 n=7, no sleb timing

Per model, one calibration set (`mix`, `--train_size` windows of `--seqlen` tokens, seed 0, a BOS per
window where the tokenizer adds one) chooses the blocks for every criterion and fits every operator:
`run.compare.run_compare` at each depth, deepest first, with one shared table, so sleb's and
prunecomp's shallower runs are the first rounds of the deeper ones and the swap probes are
measured once (their cost is stated once, at the deeper depth). Perplexity on ptb (exact) and wiki
(stand-in) over the first `--eval_tokens` tokens in `--eval_seqlen` windows, for none, ghost_capped,
the best stock operator (replaceme_keepsink) and magcomp (Prune&Comp's own recovery).

Then sleb side by side with the naive rule on the same windows at n = a quarter of the blocks:
each round one full forward per remaining block (use_cache off, summed cross-entropy, as SLEB's
code does), n·L passes in all. The order is fast, naive, fast again (the machine is shared: the
fast time is the mean of the two). Reported: wall time, process CPU time, the blocks each chose,
and the work ratio: block and head runs per window weighted by their multiply-adds (the naive
count is exact: Σ_r L_r ((L_r − 1) blocks + 1 head)).

Writes bench/results/selection.json (selection_quick.json with --quick) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.calibration.collect import CalibrationOptions  # noqa: E402
from ghosted_core.model.loading import load_model  # noqa: E402
from ghosted_core.model.surgery import build_variant  # noqa: E402
from ghosted_core.planning.advice import default_depth  # noqa: E402
from ghosted_core.run.compare import run_compare  # noqa: E402
from ghosted_core.run.options import RunOptions, parse_variants  # noqa: E402
from ghosted_core.run.pipeline import calibration_batches  # noqa: E402
from ghosted_core.selection.sleb import sleb_order  # noqa: E402
from ghosted_core.selection.suffixes import Work  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
CRITERIA = ("streamline", "shortgpt", "angular", "kl", "sleb", "prunecomp", "swap_kl", "swap_kl_repl", "weights")
OPERATORS = ("none", "ghost_capped", "replaceme_keepsink", "magcomp")
CORPORA = ("ptb", "wiki")


def depths(num_layers: int) -> tuple[int, int]:
    """A quarter and a third of the blocks (30 → 7, 10; 18 → 4, 6)."""
    return default_depth(num_layers), num_layers // 3


def naive_sleb(dense, n: int, batches) -> tuple[list[int], int]:
    """SLEB as its code runs it: each round, one full forward per remaining block; returns the order and passes."""
    num_layers = len(dense.model.layers)
    removed: list[int] = []
    passes = 0
    for _ in range(n):
        alive = [j for j in range(num_layers) if j not in removed]
        totals = []
        for j in alive:
            model = build_variant(dense, [*removed, j])
            total = 0.0
            for batch in batches:
                with torch.no_grad():
                    logits = model(batch.input_ids, use_cache=False).logits  # (B, T, V)
                total += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                                 batch.input_ids[:, 1:].reshape(-1), reduction="sum"))
                passes += 1
            totals.append(total)
        removed.append(alive[min(range(len(alive)), key=lambda p: (totals[p], p))])
    return removed, passes


def multiply_adds(config, seqlen: int) -> tuple[float, float]:
    """Per token: one block (its projections and the attention over ~T/2 keys) and the LM head."""
    c, inner = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or c // heads
    attention = c * head_dim * (2 * heads + 2 * kv) + seqlen * heads * head_dim  # q, o, k, v; scores and values
    return float(attention + 3 * c * inner), float(config.vocab_size * c)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def time_sleb(loaded, options: RunOptions, n: int) -> dict:
    """sleb and the naive rule on the same windows, fast / naive / fast."""
    batches = [b for b in calibration_batches(loaded.tokenizer, options)[0] if not b.heldout]
    dense = loaded.model
    runs = []
    for _ in range(2):
        work = Work()
        result, wall, cpu = timed(lambda: sleb_order(dense, n, batches, work))
        runs.append({"order": list(result.order), "wall": wall, "cpu": cpu, "work": work})
        if len(runs) == 1:
            (naive_order, passes), naive_wall, naive_cpu = timed(lambda: naive_sleb(dense, n, batches))
    windows = sum(len(b.input_ids) for b in batches)
    block, head = multiply_adds(dense.config, options.seqlen)
    layers = len(dense.model.layers)
    naive_macs = sum((layers - r) * ((layers - r - 1) * block + head) for r in range(n))
    work = runs[0]["work"]
    fast_macs = (work.block_runs * block + work.head_runs * head) / windows
    fast_wall = sum(r["wall"] for r in runs) / 2
    fast_cpu = sum(r["cpu"] for r in runs) / 2
    return {"n": n, "windows": windows, "seqlen": options.seqlen, "same_blocks": naive_order == runs[0]["order"],
            "fast": {"order": runs[0]["order"], "wall_seconds": [r["wall"] for r in runs], "cpu_seconds": [r["cpu"] for r in runs],
                     "block_runs_per_window": work.block_runs / windows, "head_runs_per_window": work.head_runs / windows,
                     "passes": work.passes},
            "naive": {"order": naive_order, "wall_seconds": naive_wall, "cpu_seconds": naive_cpu, "passes": passes,
                      "block_runs_per_window": sum((layers - r) * (layers - r - 1) for r in range(n)),
                      "head_runs_per_window": sum(layers - r for r in range(n))},
            "ratio": {"wall": fast_wall / naive_wall, "cpu": fast_cpu / naive_cpu, "multiply_adds": fast_macs / naive_macs}}


def run_model(name: str, args) -> dict:
    loaded = load_model(name)
    options = RunOptions(model=name, variants=parse_variants(OPERATORS), calibration="mix", train_size=args.train_size,
                         seqlen=args.seqlen, heldout_size=2, eval_corpora=CORPORA, eval_seqlen=args.eval_seqlen,
                         eval_max_tokens=args.eval_tokens, drift_windows=0, quiet=True,
                         calibrate=CalibrationOptions(quiet=True, batch_size=4))
    chosen = depths(loaded.num_layers)[:1] if args.quick else depths(loaded.num_layers)
    shared: dict = {}
    out = {"model": name, "description": loaded.description, "num_layers": loaded.num_layers, "depths": {}}
    for n in sorted(chosen, reverse=True):
        start = time.perf_counter()
        report = run_compare(replace(options, num_prune=n), CRITERIA, loaded, shared).to_json()
        out["depths"][str(n)] = {"calibration": report["calibration"], "bos": report.get("bos"),
                                 "corpora": report["corpora"], "compare": report["compare"],
                                 "seconds": time.perf_counter() - start}
        print(f"  {name} n={n}: {time.perf_counter() - start:.0f} s", flush=True)
    if not args.quick:
        out["sleb_timing"] = time_sleb(loaded, replace(options, num_prune=chosen[0]), chosen[0])
        print(f"  {name} sleb timing: {json.dumps(out['sleb_timing']['ratio'])}", flush=True)
    return out


def tables(results: dict) -> str:
    """Markdown: per model and depth, each criterion's blocks, cost and perplexity per operator; the sleb timing."""
    lines = []
    for model in results["models"]:
        for n, depth in sorted(model["depths"].items(), key=lambda kv: int(kv[0])):
            compare = depth["compare"]
            dense = compare["dense"]["ppl"]
            lines += [f"\n{model['model']}, n = {n} of {model['num_layers']} ({compare['calibration_note']}); "
                      f"dense ptb {dense['ptb']:.2f} · wiki {dense['wiki']:.2f}", "",
                      "| criterion | blocks | cost (full-pass equivalents, s) | " + " | ".join(f"{op} ptb / wiki" for op in OPERATORS) + " |",
                      "|---" * (3 + len(OPERATORS)) + "|"]
            for name in compare["criteria"]:
                sel = compare["selections"][name]
                rows = {r["operator"]: r for r in compare["table"] if r["criterion"] == name}
                cost = sel["cost"]
                shared = " (shared)" if cost.get("shared") else ""
                cells = [f"{rows[op]['ppl']['ptb']:.1f} / {rows[op]['ppl']['wiki']:.1f}" for op in OPERATORS]
                lines.append(f"| {name} | {','.join(map(str, sel['removed_layers']))} | "
                             f"{cost.get('full_pass_equivalents', 0):.1f}, {cost['seconds']:.1f}{shared} | "
                             + " | ".join(cells) + " |")
        timing = model.get("sleb_timing")
        if timing:
            lines.append(f"\nsleb vs naive, {model['model']} n = {timing['n']}, {timing['windows']} × {timing['seqlen']}: "
                         f"wall {timing['ratio']['wall']:.2f}×, cpu {timing['ratio']['cpu']:.2f}×, multiply-adds "
                         f"{timing['ratio']['multiply_adds']:.2f}×; same blocks: {timing['same_blocks']} "
                         f"({timing['fast']['order']} vs {timing['naive']['order']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--train_size", type=int, default=12, help="calibration windows (choose the blocks, fit)")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--eval_seqlen", type=int, default=256)
    parser.add_argument("--eval_tokens", type=int, default=2048)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None, help=out_help("selection"))
    args = parser.parse_args()
    torch.manual_seed(0)
    models = ("smollm2-135m",) if args.quick else tuple(args.models.split(","))
    started = time.perf_counter()
    results = {"settings": vars(args), "criteria": CRITERIA, "operators": OPERATORS, "models": []}
    for name in models:
        results["models"].append(run_model(name, args))
    results["seconds"] = time.perf_counter() - started
    path = result_path("selection", args.quick, args.out)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(tables(results))
    print(f"\nwrote {path} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
