"""Distillation after the fit: what KD adds, from which start, at which rate and budget, and what it costs.

    .venv/bin/python bench/distill.py                 # every setting, budget and rate (see --help for the sizes)
    .venv/bin/python bench/distill.py --quick         # SmolLM2 n = 7, one budget and rate (a few minutes)
    .venv/bin/python bench/distill.py --speed_only    # ours against a naive KD, time and peak memory

Quality: per setting (SmolLM2 streamline n = 7 and n = 11, Gemma-3 streamline n = 6), blocks chosen
and operators fitted once per run on the `mix` calibration windows (a stand-in for C4), then every
distilled variant trained from its closed-form start in the same run, at the same budget and rate
(the teacher's top-50 cached once for all of them, validation on held-out calibration windows), and
everything evaluated together on text no fit or distillation read: ptb (exact) and wiki (a stand-in
for WikiText-2). Variants: every operator family with `operator` KD (diag, rotate, ghost,
ghost_capped, and the stock refits' own down_proj), the stock candidates with stock KD (block s−1's
MLP, norm gains on Gemma-3, low-rank changes near the cuts, from plain pruning and from the best
stock fold), at 2–3 budgets and two learning rates.

Speed: one distilled variant (ghost_capped+kd at SmolLM2 n = 7), the same steps, in fresh processes:
ours (the dense model's top-K cached once, the dense prefix kept, the LM head on the K rows only, no
copy of the model) against a naive KD (a deep copy of the pruned model as the student, the teacher
resident and run at every step and validation, full-vocabulary logits and KL). Peak memory is the
process's VmHWM above the loaded model.

Writes bench/results/distill.json (distill_quick.json with --quick); our own measurements, stand-in
corpora labelled as such.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.distill.options import DistillOptions  # noqa: E402
from ghosted_core.model.loading import load_model  # noqa: E402
from ghosted_core.run.options import RunOptions, parse_variants  # noqa: E402
from ghosted_core.run.pipeline import run  # noqa: E402

SETTINGS = {  # name: (model, criterion, blocks removed)
    "smollm2-n7": ("smollm2-135m", "streamline", 7),
    "smollm2-n11": ("smollm2-135m", "streamline", 11),
    "gemma3-n6": ("gemma3-270m", "streamline", 6),
}
OPERATOR_KD = ("diag+kd", "rotate+kd", "ghost+kd", "ghost_capped+kd")
STOCK_KD = {  # the stock candidates per family: plain pruning and the best stock fold (docs/results.md)
    "smollm2-135m": ("none+kd_mlp", "none+kd_lora", "magcomp_refit+kd", "magcomp_refit+kd_mlp", "magcomp_refit+kd_lora"),
    "gemma3-270m": ("none+kd_mlp", "none+kd_norm", "none+kd_lora", "magcomp+kd_mlp", "magcomp+kd_norm"),
}
BUDGETS = (12, 36)  # optimizer steps of 2 × 512 tokens: 12,288 and 36,864 training tokens
# at the longer budget, the variants that answer the questions (the paper's claim, and the best stock route), to keep
# each run near 45 minutes on 2 shared cores
KEY_KD = {"smollm2-135m": ("diag+kd", "rotate+kd", "ghost+kd", "ghost_capped+kd", "none+kd_mlp", "magcomp_refit+kd_mlp"),
          "gemma3-270m": ("diag+kd", "rotate+kd", "ghost+kd", "ghost_capped+kd", "none+kd_mlp", "magcomp+kd_mlp")}
RATES = (1e-4, 1e-3)
LOSS_LABELS = {"topk": "top-50 KL (LinearPatch's)", "topk_tail": "top-50 + tail KL"}
EVAL_CORPORA = ("ptb", "wiki")


def quality_run(loaded, setting: str, steps: int, lr: float, args) -> dict:
    """One run: the closed-form variants and every distilled one at `steps` and `lr`; per variant its perplexities,
    its distillation and the time it took."""
    model, criterion, n = SETTINGS[setting]
    names = args.variants.split(",") if args.variants else KEY_KD[model] if args.key_only else \
        OPERATOR_KD + STOCK_KD[model]
    options = RunOptions(model=model, criterion=criterion, num_prune=n, variants=parse_variants(",".join(names)),
                         calibration="mix", train_size=args.train_size, seqlen=args.seqlen,
                         eval_corpora=EVAL_CORPORA, eval_max_tokens=args.eval_tokens, drift_windows=0,
                         distill=DistillOptions(steps=steps, lr=lr, batch_size=2, loss=args.loss), quiet=True)
    started = time.perf_counter()
    result = run(options, loaded)
    report = result.to_json()
    out = {"setting": setting, "steps": steps, "lr": lr, "loss": args.loss,
           "seconds": round(time.perf_counter() - started, 1),
           "removed_layers": report["removed_layers"], "timings": report["timings"],
           "corpora": {c: report["corpora"][c]["label"] for c in EVAL_CORPORA},
           "calibration": report["calibration"]["label"], "variants": {}}
    for name, entry in report["variants"].items():
        row = {"ppl": entry["ppl"]}
        if "distill" in entry:
            d = entry["distill"]
            row["distill"] = {k: d[k] for k in ("base", "target", "parameters", "steps", "tokens", "start_val", "seconds",
                                                 "best_val", "best_step", "stopped", "seconds_per_step", "stock",
                                                 "val_curve")}
        out["variants"][name] = row
    return out


def print_quality(entry: dict) -> None:
    variants = entry["variants"]
    print(f"\n{entry['setting']} (removed {entry['removed_layers']}), {entry['steps']} steps at lr {entry['lr']:g}, "
          f"loss {entry.get('loss', 'topk')} "
          f"({entry['seconds']:.0f} s); perplexity on {', '.join(f'{c}: {l}' for c, l in entry['corpora'].items())}")
    print(f"  {'variant':24} {'ptb':>9} {'wiki':>9}  {'start':>8} {'val KL':>8}  {'s/step':>6}  stock")
    for name, row in variants.items():
        d = row.get("distill")
        extra = f"  {d['start_val']:8.4f} {d['best_val']:8.4f}  {d['seconds_per_step']:6.2f}  {d['stock']}" if d else ""
        print(f"  {name:24} {row['ppl']['ptb']:9.2f} {row['ppl']['wiki']:9.2f}{extra}")


def markdown(report: dict) -> str:
    """docs/results.md's tables from a report: per setting and budget, every variant's perplexities and its
    distillation, with its closed-form start beside it."""
    lines = []
    for entry in sorted(report.get("quality", []), key=lambda e: (list(SETTINGS).index(e["setting"]), e["steps"], -e["lr"],
                                                                  e.get("loss", "topk"))):
        variants = entry["variants"]
        lines += [f"**{entry['setting']}**, removed {entry['removed_layers'][0]}–{entry['removed_layers'][-1]}, "
                  f"{entry['steps']} steps × 2 × 512 tokens at lr {entry['lr']:g}, loss {LOSS_LABELS[entry.get('loss', 'topk')]} "
                  f"({entry['seconds'] / 60:.0f} min for the whole run):", "",
                  "| variant | trained (parameters) | ptb ppl (exact) | wiki ppl (stand-in) | ptb, wiki vs its start | "
                  "validation KL start → best | s / step | stock |", "|---|---|---|---|---|---|---|---|"]
        for name, row in variants.items():
            d = row.get("distill")
            ppl = row["ppl"]
            if d is None:
                lines.append(f"| {name} | - | {ppl['ptb']:.1f} | {ppl['wiki']:.1f} | | | | |")
                continue
            start = variants[d["base"]]["ppl"]
            lines.append(f"| {name} | {d['target']} ({d['parameters']:,}) | {ppl['ptb']:.1f} | {ppl['wiki']:.1f} | "
                         f"{ppl['ptb'] / start['ptb']:.2f}×, {ppl['wiki'] / start['wiki']:.2f}× | "
                         f"{d['start_val']:.3f} → {d['best_val']:.3f} (step {d['best_step']}, {d['stopped']}) | "
                         f"{d['seconds_per_step']:.1f} | {'yes' if d['stock'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- speed and memory: ours against a naive KD

SPEED_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from distill import speed_child
print(json.dumps(speed_child(json.loads(sys.argv[1]))))
"""


def _speed_options(job: dict) -> RunOptions:
    model, criterion, n = SETTINGS[job["setting"]]
    return RunOptions(model=model, criterion=criterion, num_prune=n, variants=parse_variants(job["variant"]),
                      calibration="mix", train_size=job["train_size"], seqlen=job["seqlen"], eval_corpora=(),
                      drift_windows=0, distill=DistillOptions(steps=job["steps"], lr=1e-3, eval_every=job["every"],
                                                              patience=0), quiet=True)


def speed_child(job: dict) -> dict:
    """In a fresh process: fit the start, then distill it our way or the naive way; wall time and peak memory of
    the distillation alone (teacher pass included), above what the process held before it."""
    from process_memory import reset_peak, status_bytes

    from ghosted_core.run import distilling
    from ghosted_core.run.pipeline import run_stages

    torch.set_num_threads(job["threads"])
    options = _speed_options(job)
    loaded = load_model(options.model)
    base = job["variant"].split("+kd")[0]
    fit_only = dataclasses.replace(options, variants=parse_variants(base))
    result = run(fit_only, loaded)  # the closed-form start
    dense, variant = loaded.model, result.models[base]
    before = status_bytes("VmRSS")
    reset_peak()
    started = time.perf_counter()
    if job["how"] == "ours":
        models, reports = {base: variant}, {}
        for _ in distilling.distill_stage(dense, loaded.tokenizer, result.plan, options, models, reports, "mix"):
            pass
        report = reports[job["variant"]]
        steps, val = report.steps, report.best_val
    else:
        steps, val = naive_distill(dense, variant, loaded.tokenizer, options, job)
    seconds = time.perf_counter() - started
    return {"how": job["how"], "seconds": seconds, "steps": steps, "peak_extra": status_bytes("VmHWM") - before,
            "best_val": val}


def naive_distill(dense, variant, tokenizer, options: RunOptions, job: dict) -> tuple[int, float]:
    """The straightforward KD: a deep copy of the pruned model trains its boundary operator; the teacher (the dense
    model, resident) runs on every step's batch and at every validation; full-vocabulary logits and KL."""
    from ghosted_core.distill.loss import full_vocabulary_kl
    from ghosted_core.distill.train import learning_rate
    from ghosted_core.run.distilling import validation_windows
    from ghosted_core.data import corpora

    d = options.distill
    train_ids, val_ids = corpora.distillation_windows(
        tokenizer, options.calibration, d.train_windows(options.seqlen), validation_windows(options), options.seqlen,
        options.seed, options.train_size, options.heldout)
    student = copy.deepcopy(variant)
    params = [p for name, p in student.named_parameters() if ".patch." in name]  # the boundary operator's W
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    steps = d.planned_steps(options.seqlen)

    def validate() -> float:
        total = 0.0
        for ids in val_ids.split(d.batch_size):
            with torch.no_grad():
                total += float(full_vocabulary_kl(student(ids).logits, dense(ids).logits)) * len(ids)
        return total / len(val_ids)

    best = validate()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, 1e-3, d.min_lr_factor)
        ids = train_ids[step * d.batch_size:(step + 1) * d.batch_size]
        with torch.no_grad():
            teacher = dense(ids).logits  # (B, T, V)
        loss = full_vocabulary_kl(student(ids).logits, teacher)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % job["every"] == 0:
            best = min(best, validate())
    return steps, best


def speed(args) -> dict:
    """Ours and naive, alternating in fresh processes (A B B A), the same variant, steps and validations."""
    job = {"setting": "smollm2-n7", "variant": "ghost_capped+kd", "steps": args.speed_steps, "every": 4,
           "train_size": args.train_size, "seqlen": args.seqlen, "threads": args.threads}
    runs = []
    for how in ("ours", "naive", "naive", "ours")[: 2 * args.repeats]:
        done = subprocess.run([sys.executable, "-c", SPEED_CHILD, json.dumps(job | {"how": how}), str(ROOT / "bench")],
                              cwd=ROOT, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {how}: {runs[-1]['seconds']:.1f} s, peak +{runs[-1]['peak_extra'] / 2**20:.0f} MiB", flush=True)
    summary = {}
    for how in ("ours", "naive"):
        mine = [r for r in runs if r["how"] == how]
        summary[how] = {"seconds": sorted(r["seconds"] for r in mine), "peak_extra_mib": max(r["peak_extra"] for r in mine) / 2**20,
                        "best_val": mine[0]["best_val"]}
    ours, naive = summary["ours"], summary["naive"]
    summary["time_ratio"] = min(ours["seconds"]) / min(naive["seconds"])
    summary["memory_ratio"] = ours["peak_extra_mib"] / naive["peak_extra_mib"]
    return {"job": job, "runs": runs, "summary": summary, "load_average": os.getloadavg()}


# ---------------------------------------------------------------- C = 4096: a random model of Llama-3-8B widths

SCALE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from distill import scale_child
print(json.dumps(scale_child(json.loads(sys.argv[1]))))
"""


WIDTHS = {  # a random Llama of these widths: C, I, heads, KV heads, vocabulary (tied)
    "llama-3-8b": (4096, 14336, 32, 8, 128256),
    "llama-3.2-1b": (2048, 8192, 32, 8, 128256),
}


def scale_child(job: dict) -> dict:
    """In a fresh process: a random Llama of `job["widths"]` (WIDTHS; default Llama-3-8B's), `blocks` blocks, one
    removed; ghost fitted, then distilled with `job["target"]`; peak memory of the distillation (teacher pass
    included) against the plan's distill phase, and the time per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
    from ghosted_core.distill.budget import distill_plan
    from ghosted_core.distill.targets import make_student
    from ghosted_core.distill.teacher import build_teacher
    from ghosted_core.distill.train import DistillReport, distill_student
    from ghosted_core.plan import PruningPlan
    from ghosted_core.recovery.operators import FitOptions, get_operator
    from ghosted_core.run.fitting import build_recovered
    from ghosted_core.run.options import VariantSpec
    from process_memory import reset_peak, status_bytes

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    c, inner, heads, kv_heads, vocab = WIDTHS[job.get("widths", "llama-3-8b")]
    config = LlamaConfig(hidden_size=c, intermediate_size=inner, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=job["blocks"], vocab_size=vocab,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    dense = LlamaForCausalLM(config).eval().requires_grad_(False)
    plan = PruningPlan(job["blocks"], (1,), "manual")
    generator = torch.Generator().manual_seed(1)
    tokens = lambda n: torch.randint(0, vocab, (n, job["seqlen"]), generator=generator)  # noqa: E731
    stats = collect_stats(dense, plan.boundaries, make_batches(tokens(2), None, 1), CalibrationOptions(quiet=True))
    fits = [get_operator("ghost").fit(s, FitOptions(ridge="relative")) for s in stats]
    del stats
    variant = build_recovered(dense, plan, VariantSpec("ghost", "ghost"), fits)
    del fits
    loss = job.get("loss", "topk")
    opts = DistillOptions(steps=job["steps"], batch_size=1, lr=1e-4, eval_every=job["steps"], patience=0, loss=loss)
    before = status_bytes("VmRSS")
    reset_peak()
    started = time.perf_counter()
    cache = build_teacher(dense, tokens(job["steps"]), tokens(1), 50, [1, 0], opts.prefix_budget)
    teacher_seconds = time.perf_counter() - started
    student = make_student(variant, dense, plan, job["target"], opts, {})
    planned = distill_plan(config, 4, job["seqlen"], 1, opts, [(job["target"], "matrix")], val_windows=1,
                           train_blocks=len(student.model.model.layers) - student.first_block)
    report = DistillReport("ghost+kd", "ghost", job["target"], "", False, student.count, student.paths,
                           job["steps"], 1, job["seqlen"], 1e-4, 20.0, 0, 0.0, 50, vocab, loss, "auto", "",
                           "random tokens")
    for _ in distill_student(student, dense, cache, opts, report):
        pass
    return {"target": job["target"], "loss": loss, "parameters": student.count,
            "peak_extra": status_bytes("VmHWM") - before,
            "planned": planned.device + planned.host, "planned_parts": planned.parts,
            "seconds_per_step": report.train_seconds / report.steps, "teacher_seconds": teacher_seconds,
            "steps": report.steps, "prefix": report.prefix}


def run_scale_child(job: dict) -> dict:
    """scale_child(job) in a fresh process, so that its peak is the distillation's alone."""
    done = subprocess.run([sys.executable, "-c", SCALE_CHILD, json.dumps(job), str(ROOT / "bench")], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def scale(args) -> list[dict]:
    out = []
    for widths in ("llama-3.2-1b", "llama-3-8b"):
        for target in ("operator", "mlp", "lora"):
            entry = run_scale_child({"target": target, "widths": widths, "blocks": 4, "seqlen": 512, "steps": 2,
                                     "threads": args.threads}) | {"widths": widths}
            out.append(entry)
            print(f"  {widths} (C = {WIDTHS[widths][0]}), {target}: {entry['parameters']:,} parameters, "
                  f"{entry['seconds_per_step']:.1f} s/step, peak +{entry['peak_extra'] / 2**20:.0f} MiB, planned "
                  f"{entry['planned'] / 2**20:.0f} MiB ({entry['planned'] / entry['peak_extra']:.2f}x)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="optimizer steps (2 x seqlen tokens each)")
    parser.add_argument("--rates", default=",".join(map(str, RATES)))
    parser.add_argument("--train_size", type=int, default=64, help="calibration windows (the fit, and KD's first ones)")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval_tokens", type=int, default=2048, help="perplexity tokens per corpus")
    parser.add_argument("--speed_steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="speed: ours/naive pairs (fresh processes each)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--markdown", action="store_true", help="print docs/results.md's tables from the report")
    parser.add_argument("--variants", default="", help="these distilled variants instead (a comma list)")
    parser.add_argument("--loss", default="topk", choices=("topk", "topk_tail"), help="the distillation loss's form")
    parser.add_argument("--key_only", action="store_true", help="only the key distilled variants (KEY_KD)")
    parser.add_argument("--speed_only", action="store_true")
    parser.add_argument("--scale_only", action="store_true", help="only the C = 2048 and 4096 random-model cases")
    parser.add_argument("--no_speed", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help=out_help("distill"))
    args = parser.parse_args()
    if args.quick:
        args.settings, args.budgets, args.rates = "smollm2-n7", "12", "1e-3"
    path = result_path("distill", args.quick, args.out)
    report = json.loads(path.read_text()) if path.exists() else {}
    if args.markdown:
        print(markdown(report))
        return
    report["command"] = "python bench/distill.py " + " ".join(sys.argv[1:])
    report["machine"] = {"cores": os.cpu_count(), "threads": args.threads, "device": "cpu"}
    if args.scale_only:
        print("random Llamas of 4 blocks, one removed, ghost distilled: peak memory against the plan's distill phase:")
        report["scale"] = scale(args)
        path.write_text(json.dumps(report, indent=2))
        return
    if not args.speed_only:
        report.setdefault("quality", [])
        for setting in args.settings.split(","):
            loaded = load_model(SETTINGS[setting][0])
            for steps in map(int, args.budgets.split(",")):
                for lr in map(float, args.rates.split(",")):
                    entry = quality_run(loaded, setting, steps, lr, args)
                    key = (setting, steps, lr, args.loss, tuple(sorted(entry["variants"])))
                    report["quality"] = [e for e in report["quality"] if (e["setting"], e["steps"], e["lr"],
                                                                          e.get("loss", "topk"),
                                                                          tuple(sorted(e["variants"]))) != key] + [entry]
                    path.write_text(json.dumps(report, indent=2))  # saved as each run ends
                    print_quality(entry)
            del loaded
    if not args.no_speed:
        print("\nspeed and peak memory, ours against a naive KD:")
        report["speed"] = speed(args)
        s = report["speed"]["summary"]
        print(f"  time ours / naive: {s['time_ratio']:.2f}x, peak memory: {s['memory_ratio']:.2f}x")
        path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
