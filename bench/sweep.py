"""Depth sweep: one scoring and one calibration pass for every depth, against one run per depth.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/sweep.py           # app defaults, n = 2, 4, 6, 8, 10
    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/sweep.py --quick   # small sizes (writes sweep_quick.json)

Both sides compute the same numbers on the embedded SmolLM2 with the same settings (default
operators, `mix` calibration, perplexity on ptb and wiki, no drift, no generation):
- sweep: `run.sweep.run_sweep(options, depths)`: blocks scored once, one calibration pass over the
  union of every depth's boundaries, the dense model evaluated once, each depth's variants
  evaluated on their suffixes only;
- singles: `run.pipeline.run` once per depth (each scores, calibrates and evaluates on its own),
  with the model loaded once, as the app's model cache does.
Each side runs in its own subprocess, so peak resident memory (ru_maxrss) is measured alone;
"extra" is the peak minus the resident size after loading the model. On a shared machine the
load changes while the bench runs, so the sides run in the order sweep, singles, singles,
sweep (ABBA, `--rounds 2`), and the mean wall time of each side is compared. The table also gives
the largest relative difference between the two sides' perplexities (they must agree) and the
time `planning.estimate.estimate_time` predicted for the sweep on this CPU.
Writes bench/results/sweep.json (or sweep_quick.json, or --out) and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (beside this script)
from calibration import peak_bytes, rss_bytes  # noqa: E402

DEPTHS = (2, 4, 6, 8, 10)
SIZES = {  # (calibration sequences, sequence length, perplexity tokens per corpus)
    "full": (12, 256, 1024),  # the app's defaults
    "quick": (4, 128, 256),
}


def options_for(size: str):
    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.run.options import RunOptions

    train, seqlen, eval_tokens = SIZES[size]
    return RunOptions(model="smollm2-135m", train_size=train, seqlen=seqlen, eval_max_tokens=eval_tokens,
                      eval_corpora=("ptb", "wiki"), drift_windows=0, quiet=True,
                      calibrate=CalibrationOptions(quiet=True))


def worker(method: str, size: str, out: str) -> None:
    """One side of the comparison in a fresh process."""
    import ghosted_core  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads
    import torch

    from ghosted_core.model.loading import load_model
    from ghosted_core.run.pipeline import run
    from ghosted_core.run.sweep import run_sweep

    torch.set_grad_enabled(False)
    options = options_for(size)
    loaded = load_model(options.model)
    base = rss_bytes()
    clock = time.perf_counter()
    perplexity: dict[str, dict[str, dict[str, float]]] = {}  # depth → corpus → variant → ppl
    stages: dict[str, float] = {}
    if method == "sweep":
        result = run_sweep(options, DEPTHS, loaded)
        for depth in result.results:
            perplexity[str(depth.n)] = depth.perplexity
        stages = result.timings
    else:
        for n in DEPTHS:
            single = run(replace(options, num_prune=n), loaded)
            perplexity[str(n)] = {c: {k: v for k, v in t.items() if k != "dense"} for c, t in single.perplexity.items()}
            for stage, seconds in single.timings.items():
                stages[stage] = stages.get(stage, 0.0) + seconds
    seconds = time.perf_counter() - clock
    Path(out).write_text(json.dumps({"method": method, "seconds": seconds, "peak_extra_bytes": peak_bytes() - base,
                                     "rss_after_load": base, "stages": stages, "perplexity": perplexity}))


def _combined(runs: list[dict]) -> dict:
    """Mean wall time and the largest peak over a side's runs (its stages and numbers from the first)."""
    return runs[0] | {"seconds": sum(r["seconds"] for r in runs) / len(runs),
                      "all_seconds": [r["seconds"] for r in runs],
                      "peak_extra_bytes": max(r["peak_extra_bytes"] for r in runs),
                      "load_averages": [r["load_average"] for r in runs]}


def max_relative_difference(a: dict, b: dict) -> float:
    """Largest |a − b| / b over every depth, corpus and variant."""
    return max(abs(a[n][c][v] - b[n][c][v]) / b[n][c][v] for n in b for c in b[n] for v in b[n][c])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; writes beside the full results")
    parser.add_argument("--out", default=None, help=out_help("sweep"))
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds: 1 = sweep then singles, 2 = ABBA")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.worker_out)
        return

    size = "quick" if args.quick else "full"
    out = result_path("sweep", args.quick, args.out)
    tmp = Path(tempfile.mkdtemp(prefix="ghosted-sweep-bench-"))
    load_before = os.getloadavg()
    order = ["sweep", "singles", "singles", "sweep"][: 2 * args.rounds] if args.rounds <= 2 else \
        ["sweep", "singles"] * args.rounds
    runs: dict[str, list[dict]] = {"sweep": [], "singles": []}
    for i, method in enumerate(order):
        path = tmp / f"{i}-{method}.json"
        subprocess.run([sys.executable, __file__, "--worker", method, size, "--worker_out", str(path)], check=True)
        runs[method].append(json.loads(path.read_text()) | {"load_average": os.getloadavg()[0]})
    sweep, singles = (_combined(runs[m]) for m in ("sweep", "singles"))

    from ghosted_core.planning.estimate import current_device, estimate_time
    from ghosted_core.model.loading import peek_config

    options = options_for(size)
    estimate = estimate_time(peek_config(options.model), options, current_device(), DEPTHS)
    train, seqlen, eval_tokens = SIZES[size]
    report = {
        "model": "smollm2-135m", "depths": list(DEPTHS), "criterion": options.criterion,
        "variants": [v.name for v in options.variants], "calibration": f"mix, {train} x {seqlen} tokens",
        "perplexity": f"ptb and wiki (stand-in), {eval_tokens} tokens each", "size": size,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "order": order, "sweep_seconds": sweep["seconds"], "singles_seconds": singles["seconds"],
        "sweep_all_seconds": sweep["all_seconds"], "singles_all_seconds": singles["all_seconds"],
        "load_average_after_each": {"sweep": sweep["load_averages"], "singles": singles["load_averages"]},
        "speedup": singles["seconds"] / sweep["seconds"],
        "sweep_peak_extra_mib": sweep["peak_extra_bytes"] / 2**20,
        "singles_peak_extra_mib": singles["peak_extra_bytes"] / 2**20,
        "perplexity_max_relative_difference": max_relative_difference(sweep["perplexity"], singles["perplexity"]),
        "sweep_stages": sweep["stages"], "singles_stages": singles["stages"],
        "sweep_estimated_seconds": estimate.total - estimate.load, "estimate": estimate.to_json(),
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"depth sweep n = {', '.join(map(str, DEPTHS))} of SmolLM2-135M, {', '.join(report['variants'])}; "
          f"calibration {report['calibration']}; perplexity {report['perplexity']}")
    print(f"load average before {load_before[0]:.1f}, after {report['load_average_after'][0]:.1f}")
    print(f"{'':>22} {'mean wall s':>12} {'each run s':>18} {'peak extra MiB':>15}")
    for label, side, key in (("one-pass sweep", sweep, "sweep"), ("five single runs", singles, "singles")):
        each = ", ".join(f"{s:.1f}" for s in side["all_seconds"])
        print(f"{label:>22} {side['seconds']:>12.1f} {each:>18} {report[key + '_peak_extra_mib']:>15.1f}")
    print(f"speed-up {report['speedup']:.2f}x; perplexities agree to {report['perplexity_max_relative_difference']:.1e} "
          f"(relative); estimate.py predicted {report['sweep_estimated_seconds']:.0f} s for the sweep")
    for label, stages in (("sweep", sweep["stages"]), ("singles", singles["stages"])):
        print(f"  {label} stages: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    print(f"written {out}")


if __name__ == "__main__":
    main()
