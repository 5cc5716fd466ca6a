"""The size-and-speed stage at C = 4096: its peak memory against its declaration, and its time.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/gain_scale.py      # writes bench/results/gain_scale.json

A random Llama with Llama-3-8B's shapes (C = 4096, I = 14336, 32 heads, 8 KV heads, vocabulary 128,256, fp32,
the LM head tied to the embeddings) and 4 blocks is saved once; the registry test's worker
(`tests/memory_peaks.py`, case `stage:size_and_speed`) loads it in a process of its own, fits plain pruning and
magcomp on block 1 (8 windows of 512 tokens), and measures `export.gain.measure_gain` on dense and the two
variants (the run's default 64-token prompt and 8 new tokens, one round) from a settled heap: the peak resident
size above it, against `memory_parts.speed_bytes`. Sizes are counted on the meta device, so the walk over the
export's tensors (magcomp's scaled writers, the embeddings a stream scale multiplies) allocates nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)
from scale import build_model  # noqa: E402

MIB, GIB = 2**20, 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--out", default=None, help=out_help("gain_scale"))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gain_c4096_"))
    try:
        model = build_model("llama-3-8b", args.blocks)
        model.save_pretrained(folder)
        del model
        gc.collect()
        clock = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_peaks.py"), str(folder),
                               "stage:size_and_speed"], capture_output=True, text=True, check=True)
        (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    wall = time.perf_counter() - clock
    measured, planned = row["measured"], row["planned"]
    print(f"size and speed at C = 4096 ({args.blocks} blocks, dense + none + magcomp, 64 + 8 tokens, one round): "
          f"measured {measured / MIB:.1f} MiB, planned {planned / MIB:.1f} MiB ({planned / measured:.2f}x); "
          f"stage {row['seconds']:.1f} s, worker {wall:.0f} s (load, calibration and fits included); weights "
          + ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in row["weight_bytes"].items()))
    out = result_path("gain_scale", False, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row | {"blocks": args.blocks, "worker_s": wall}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
