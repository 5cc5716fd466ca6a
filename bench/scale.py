"""Calibration at real widths: peak extra memory, statistics bytes against the memory plan, and time.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/scale.py     # C = 2048 (1/2/4 boundaries), 4096 (1/4)
    .venv/bin/python bench/scale.py --quick                           # C = 2048, 1 and 4 boundaries (scale_quick.json)
    python bench/scale.py --device cuda                               # a GPU machine: the full 32-block 8B shape, bf16
    .venv/bin/python bench/scale.py --smollm2_products                # fp32 vs float64 products on SmolLM2
    .venv/bin/python bench/scale.py --sleb_only --tokens 1024         # sleb at C = 4096 against its declaration

CPU mode builds random Llama models from configs, fp32, with 4 blocks: C = 2048 with
Llama-3.2-1B's shapes and C = 4096 with Llama-3-8B's (intermediate 14336, 32 heads, 8 KV
heads, vocabulary 128256; the LM head is tied to the embeddings, which calibration never runs,
to spare 2 GB of a shared machine's memory). Boundaries (0,1), (1,2), (2,3), (3,4): the first
1, 2 or 4 of them, each fitted on its own, as a depth sweep asks (the forward stops after the
last one). 8192 fit tokens (2·C at C = 4096; the CLI default would give 4·C: the statistics'
memory does not depend on it, only time does) in batches of 2 × 512 (the forward's own
activations grow with the batch: the memory plan counts them, and names a smaller batch as the
way out when they do not fit). For each configuration, in a
fresh subprocess so peaks do not mask each other:
- ours: `collect_stats` with the statistics that none, diag, rotate, ghost and ghost_capped
  need (the held-out sequences join that pass, their rows kept as a run keeps them), then every
  fit per boundary with the fit report a run computes by default (realized as its module and
  compacted; statistics freed boundary by boundary, as the pipeline does), then the held-out
  errors from the kept rows;
- store-all (the official code's way): keep every x_pre and x_post in fp32, concatenate, float64
  normal equations, ghost only, at the same tokens; the held-out sequences' activations are kept
  too and give ghost's held-out error (ours computes it, so the baseline does as well).
Peak extra memory is the peak resident size (VmHWM, reset after the model is built) minus the
resident size before calibration. "stats" is what the accumulators allocated; "plan" is
`memory.plan_memory`'s count from the config. A float32-products line gives ghost's relative
difference in M against pure float64 sums. Last, the like-for-like comparison (ghost alone, ours
against store-all, one boundary at the largest width) runs `--repeats` times per side,
alternated A B B A, each in a fresh process, and compares the mean wall times. Writes bench/results/scale.json (--quick:
scale_quick.json; --device cuda: scale_cuda.json), or --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import rerun_stamp  # noqa: E402  (bench/ is the script's folder)
from process_memory import reset_peak, status_bytes  # noqa: E402

SHAPES = {  # published configs (Llama-3.2-1B, Llama-3-8B); num_hidden_layers set per mode
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, rope_theta=500000.0),
}
OPERATORS = ("none", "diag", "rotate", "ghost", "ghost_capped")
# "ours-ghost" is the like-for-like row against store-all: ghost alone as a run computes it by default (its
# fit report as the CLI summary shows it, and its held-out error, which store-all computes as well)
METHOD_OPERATORS = {"ours": OPERATORS, "ours-ghost": ("ghost",), "ours-refit": ("magcomp_refit",)}
# the down_proj refit folds into the block before the cut: its boundaries start at block 1, not 0
FIRST_BLOCK = {"ours-refit": 1}
SINK_METHODS = {"ours-refit"}  # measured at their worst case: attention sinks in 8 directions, every candidate made
SEQLEN = 512
GIB = 2**30


SINK_TOKENS = 8  # with `sinks`: tokens 0…7 get massive embeddings (10,000x) and open the windows (attention sinks, 8 directions)


def build_model(shape: str, layers: int, device: str = "cpu", dtype: str = "float32", sinks: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, tie_word_embeddings=device == "cpu",
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in the target dtype: no fp32 staging copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    if sinks:
        with torch.no_grad():
            model.model.embed_tokens.weight[:SINK_TOKENS].mul_(1e4)  # over 50x the median stream at the cut
    return model


def batches_for(tokens: int, batch_size: int, vocab: int, seed: int = 0, sinks: bool = False):
    """Random windows; with `sinks` each opens with one of the sink tokens (as real text with BOS), so that the
    sink-aware fits make every candidate they can (the worst case the memory plan counts)."""
    import torch

    from ghosted_core.calibration.collect import make_batches

    generator = torch.Generator().manual_seed(seed)
    fit = torch.randint(0, vocab, (tokens // SEQLEN, SEQLEN), generator=generator)
    held = torch.randint(0, vocab, (max(1, tokens // SEQLEN // 8), SEQLEN), generator=generator)
    if sinks:
        for ids in (fit, held):
            ids.clamp_(min=SINK_TOKENS)
            ids[:, 0] = torch.arange(len(ids)) % SINK_TOKENS
    return make_batches(fit, held, batch_size)


def fit_ours(model, boundaries, batches, options, quiet: bool = True, operators: tuple[str, ...] = OPERATORS) -> dict:
    """The pipeline's calibration stage for `operators` at independent boundaries: stats, fits, held-out pass.

    `peaks`: each stage's peak resident size (VmHWM, reset as the stage starts), under the plan's phase names."""
    from ghosted_core.calibration.collect import HeldoutRows, collect_stats
    from ghosted_core.recovery.heldout import measure_errors
    from ghosted_core.recovery.operators import get_operator, needs_of
    from ghosted_core.run.options import RunOptions, parse_variants
    from ghosted_core.run.fitting import VariantBuild, choose_fit

    needs = needs_of(operators)
    live: list = []
    kept = HeldoutRows()  # as a run keeps them: the held-out rows come from the calibration pass
    clock = time.perf_counter()
    peaks = {}
    stats = collect_stats(model, boundaries, batches, options, needs, live, heldout=kept)
    peaks["calibrate"] = status_bytes("VmHWM")
    reset_peak()
    stats_bytes = [acc.nbytes() for acc in live]
    del live
    calibrate = time.perf_counter() - clock
    run_options = RunOptions(calibrate=options, quiet=quiet)
    builds = [VariantBuild(spec) for spec in parse_variants(operators)]
    for k in range(len(stats)):
        for build in builds:  # as `run.fitting.fit_variants`: each fit, its candidates chosen on held-out rows
            fit = choose_fit(model, get_operator(build.spec.operator).fit(stats[k], run_options.fit), batches,
                             run_options, kept=kept)
            build.add(model, fit, stats[k], run_options.diagnostics)
            del fit
        stats[k] = None  # freed as soon as its fits exist
    fit = time.perf_counter() - clock - calibrate
    peaks["fit"] = status_bytes("VmHWM")
    reset_peak()
    maps = [m for build in builds for m in build.maps]
    errors = measure_errors(model, maps, batches, options, kept=kept)
    heldout = time.perf_counter() - clock - calibrate - fit
    peaks["held-out"] = status_bytes("VmHWM")
    ghost = next((b for b in builds if b.spec.name == "ghost"), None)
    return {"stats_bytes": stats_bytes, "phase_peaks": peaks, "seconds": {"calibrate": calibrate, "fit": fit, "heldout": heldout},
            "heldout_error": {b.spec.name: [e.relative for e in errors[i * len(boundaries):(i + 1) * len(boundaries)]]
                              for i, b in enumerate(builds)},
            "ghost_update_norm": [float(m.update.norm()) for m in ghost.maps] if ghost else None}


def fit_store_all(model, boundaries, batches) -> dict:
    """Keep every activation (fp32, CPU), concatenate, float64 normal equations: ghost per boundary, and its
    held-out error from the kept held-out activations (the same outputs as ours, the straightforward way)."""
    import torch

    from ghosted_core.calibration.capture import capture, run_forward

    kept = {(b, held): ([], []) for b in boundaries for held in (False, True)}
    clock = time.perf_counter()
    residuals = {j for b in boundaries for j in (b.start, b.end)}
    for batch in batches:  # the held-out sequences too: their activations give the held-out errors
        with capture(model, residuals) as seen:
            run_forward(model, batch.input_ids)
        for b in boundaries:
            for site, rows in zip((b.start, b.end), kept[b, batch.heldout]):
                rows.append(seen[("residual", site)].float().cpu().reshape(-1, seen[("residual", site)].shape[-1]))
    calibrate = time.perf_counter() - clock
    updates = []
    for b in boundaries:
        x_pre = torch.cat(kept[b, False][0]).double()  # (T, C)
        x_post = torch.cat(kept[b, False][1]).double()  # (T, C)
        delta = x_post - x_pre
        eye = torch.eye(x_pre.shape[1], dtype=torch.float64)
        updates.append(torch.linalg.solve(x_pre.T @ x_pre + 1e-6 * eye, x_pre.T @ delta))
        del x_pre, x_post, delta
    fit = time.perf_counter() - clock - calibrate
    errors = []
    for b, update in zip(boundaries, updates):
        x_pre, x_post = (torch.cat(rows).double() for rows in kept[b, True])  # (T_held, C)
        errors.append(float((x_pre + x_pre @ update - x_post).norm() / (x_post - x_pre).norm()))
    heldout = time.perf_counter() - clock - calibrate - fit
    return {"seconds": {"calibrate": calibrate, "fit": fit, "heldout": heldout}, "heldout_error": {"ghost": errors}}


def products_difference(model, boundaries, batches, options) -> dict:
    """ghost and ghost_capped M from fp32 per-batch products summed in float64, against pure float64."""
    import dataclasses

    from ghosted_core.calibration.collect import collect_stats
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of

    needs = needs_of(["ghost"])
    exact = collect_stats(model, boundaries, batches, options, needs)
    fast = collect_stats(model, boundaries, batches, dataclasses.replace(options, products="float32"), needs)
    out = {}
    for name in ("ghost", "ghost_capped"):
        diffs = []
        for a, b in zip(exact, fast):
            ma, mb = get_operator(name).fit(a, FitOptions()).update, get_operator(name).fit(b, FitOptions()).update
            diffs.append(float((ma - mb).norm() / ma.norm()))
        out[name] = diffs
    return out


def smollm2_products(args) -> None:
    """fp32 products vs float64 on the real SmolLM2 (streamline n = 7 boundary, mix calibration)."""
    import ghosted_core  # noqa: F401

    from ghosted_core.data import corpora
    from ghosted_core.calibration.collect import CalibrationOptions, make_batches
    from ghosted_core.model.loading import load_model
    from ghosted_core.plan import Boundary

    loaded = load_model("smollm2-135m")
    fit_ids, _ = corpora.calibration_windows(loaded.tokenizer, "mix", 32, SEQLEN, 0)
    boundaries = [Boundary(20, 27)]
    options = CalibrationOptions(quiet=True, batch_size=8, pipeline="full")
    result = products_difference(loaded.model, boundaries, make_batches(fit_ids, None, 8), options)
    report = {"mode": "products", "model": "smollm2-135m", "boundary": "20-26", "calibration": "mix (stand-in mix), 32 x 512",
              "relative_difference": result}
    write(args, report, [f"SmolLM2 boundary 20-26, fp32 products vs float64, relative difference in M: {result}"])


def worker(args) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import ghosted_core  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads
    import torch

    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.memory import PlanRequest, plan_memory
    from ghosted_core.memory_parts import inner_width
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
    from ghosted_core.plan import Boundary

    sinks = args.method in SINK_METHODS
    model = build_model(args.shape, 4, sinks=sinks)
    first = FIRST_BLOCK.get(args.method, 0)
    boundaries = [Boundary(first + j, first + j + 1) for j in range(args.boundaries)]
    batches = batches_for(args.tokens, args.batch_size, model.config.vocab_size, sinks=sinks)
    options = CalibrationOptions(quiet=True, batch_size=args.batch_size, pipeline="full")
    warm_up(model, batches[0].input_ids)
    gc.collect()
    base = status_bytes("VmRSS")
    reset_peak()
    clock = time.perf_counter()
    operators = METHOD_OPERATORS.get(args.method, OPERATORS)
    if args.method in METHOD_OPERATORS:
        result = fit_ours(model, boundaries, batches, options, operators=operators)
    elif args.method == "store-all":
        result = fit_store_all(model, boundaries, batches)
    else:
        result = {"relative_difference": products_difference(model, boundaries, batches, options)}
    wall = time.perf_counter() - clock
    peak = max(status_bytes("VmHWM"), *result.get("phase_peaks", {}).values())  # the stages reset the peak
    sequences = sum(len(b.input_ids) for b in batches if not b.heldout)
    heldout = sum(len(b.input_ids) for b in batches if b.heldout)
    plan = plan_memory(model.config, args.shape, "cpu", torch.float32,
                       PlanRequest(needs_of(operators), len(boundaries), sequences, SEQLEN, args.batch_size,
                                   options.capacity(sequences), inner=inner_width(model.config, needs_of(operators)),
                                   refit_candidates=FitOptions().refit_candidates, heldout=heldout,
                                   operators=tuple(get_operator(o).cost for o in operators), keep_heldout=True))
    measured = {phase: peak_at - base for phase, peak_at in result.pop("phase_peaks", {}).items()}
    planned = {phase: plan.phases[phase]["host"] - plan.weights_bytes for phase in measured}
    print(json.dumps({"shape": args.shape, "width": model.config.hidden_size, "boundaries": args.boundaries,
                      "method": args.method, "tokens": sequences * SEQLEN, "batch_size": args.batch_size,
                      "model_rss_gib": base / GIB, "peak_extra_gib": (peak - base) / GIB, "wall_s": wall,
                      "plan_stats_bytes_per_boundary": plan.stats_bytes_per_boundary,
                      "plan_activation_gib": plan.activation_bytes / GIB, "measured_phases": measured,
                      "planned_phases": planned, **result}))


def warm_up(model, input_ids) -> None:
    """What any process sets up once, before the base the stages are measured from (as `tests/memory_peaks.py`
    does): thread pools, kernels and per-thread heaps of a first forward, the BLAS/LAPACK buffers of a first
    float64 product, Cholesky factorization and triangular solve (about 35 MiB on the C = 2048 shape)."""
    import torch

    from ghosted_core.calibration.capture import run_forward

    with torch.no_grad():
        run_forward(model, input_ids[:1])
        gram = torch.randn(1024, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        gram = gram @ gram.T + 1024 * torch.eye(1024, dtype=torch.float64)
        torch.linalg.solve_triangular(torch.linalg.cholesky(gram), gram, upper=False)


def run_one(shape: str, boundaries: int, method: str, tokens: int, batch_size: int) -> dict:
    command = [sys.executable, __file__, "--worker", "--shape", shape, "--boundaries", str(boundaries),
               "--method", method, "--tokens", str(tokens), "--batch_size", str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> list[str]:
    lines = ["| C | boundaries | method | tokens | peak extra (GiB) | stats / boundary (MiB) | plan (MiB) | time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "fp32-products":
            continue
        stats = r.get("stats_bytes")
        shown = f"{stats[0] / 2**20:.1f}" if stats else "-"
        plan = f"{r['plan_stats_bytes_per_boundary'] / 2**20:.1f}" if stats else "-"
        lines.append(f"| {r['width']} | {r['boundaries']} | {r['method']} | {r['tokens']} | {r['peak_extra_gib']:.2f} | "
                     f"{shown} | {plan} | {r['wall_s']:.0f} |")
    return lines


def cpu_main(args) -> None:
    # the 8B shape at 1 and 4 boundaries only: each of its configurations takes 5-20 min on 2 shared cores
    plan = {"llama-3.2-1b": [1, 4]} if args.quick else {"llama-3-8b": [1, 4], "llama-3.2-1b": [1, 2, 4]}
    rows: list[dict] = []
    jobs = [(shape, count, method) for shape, counts in plan.items() for count in counts
            for method in ("ours", "ours-ghost", "store-all")] + [("llama-3.2-1b", 1, "fp32-products")]
    for shape, count, method in jobs:
        row = run_one(shape, count, method, args.tokens, args.batch_size)
        if method in METHOD_OPERATORS:
            row["stats_equal_plan"] = all(b == row["plan_stats_bytes_per_boundary"] for b in row["stats_bytes"])
        rows.append(row)
        print(f"{shape} {count} boundaries {method}: peak extra {row['peak_extra_gib']:.2f} GiB, {row['wall_s']:.0f} s"
              + (f", M difference {row['relative_difference']}" if "relative_difference" in row else ""), flush=True)
        report = {"mode": "cpu", "seqlen": SEQLEN, "operators": list(OPERATORS), "rows": rows,
                  "complete": len(rows) == len(jobs)}
        write(args, report, table(rows), quiet=True)  # partial results survive an interruption
    report["like_for_like"] = like_for_like(args, "llama-3.2-1b" if args.quick else "llama-3-8b")
    write(args, report, table(rows) + like_for_like_lines(report["like_for_like"]))


def like_for_like(args, shape: str) -> dict:
    """ghost alone, ours against store-all at one boundary, alternated A B B A (`--repeats` runs of each, each
    in a fresh process) so that a drift in the machine's load weighs on both sides alike; mean wall times."""
    runs: dict[str, list[dict]] = {"ours-ghost": [], "store-all": []}
    order = [m for i in range(args.repeats) for m in (("ours-ghost", "store-all") if i % 2 == 0 else
                                                      ("store-all", "ours-ghost"))]
    for method in order:
        row = run_one(shape, 1, method, args.tokens, args.batch_size)
        runs[method].append({"wall_s": row["wall_s"], "peak_extra_gib": row["peak_extra_gib"], "seconds": row["seconds"],
                             "heldout_error": row["heldout_error"]["ghost"][0]})
        print(f"like-for-like {shape} {method}: {row['wall_s']:.1f} s, peak extra {row['peak_extra_gib']:.2f} GiB",
              flush=True)
    mean = {m: sum(r["wall_s"] for r in rs) / len(rs) for m, rs in runs.items()}
    stages = {m: {k: sum(r["seconds"][k] for r in rs) / len(rs) for k in rs[0]["seconds"]} for m, rs in runs.items()}
    errors = [r["heldout_error"] for rs in runs.values() for r in rs]
    return {"shape": shape, "order": order, "runs": runs, "mean_wall_s": mean, "mean_stage_s": stages,
            "heldout_error_spread": (max(errors) - min(errors)) / max(errors),  # the two sides fit the same M
            "ratio": mean["ours-ghost"] / mean["store-all"],
            "peak_extra_gib": {m: max(r["peak_extra_gib"] for r in rs) for m, rs in runs.items()}}


def write_entry(args, key: str, entry: dict) -> None:
    """`entry` (stamped with its own command, commit and load average) under `key` of the existing report, whose
    table keeps the command and the commit it was measured with."""
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "scale.json"
    report = json.loads(out.read_text()) if out.exists() else {"mode": "cpu", "rows": []}
    report[key] = entry | rerun_stamp("scale.py")
    out.write_text(json.dumps(report, indent=2))
    print(f"written: {out}")


def like_for_like_only(args) -> None:
    """The like-for-like comparison alone, written into the existing report."""
    result = like_for_like(args, "llama-3-8b")
    print("\n".join(like_for_like_lines(result)))
    write_entry(args, "like_for_like", result)


def refit_only(args) -> None:
    """magcomp_refit alone at one C = 4096 boundary: the I×I statistics allocated against the plan, peak, time."""
    row = run_one("llama-3-8b", 1, "ours-refit", args.tokens, args.batch_size)
    row["stats_equal_plan"] = all(b == row["plan_stats_bytes_per_boundary"] for b in row["stats_bytes"])
    print(f"magcomp_refit at C = 4096 (I = 14336), one boundary: peak extra {row['peak_extra_gib']:.2f} GiB, statistics "
          f"{row['stats_bytes'][0] / 2**20:.0f} MiB (plan {row['plan_stats_bytes_per_boundary'] / 2**20:.0f} MiB), "
          f"{row['wall_s']:.0f} s {row['seconds']}")
    for phase, measured in row["measured_phases"].items():
        planned = row["planned_phases"][phase]
        print(f"  {phase}: measured {measured / GIB:.2f} GiB, planned {planned / GIB:.2f} GiB ({planned / measured:.2f}×)")
    write_entry(args, "refit", row)


def sleb_only(args) -> None:
    """sleb's scoring at C = 4096 (Llama-3-8B's shapes, 4 blocks, fp32) against its declaration, with its default
    kept-state budget and with none (`memo_budget = 0`: every state but the embeddings recomputed), measured by
    the registry test's worker (`tests/memory_peaks.py`) in a process of its own."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="sleb_c4096_"))
    try:
        model = build_model("llama-3-8b", 4)
        model.save_pretrained(folder)
        del model
        gc.collect()
        text = f"sequences={args.tokens // SEQLEN}:seqlen={SEQLEN}"
        cases = [f"criterion:sleb:{text}", f"criterion:sleb:memo_budget=0:{text}"]
        clock = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_peaks.py"), str(folder), *cases],
                              capture_output=True, text=True, check=True)
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for row in rows:
        measured, planned = row["measured"], row["planned"]
        budget = row["options"].get("memo_budget", "default")
        print(f"sleb at C = 4096 (4 blocks, {args.tokens} tokens, memo budget {budget}), score blocks: measured "
              f"{measured / GIB:.2f} GiB, planned {planned / GIB:.2f} GiB ({planned / measured:.2f}×)"
              + (f"; {row['note']}" if row.get("note") else ""))
    write_entry(args, "sleb", {"rows": rows, "wall_s": time.perf_counter() - clock})


def like_for_like_lines(result: dict) -> list[str]:
    mean, peak = result["mean_wall_s"], result["peak_extra_gib"]

    def stages(method: str) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in result.get("mean_stage_s", {}).get(method, {}).items())
    return ["", f"like-for-like ({result['shape']}, one boundary, ghost alone and its held-out error, order "
            f"{' '.join(result['order'])}): ours {mean['ours-ghost']:.1f} s ({stages('ours-ghost')}), store-all "
            f"{mean['store-all']:.1f} s ({stages('store-all')}), ratio {result['ratio']:.2f}; peak extra "
            f"{peak['ours-ghost']:.2f} GiB against {peak['store-all']:.2f} GiB; held-out errors agree to "
            f"{result.get('heldout_error_spread', float('nan')):.1e} (relative spread)"]


def cuda_main(args) -> None:
    """The full 32-block Llama-3-8B shape in bf16 on the GPU: the pipeline's stages and the GPU peak.

    `--dry_run` runs the same steps on the CPU with the 1B shape and 6 blocks (checks the script).
    """
    import ghosted_core  # noqa: F401
    import torch

    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.plan import Boundary, boundaries_of

    dry = args.dry_run
    device, shape, layers = ("cpu", "llama-3.2-1b", 6) if dry else ("cuda", "llama-3-8b", 32)
    gpu = device == "cuda"

    def allocated() -> int:
        return torch.cuda.memory_allocated() if gpu else 0

    def peak() -> int:
        if gpu:
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() if gpu else 0

    def reset() -> None:
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    report: dict = {"mode": "cuda", "device": torch.cuda.get_device_name(0) if gpu else "cpu (dry run)",
                    "shape": shape, "layers": layers, "dtype": "bfloat16", "seqlen": SEQLEN, "tokens": args.tokens,
                    "batch_size": args.batch_size, "runs": []}
    clock = time.perf_counter()
    model = build_model(shape, layers, device, "bfloat16")
    report["build_s"] = time.perf_counter() - clock
    report["weights_gib"] = allocated() / GIB
    batches = batches_for(args.tokens, args.batch_size, model.config.vocab_size)
    one = [Boundary(layers - 10, layers - 3)] if not dry else [Boundary(2, 4)]
    plans = {"one boundary (n = 7)": one,
             "four boundaries": list(boundaries_of([5, 11, 12, 19, 24, 25, 26] if not dry else [0, 2, 4, 5]))}
    for label, boundaries in plans.items():
        for products in ("float64", "float32"):
            options = CalibrationOptions(quiet=True, batch_size=args.batch_size, pipeline="full", stats_device=device,
                                         products=products)
            reset()
            before = allocated()
            result = fit_ours(model, boundaries, batches, options)
            result.update(label=label, products=products, boundaries=[str(b) for b in boundaries],
                          peak_extra_gib=(peak() - before) / GIB, max_memory_allocated_gib=peak() / GIB)
            report["runs"].append(result)
            print(json.dumps(result), flush=True)
    report["products_difference"] = products_difference(
        model, one, batches, CalibrationOptions(quiet=True, batch_size=args.batch_size, pipeline="full",
                                                stats_device=device))
    print("fp32 products vs float64, relative difference in M:", report["products_difference"], flush=True)
    del model
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    clock = time.perf_counter()
    cpu_model = build_model(shape, layers, "cpu", "bfloat16")  # weights on the CPU, one block at a time on the GPU
    report["cpu_build_s"] = time.perf_counter() - clock
    options = CalibrationOptions(quiet=True, batch_size=args.batch_size, pipeline="blocks", stats_device=device,
                                 compute_device=device)
    reset()
    result = fit_ours(cpu_model, one, batches, options)
    result.update(label="blocks pipeline, weights on the CPU", products="float64", max_memory_allocated_gib=peak() / GIB)
    report["runs"].append(result)
    print(json.dumps(result), flush=True)
    lines = ["| run | products | calibrate (s) | fit (s) | held-out (s) | GPU max allocated (GiB) |",
             "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        t = r["seconds"]
        lines.append(f"| {r['label']} | {r['products']} | {t['calibrate']:.1f} | {t['fit']:.1f} | "
                     f"{t['heldout']:.1f} | {r['max_memory_allocated_gib']:.1f} |")
    write(args, report, lines)


def write(args, report: dict, lines: list[str], quiet: bool = False) -> None:
    name = {"cpu": "scale_quick.json" if args.quick else "scale.json", "cuda": "scale_cuda.json",
            "products": "scale_products.json"}[report["mode"]]
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    report["command"] = "python bench/scale.py " + " ".join(sys.argv[1:])
    report["load_average"] = os.getloadavg()
    out.write_text(json.dumps(report, indent=2))
    if not quiet:
        print("\n".join(lines))
        print(f"written: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="C = 2048 only, 1 and 4 boundaries")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=None,
                        help="fit tokens per configuration, plus 1/8 held out (default: 8192 on the CPU, 16384 = 4·C on cuda)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences of 512 tokens per forward (default: 2 on the CPU, 8 on cuda)")
    parser.add_argument("--repeats", type=int, default=4,
                        help="runs of each side of the like-for-like comparison, alternated (default 4: A B B A A B B A)")
    parser.add_argument("--dry_run", action="store_true", help="--device cuda's steps on the CPU with a small shape")
    parser.add_argument("--smollm2_products", action="store_true",
                        help="only: fp32 vs float64 products on the real SmolLM2 (scale_products.json)")
    parser.add_argument("--refit_only", action="store_true",
                        help="only: magcomp_refit at one C = 4096 boundary (I = 14336) into the existing scale.json")
    parser.add_argument("--sleb_only", action="store_true",
                        help="only: sleb's scoring at C = 4096 (4 blocks) against its declaration, default and zero "
                             "kept-state budget, into the existing scale.json (use --tokens 1024: 128k-entry heads)")
    parser.add_argument("--like_for_like_only", action="store_true",
                        help="rerun only the like-for-like comparison (C = 4096) into the existing scale.json")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="llama-3.2-1b", help=argparse.SUPPRESS)
    parser.add_argument("--boundaries", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ours", help=argparse.SUPPRESS)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.tokens = args.tokens or (16384 if gpu and not args.dry_run else 8192 if not gpu else 1024)
    args.batch_size = args.batch_size or (8 if gpu else 2)
    if args.worker:
        worker(args)
    elif args.smollm2_products:
        smollm2_products(args)
    elif args.like_for_like_only:
        like_for_like_only(args)
    elif args.refit_only:
        refit_only(args)
    elif args.sleb_only:
        sleb_only(args)
    elif args.device == "cuda":
        cuda_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
