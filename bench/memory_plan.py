"""The memory plan against the measured peak of whole runs on a random C = 2048 model.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/memory_plan.py          # bench/results/memory_plan.json
    .venv/bin/python bench/memory_plan.py --quick                                # ghost_capped only (memory_plan_quick.json)
    .venv/bin/python bench/memory_plan.py --table                                # plans of Llama-3-8B/70B on GPUs (no run)
    .venv/bin/python bench/memory_plan.py --criteria                             # every criterion's 8B/70B plan (no run)

A random Llama with C = 2048 (8 blocks, intermediate 5632, 16 heads of 128, 4 KV heads, the
SmolLM2 tokenizer's 49,152-token vocabulary, tied head; blocks 1, 3 and 5 scaled down to near
identity, so that ShortGPT removes them), fp32 on the CPU. Each case is one run
through `run.pipeline.run` (or `run.sweep.run_sweep`) with the model already loaded, in a fresh
process: 16 × 256 `wiki` calibration tokens (stand-in corpus) in batches of 4, 2 held-out
sequences, perplexity on 1024 `wiki` tokens in 256-token windows, drift on 2 windows. Cases:
ghost_capped, replaceme_keepsink, rotate and magcomp_refit at a streamline boundary (n = 2), ShortGPT with
three boundaries (ghost_capped, replaceme), and a streamline sweep over n = 1, 2, 3 (ghost_capped). magcomp_refit
runs at the worst case its plan reserves: every window's first token is a sink row (`sink_rule="position"`), so
the refit makes all ten (λ, sink count) candidates (this random model has no massive activation of its own).

Measured extra: the peak resident size (VmHWM, reset once the model is built, the corpora
tokenized and glibc's free heap trimmed) minus the resident size then. Planned extra: the
plan's host peak minus the weights (`host_bytes − weights_bytes` of the plan results.json
records). A case passes when measured ≤ planned ≤ 1.5 × measured. Each row also records what MKL's allocator
keeps at the run's end (`blas_kept`), against the plan's allocator residue (`planned_residue`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)
from process_memory import blas_kept_bytes, reset_peak, status_bytes  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, tie_word_embeddings=True, max_position_embeddings=2048)
CASES = {  # name → (criterion, depth or depths, operators)
    "ghost_capped": ("streamline", 2, "ghost_capped"),
    "replaceme_keepsink": ("streamline", 2, "replaceme_keepsink"),
    "rotate": ("streamline", 2, "rotate"),
    "magcomp_refit": ("streamline", 2, "magcomp_refit"),  # the down_proj refit's I×I statistics and candidates
    "shortgpt, 3 boundaries": ("shortgpt", 3, "ghost_capped,replaceme"),
    "sweep n = 1, 2, 3": ("streamline", (1, 2, 3), "ghost_capped"),
}
# cases measured at the worst case their plan reserves: every window opens with a sink row (`--sink_rule position`),
# so the refit makes all ten (λ, sink count) candidates (this random model has no massive activation of its own)
SINK_CASES = {"magcomp_refit"}
QUICK = ("ghost_capped",)
QUIET_BLOCKS = (1, 3, 5)
GIB, MIB = 2**30, 2**20


def loaded_model():
    """The random C = 2048 Llama (seeded) with the SmolLM2 tokenizer, as a LoadedModel."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ghosted_core.model.embedded import convert_embedded
    from ghosted_core.model.loading import LoadedModel

    tokenizer = AutoTokenizer.from_pretrained(convert_embedded("smollm2-135m"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=len(tokenizer))).eval()
    model.requires_grad_(False)
    with torch.no_grad():  # blocks 1, 3 and 5 barely change the residual: ShortGPT removes them, three boundaries
        for j in QUIET_BLOCKS:
            model.model.layers[j].self_attn.o_proj.weight.mul_(0.05)
            model.model.layers[j].mlp.down_proj.weight.mul_(0.05)
    return LoadedModel("random-c2048", "local", "random Llama, C = 2048, 8 blocks (fp32)", model, tokenizer)


def options_for(case: str):
    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.run.options import RunOptions, parse_variants

    criterion, depth, operators = CASES[case]
    return RunOptions(model="random-c2048", criterion=criterion, num_prune=depth if isinstance(depth, int) else depth[0],
                      variants=parse_variants(operators), calibration="wiki", train_size=16, seqlen=256,
                      heldout_size=2, eval_corpora=("wiki",), eval_max_tokens=1024, quiet=True,
                      calibrate=CalibrationOptions(batch_size=4, quiet=True,
                                                   sink_rule="position" if case in SINK_CASES else "norm"))


def worker(case: str) -> None:
    """One case in this (fresh) process; prints one JSON line."""
    import ghosted_core  # noqa: F401  first: sets OMP_WAIT_POLICY before torch loads

    from ghosted_core.data import corpora
    from ghosted_core.run.pipeline import run
    from ghosted_core.run.sweep import run_sweep

    loaded = loaded_model()
    options = options_for(case)
    corpora.calibration_windows(loaded.tokenizer, "wiki", 16, 256, 0, 2)  # the text read and tokenized before the peak
    corpora.evaluation_windows(loaded.tokenizer, "wiki", 256, 1024)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status_bytes("VmRSS")
    reset_peak()
    clock = time.perf_counter()
    depth = CASES[case][1]
    result = run(options, loaded) if isinstance(depth, int) else run_sweep(options, depth, loaded)
    wall = time.perf_counter() - clock
    peak = status_bytes("VmHWM")
    blas = blas_kept_bytes()  # the BLAS's kept buffers at the run's end (the plan's `residue_bytes` declares them)
    plan = result.memory_plan
    report = result.to_json()
    boundaries = report["boundaries"] if isinstance(depth, int) else report["sweep"]["statistics"]["boundaries"]
    print(json.dumps({"case": case, "measured_extra": peak - base, "planned_extra": plan.host_bytes - plan.weights_bytes,
                      "plan_peak_phase": plan.peak_phase, "phases": plan.phases, "weights": plan.weights_bytes,
                      "blas_kept": blas, "planned_residue": plan.residue_bytes,
                      "model_rss": base, "boundaries": boundaries, "wall_s": wall}))


def run_case(case: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker", case], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["ratio"] = row["planned_extra"] / row["measured_extra"]
    row["passes"] = row["measured_extra"] <= row["planned_extra"] <= 1.5 * row["measured_extra"]
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | boundaries | measured extra (MiB) | planned extra (MiB) | plan / measured | plan's peak phase | "
             "measured ≤ plan ≤ 1.5× |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {len(r['boundaries'])} | {r['measured_extra'] / MIB:.0f} | "
                     f"{r['planned_extra'] / MIB:.0f} | {r['ratio']:.2f} | {r['plan_peak_phase']} | "
                     f"{'yes' if r['passes'] else '**no**'} |")
    return lines


PUBLISHED = {  # Llama-3-8B and Llama-3-70B's published shapes
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
PLANS = [("Llama-3-8B", 24, 1, None), ("Llama-3-8B", 24, 4, None), ("Llama-3-8B", 24, 4, "none,diag,rotate,ghost,ghost_capped"),
         ("Llama-3-70B", 80, 1, None), ("Llama-3-70B", 80, 4, None)]


def plan_table() -> list[str]:
    """The plans of published shapes on GPUs: bf16, 64 × 512 calibration tokens (128 × 512 for 70B), batches of 8,
    the default operators unless named, the CLI's perplexity defaults, 512 GiB of host memory."""
    import torch
    from transformers import LlamaConfig

    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.run.options import RunOptions, memory_plan, parse_variants

    lines = ["| model | GPU | boundaries | weights | statistics | variants | pipeline | on the GPU (peak phase) | on the host |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, gpu, boundaries, operators in PLANS:
        options = RunOptions(model=name, train_size=128 if "70B" in name else 64, seqlen=512,
                             calibrate=CalibrationOptions(batch_size=8))
        if operators:
            options = RunOptions(**{**options.__dict__, "variants": parse_variants(operators)})
        plan = memory_plan(options, LlamaConfig(**PUBLISHED[name]), "cuda", torch.bfloat16, boundaries=boundaries,
                           device_available=gpu * GIB, host_available=512 * GIB)
        host = f"{plan.host_bytes / GIB:.1f} GiB" if plan.host_bytes else "—"
        lines.append(f"| {name}{', ' + operators if operators else ''} | {gpu} GiB | {boundaries} | "
                     f"{plan.weights_bytes / GIB:.1f} GiB | {plan.stats_bytes / GIB:.2f} GiB ({plan.stats_device}) | "
                     f"{plan.variant_bytes / GIB:.2f} GiB | {plan.pipeline} | {plan.device_bytes / GIB:.1f} GiB "
                     f"({plan.peak_phase}) | {host} |")
    return lines


def criteria_table(gpu: int = 80) -> list[str]:
    """Per criterion, Llama-3-8B and 70B on one `gpu` GiB GPU at the default calibration size (bf16, 64 × 512
    tokens for 8B, 128 × 512 for 70B, batches of 8, the default operators, one boundary): the scoring phase
    its declaration gives, the run's peak, and whether it fits."""
    import torch
    from transformers import LlamaConfig

    import ghosted_core.selection  # noqa: F401  registers every criterion
    from ghosted_core.calibration.collect import CalibrationOptions
    from ghosted_core.run.options import RunOptions, memory_plan
    from ghosted_core.selection.criteria import CRITERIA

    lines = [f"| model | criterion | score blocks on the GPU | peak on the GPU (phase) | fits one {gpu} GB GPU | "
             "what the budgets recompute |", "|---|---|---|---|---|---|"]
    for name in ("Llama-3-8B", "Llama-3-70B"):
        for criterion in CRITERIA:
            options = RunOptions(model=name, criterion=criterion, train_size=128 if "70B" in name else 64, seqlen=512,
                                 layers=(1, 2) if criterion == "manual" else (),
                                 calibrate=CalibrationOptions(batch_size=8))
            plan = memory_plan(options, LlamaConfig(**PUBLISHED[name]), "cuda", torch.bfloat16, boundaries=1,
                               device_available=gpu * GIB, host_available=512 * GIB)
            score = plan.phases["score blocks"]["device"]
            lines.append(f"| {name} | {criterion} | {score / GIB:.1f} GiB | {plan.device_bytes / GIB:.1f} GiB "
                         f"({plan.peak_phase}) | {'yes' if plan.fits else '**no**'} | {plan.score_note or '—'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ghost_capped only")
    parser.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    parser.add_argument("--out", default=None, help=out_help("memory_plan"))
    parser.add_argument("--table", action="store_true", help="only print the plans of Llama-3-8B and 70B on GPUs")
    parser.add_argument("--criteria", action="store_true",
                        help="only print every criterion's plan for Llama-3-8B and 70B on one 80 GB GPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.table:
        print("\n".join(plan_table()))
        return
    if args.criteria:
        print("\n".join(criteria_table()))
        return
    rows = []
    chosen = QUICK if args.quick else tuple(c.strip() for c in args.cases.split(",")) if args.cases else CASES
    for case in chosen:
        rows.append(run_case(case))
        r = rows[-1]
        kept = "" if r["blas_kept"] is None else \
            f"; MKL keeps {r['blas_kept'] / MIB:.1f} MiB, allocator residue planned {r['planned_residue'] / MIB:.1f} MiB"
        print(f"{case}: measured {r['measured_extra'] / MIB:.0f} MiB, planned {r['planned_extra'] / MIB:.0f} MiB "
              f"({r['ratio']:.2f}x), {r['wall_s']:.0f} s{kept}", flush=True)
    out = result_path("memory_plan", args.quick, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/memory_plan.py " + " ".join(sys.argv[1:]), "shape": SHAPE, "rows": rows,
              "load_average": os.getloadavg(), "all_pass": all(r["passes"] for r in rows)}
    out.write_text(json.dumps(report, indent=2))
    print("\n".join(table(rows)))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
