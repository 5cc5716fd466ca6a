"""Zero-shot task evaluation: our shared-prefix evaluator against lm-eval's HFLM, on the same requests, in one run.

    .venv/bin/python bench/tasks_speed.py            # SmolLM2-135M fp32, dense + 6 variants, 9 tasks × 50 examples
    .venv/bin/python bench/tasks_speed.py --quick    # 3 tasks × 12 examples
    .venv/bin/python bench/tasks_speed.py --model qwen2.5-coder-1.5b --dtype bfloat16 --limit 20

Both engines run through lm-eval (its task configs, prompts and metrics) on the offline task data: HFLM
once per model, ours (`evaluation.lm_eval_model.SharedPrefixLM`) once for all of them. The variants are
streamline's cut of a quarter of the blocks with the default operators, views sharing the dense weights.
Printed: wall time per engine and their ratio, the largest difference in any request's log-likelihood,
whether every greedy flag and every per-example outcome is the same, and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.evaluation import tasks as task_eval  # noqa: E402
from ghosted_core.model.loading import LoadOptions, load_model  # noqa: E402
from ghosted_core.planning.advice import default_depth  # noqa: E402
from ghosted_core.run.options import DEFAULT_VARIANTS, RunOptions, parse_variants  # noqa: E402
from ghosted_core.run.pipeline import run  # noqa: E402

TASKS = ["arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa", "rte", "copa", "piqa"]


def recording(lm):
    """Wrap an lm-eval model's loglikelihood so that every (request args → answer) is kept."""
    seen: dict = {}
    inner = lm.loglikelihood

    def loglikelihood(requests, disable_tqdm: bool = False):  # noqa: ANN001
        answers = inner(requests, disable_tqdm=True)
        seen.update({r.args: a for r, a in zip(requests, answers)})
        return answers

    lm.loglikelihood = loglikelihood
    return seen


def timed_engine(engine: str, dense, models, tokenizer, names, limit, batch_size):
    """(seconds, {model: {task: TaskScore}}, {model: {args: answer}}) for one engine over every task and model."""
    with task_eval._quiet_lm_eval(), task_eval._no_context_bar(), task_eval._hub_offline():
        lms = task_eval._make_lms(dense, models, tokenizer, batch_size, False, engine, task_eval.ScoringOptions())
        answers = {name: recording(lm) for name, lm in lms.items()}
        start = time.perf_counter()
        scores = {name: {} for name in models}
        for task in names:
            loaded = task_eval._load_task(task, limit, 0, hub=False)
            for name, lm in lms.items():
                scores[name][task] = task_eval._run_task(lm, task, limit, 0, False, loaded)
        return time.perf_counter() - start, scores, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=8, help="HFLM's batch size")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="the variants beside dense (default: the run's six defaults)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help=out_help("tasks_speed"))
    args = parser.parse_args()
    out = result_path("tasks_speed", args.quick, args.out)
    names = ["copa", "arc_easy", "winogrande"] if args.quick else TASKS
    limit = 12 if args.quick else args.limit
    torch.set_grad_enabled(False)

    loaded = load_model(args.model, LoadOptions(dtype=args.dtype))
    depth = default_depth(loaded.num_layers)
    names_of_variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    pruned = run(RunOptions(model=args.model, num_prune=depth, variants=parse_variants(",".join(names_of_variants)),
                            calibration="mix", train_size=16, seqlen=256, eval_corpora=(), drift_windows=0,
                            quiet=True), loaded)
    models = {name: pruned.models[name] for name in ["dense", *names_of_variants]}

    hflm_s, hflm_scores, hflm_answers = timed_engine("hflm", loaded.model, models, loaded.tokenizer, names, limit,
                                                     args.batch_size)
    ours_s, our_scores, our_answers = timed_engine("shared", loaded.model, models, loaded.tokenizer, names, limit,
                                                   args.batch_size)
    worst, greedy_same, outcomes_same, requests = 0.0, True, True, 0
    worst_relative = 0.0
    for name in models:
        for key, (lp, greedy) in hflm_answers[name].items():
            ours = our_answers[name][key]
            worst = max(worst, abs(ours[0] - lp))
            worst_relative = max(worst_relative, abs(ours[0] - lp) / max(abs(lp), 1e-9))
            greedy_same &= ours[1] == greedy
            requests += 1
        for task in names:
            outcomes_same &= our_scores[name][task].correct == hflm_scores[name][task].correct
    # for scale: lm-eval's HFLM against itself, batch 1 against batch N, on the dense model's same requests
    _, _, single = timed_engine("hflm", loaded.model, {"dense": loaded.model}, loaded.tokenizer, names, limit, 1)
    hflm_self = max(abs(single["dense"][key][0] - lp) for key, (lp, _) in hflm_answers["dense"].items())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    report = {
        "model": args.model, "dtype": args.dtype, "removed": list(pruned.plan.removed), "variants": list(models),
        "tasks": names, "limit": limit, "hflm_batch_size": args.batch_size, "threads": torch.get_num_threads(),
        "requests_per_model": requests // len(models), "hflm_seconds": hflm_s, "shared_seconds": ours_s,
        "speedup": hflm_s / ours_s, "max_abs_loglik_diff": worst, "max_rel_loglik_diff": worst_relative,
        "hflm_batch1_vs_batchN_max_abs_diff_dense": hflm_self, "greedy_identical": greedy_same,
        "outcomes_identical": outcomes_same, "peak_rss_gib": peak, "load_average": os.getloadavg(),
        "accuracy": {name: {t: our_scores[name][t].acc for t in names} for name in models},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{args.model} ({args.dtype}), dense + {len(models) - 1} variants (streamline, {depth} blocks removed), "
          f"{len(names)} tasks × {limit} seeded examples (offline data), {requests // len(models)} requests per model, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; variants: {', '.join(names_of_variants)}")
    print(f"lm-eval HFLM (batch {args.batch_size}), one model at a time: {hflm_s:8.1f} s")
    print(f"shared prefix (ours), every model at once:  {ours_s:8.1f} s   → {hflm_s / ours_s:.2f}× faster")
    print(f"largest |log-likelihood difference| over {requests} requests: {worst:.2e} (relative {worst_relative:.1e}); "
          f"greedy flags identical: "
          f"{greedy_same}; per-example outcomes identical: {outcomes_same}; peak RSS {peak:.2f} GiB")
    print(f"for scale, HFLM against itself (dense, batch 1 against batch {args.batch_size}): largest difference "
          f"{hflm_self:.2e}")
    print(f"written {out}")


if __name__ == "__main__":
    main()
