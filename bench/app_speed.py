"""Wall time of the app's default run, through the served API, with the model already cached.

Serves `app.demo` in-process, loads the default model into the app's cache, then presses Run
with the page's own defaults through gradio_client (queue, streaming and formatting included)
and prints the wall time and the per-stage timings of each run. The first run of a process also
reads the corpora from disk; later runs do not, like a server that has served one user.

    .venv/bin/python bench/app_speed.py            # two runs
    .venv/bin/python bench/app_speed.py --runs 3 --json bench/results/app_speed.json

The JSON records the machine (cores, CPU model, GPU): the app quotes it as "a default run takes
about N s on this machine" where the machine matches, and as a scaled estimate elsewhere.

The machine's load average is printed before and after: on a shared machine a busy
neighbour slows every stage, so quote the figure together with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="default runs to time, one after the other")
    parser.add_argument("--json", default=None, help="also write the measurements to this file")
    args = parser.parse_args()

    import app  # first: it imports ghosted_core, which sets OMP_WAIT_POLICY before torch loads

    import torch
    from gradio_client import Client

    from studio.cache import MODELS
    from studio.outputs import OUTPUT_NAMES
    from studio.settings import DEFAULTS
    from studio.speed import machine

    start = time.perf_counter()
    MODELS.get(DEFAULTS.model)
    load_seconds = time.perf_counter() - start
    port = free_port()
    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    d = DEFAULTS
    print(f"default run: {d.model}, {d.criterion} removes {d.depth} blocks, variants dense + {', '.join(d.operators)}; "
          f"calibration {d.calibration} {d.samples} x {d.seqlen} tokens; perplexity on {', '.join(d.eval_corpora)} "
          f"({d.eval_tokens} tokens each); drift on {d.drift_windows} window; {d.new_tokens} new tokens")
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; model load into the cache {load_seconds:.1f} s (not timed below)")

    runs = []
    for index in range(1, args.runs + 1):
        before = os.getloadavg()
        start = time.perf_counter()
        outputs = dict(zip(OUTPUT_NAMES, client.predict(api_name="/run")))
        wall = time.perf_counter() - start
        after = os.getloadavg()
        report = json.loads(Path(outputs["results_file"]).read_text())
        stages = report["timings"]
        runs.append({"run": index, "wall_s": round(wall, 2), "stages_s": stages, "loadavg_before": before,
                     "loadavg_after": after, "removed_layers": report["removed_layers"]})
        print(f"run {index}: {wall:.1f} s wall | load average (1/5/15 min) before {before[0]:.2f}/{before[1]:.2f}/"
              f"{before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}")
        print("    " + " · ".join(f"{stage} {seconds:.1f} s" for stage, seconds in stages.items()))
    app.demo.close()

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"defaults": d.__dict__, "cores": os.cpu_count(), "machine": machine(),
                                               "torch_threads": torch.get_num_threads(), "runs": runs}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
