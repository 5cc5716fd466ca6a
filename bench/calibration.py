"""Calibration cost: our single streamed pass vs the straightforward store-then-solve baseline.

    .venv/bin/python bench/calibration.py            # ~16k, 64k and 256k calibration tokens
    .venv/bin/python bench/calibration.py --quick    # ~4k, 8k and 16k tokens (a few minutes)

Both fit the paper's ghost operator for one boundary of SmolLM2 on the same PTB windows:
- ours: `collect_stats` streams float64 XᵀX, XᵀΔ (and every other operator's statistics)
  per batch, and stops each forward pass after the boundary's last block;
- baseline: what the official code does: a full forward of the causal LM per batch with
  hooks that keep X_pre and X_post in float32 on the CPU, then concatenation, a float64
  copy, and the normal equations (XᵀX + 1e-6 I) M = XᵀΔ.
Each (method, size) runs in its own subprocess, so peak resident memory (ru_maxrss) is
measured alone; "extra" is the peak minus the resident size after loading the model.
Writes bench/results/calibration.json (calibration_quick.json with --quick) and prints the table with time
and memory ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)
from process_memory import rss_bytes  # noqa: E402

SEQLEN = 512


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ours(model, windows, boundary, batch_size):
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
    from ghosted_core.recovery.operators import FitOptions, get_operator

    stats = collect_stats(model, [boundary], make_batches(windows, None, batch_size), CalibrationOptions(quiet=True))
    return get_operator("ghost").fit(stats[0], FitOptions()).update


def _baseline(model, windows, boundary, batch_size):
    import torch

    kept_pre, kept_post = [], []
    layers = model.model.layers
    post_module = layers[boundary.end] if boundary.end < len(layers) else model.model.norm
    hooks = [layers[boundary.start].register_forward_pre_hook(lambda m, a: kept_pre.append(a[0].float().cpu())),
             post_module.register_forward_pre_hook(lambda m, a: kept_post.append(a[0].float().cpu()))]
    try:
        with torch.no_grad():
            for ids in windows.split(batch_size):
                model(input_ids=ids, use_cache=False)  # the whole model, LM head included
    finally:
        for hook in hooks:
            hook.remove()
    x_pre = torch.cat([x.reshape(-1, x.shape[-1]) for x in kept_pre]).double()  # (T, C)
    x_post = torch.cat([x.reshape(-1, x.shape[-1]) for x in kept_post]).double()  # (T, C)
    delta = x_post - x_pre
    eye = torch.eye(x_pre.shape[1], dtype=torch.float64)
    return torch.linalg.solve(x_pre.T @ x_pre + 1e-6 * eye, x_pre.T @ delta)


def worker(method: str, tokens: int, start: int, end: int, batch_size: int, out: str) -> None:
    """One measurement in a fresh process."""
    import ghosted_core  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads
    import torch

    from ghosted_core.data import corpora
    from ghosted_core.model.loading import load_model
    from ghosted_core.plan import Boundary

    torch.set_grad_enabled(False)
    loaded = load_model("smollm2-135m")
    windows, _ = corpora.calibration_windows(loaded.tokenizer, "ptb", max(1, tokens // SEQLEN), SEQLEN, seed=0)
    base = rss_bytes()
    clock = time.perf_counter()
    update = (_ours if method == "ours" else _baseline)(loaded.model, windows, Boundary(start, end), batch_size)
    seconds = time.perf_counter() - clock
    torch.save(update, out + ".pt")
    Path(out).write_text(json.dumps({"method": method, "tokens": int(windows.numel()), "seconds": seconds,
                                     "peak_extra_bytes": peak_bytes() - base, "rss_after_load": base}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--start", type=int, default=12, help="first removed block (streamline's choice for n=7)")
    parser.add_argument("--end", type=int, default=19, help="first surviving block after the run")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--out", default=None, help=out_help("calibration"))
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = str(result_path("calibration", args.quick, args.out))
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.start, args.end, args.batch_size, args.worker_out)
        return

    import torch

    sizes = [4096, 8192, 16384] if args.quick else [16384, 65536, 262144]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="ghosted-calibration-bench-"))
    for tokens in sizes:
        measured = {}
        for method in ("ours", "baseline"):
            out = str(tmp / f"{method}-{tokens}.json")
            subprocess.run([sys.executable, __file__, "--worker", method, str(tokens), "--worker_out", out,
                            "--start", str(args.start), "--end", str(args.end), "--batch_size", str(args.batch_size)],
                           check=True)
            measured[method] = json.loads(Path(out).read_text())
            measured[method]["update"] = torch.load(out + ".pt")
        ours, base = measured["ours"], measured["baseline"]
        agreement = float((ours["update"] - base["update"]).norm() / base["update"].norm())
        rows.append({"tokens": ours["tokens"], "ours_seconds": ours["seconds"], "baseline_seconds": base["seconds"],
                     "speedup": base["seconds"] / ours["seconds"], "ours_peak_extra_mib": ours["peak_extra_bytes"] / 2**20,
                     "baseline_peak_extra_mib": base["peak_extra_bytes"] / 2**20,
                     "memory_ratio": base["peak_extra_bytes"] / max(ours["peak_extra_bytes"], 1),
                     "ghost_relative_difference": agreement})
    report = {"model": "smollm2-135m", "boundary": [args.start, args.end], "seqlen": SEQLEN, "corpus": "ptb (train)",
              "load_average": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"calibration for boundary {args.start}-{args.end - 1} of SmolLM2-135M on PTB (train), seqlen {SEQLEN}; "
          f"load average during the run {os.getloadavg()[0]:.1f}")
    print(f"{'tokens':>8} {'ours s':>8} {'base s':>8} {'speed-up':>8} {'ours MiB':>9} {'base MiB':>9} {'mem ratio':>9} "
          f"{'ghost diff':>10}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['ours_seconds']:>8.1f} {r['baseline_seconds']:>8.1f} {r['speedup']:>7.2f}x "
              f"{r['ours_peak_extra_mib']:>9.1f} {r['baseline_peak_extra_mib']:>9.1f} {r['memory_ratio']:>8.1f}x "
              f"{r['ghost_relative_difference']:>10.1e}")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
