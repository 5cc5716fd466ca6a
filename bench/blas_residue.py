"""What the host BLAS keeps through a run's stages, against the memory plan's allocator residue.

    .venv/bin/python bench/blas_residue.py                 # C = 1024 (I = 2816), then C = 4096 (I = 14336): ~15 min
    .venv/bin/python bench/blas_residue.py --quick         # C = 1024 only (~1 min)

A random Llama (3 blocks, tied head, fp32, `--vocab` entries; C = 1024 with 8,192, C = 4096 with
128,256), in a fresh process per case, runs the stages a run runs at boundary (1, 2): the calibration
pass (2,048 fit tokens in batches of 2 × 512, the held-out rows kept), the fits with their candidates
chosen on the held-out rows, the held-out pass, one perplexity batch (4 × 256 tokens, the logits and
their loss) and a 64-token prompt's generation of 8 tokens. After each stage it reads what Intel MKL's
allocator keeps (`mkl_serv_mem_stat`: the packing buffers it keeps per thread), from none at the start
(no warm-up), and compares the largest with `memory_parts.allocator_residue_bytes` for the same shape
and threads. Cases: ghost_capped, replaceme_keepsink and rotate together, and magcomp_refit (whose
float64 products also run over I; with sink tokens at C = 1024, so that it makes all its candidates).
Writes bench/results/blas_residue.json (--quick: blas_residue_quick.json), or --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

MIB = 2**20
SHAPES = {1024: (2816, 8192), 4096: (14336, 128256)}  # C → (I, vocabulary)
CASES = {"ghost_capped,replaceme_keepsink,rotate": False, "magcomp_refit": True}  # operators → sink tokens
TOKENS, BATCH, SEQLEN = 2048, 2, 512


def worker(width: int, operators: str, sinks: bool) -> None:
    """One case in this (fresh) process; prints one JSON line."""
    import ghosted_core  # noqa: F401  first: sets the thread and allocator settings before torch loads
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ghosted_core.calibration.collect import CalibrationOptions, HeldoutRows, collect_stats, make_batches
    from ghosted_core.memory_parts import allocator_residue_bytes, inner_width
    from ghosted_core.plan import Boundary
    from ghosted_core.recovery.heldout import measure_errors
    from ghosted_core.recovery.operators import get_operator, needs_of
    from ghosted_core.run.fitting import VariantBuild, choose_fit
    from ghosted_core.run.options import RunOptions, parse_variants
    from process_memory import blas_kept_bytes

    inner, vocab = SHAPES[width]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=width, intermediate_size=inner, vocab_size=vocab, num_hidden_layers=3,
                         num_attention_heads=width // 128, num_key_value_heads=max(1, width // 512), head_dim=128,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    fit_ids = torch.randint(8, vocab, (TOKENS // SEQLEN, SEQLEN), generator=generator)
    held_ids = torch.randint(8, vocab, (1, SEQLEN), generator=generator)
    if sinks:  # tokens 0…7 massive and opening every window: sink rows in 8 directions, every candidate made
        with torch.no_grad():
            model.model.embed_tokens.weight[:8].mul_(1e4)
        for ids in (fit_ids, held_ids):
            ids[:, 0] = torch.arange(len(ids)) % 8
    if blas_kept_bytes() is None:
        print(json.dumps({"width": width, "operators": operators, "error": "torch's CPU BLAS is not MKL here"}))
        return
    kept = {"start": blas_kept_bytes()}
    batches = make_batches(fit_ids, held_ids, BATCH)
    options = CalibrationOptions(quiet=True, batch_size=BATCH, pipeline="full")
    needs = needs_of(tuple(operators.split(",")))
    rows = HeldoutRows()
    stats = collect_stats(model, [Boundary(1, 2)], batches, options, needs, heldout=rows)
    kept["calibrate"] = blas_kept_bytes()
    run_options = RunOptions(calibrate=options, quiet=True)
    builds = [VariantBuild(spec) for spec in parse_variants(operators)]
    for build in builds:  # as `run.fitting.fit_variants`: each fit, its candidates chosen on the held-out rows
        fit = choose_fit(model, get_operator(build.spec.operator).fit(stats[0], run_options.fit), batches,
                         run_options, kept=rows)
        build.add(model, fit, stats[0], run_options.diagnostics)
        del fit
    del stats
    gc.collect()
    kept["fit"] = blas_kept_bytes()
    measure_errors(model, [m for build in builds for m in build.maps], batches, options, kept=rows)
    kept["held-out"] = blas_kept_bytes()
    with torch.no_grad():
        ids = torch.randint(8, vocab, (4, 256), generator=generator)
        logits = model(ids).logits.float()
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        del logits
        kept["evaluate"] = blas_kept_bytes()
        model.generate(ids[:1, :64], max_new_tokens=8, do_sample=False, pad_token_id=0)
        kept["size and speed"] = blas_kept_bytes()
    threads = torch.get_num_threads()
    planned = allocator_residue_bytes(config, threads, inner_width(config, needs))
    print(json.dumps({"width": width, "inner": inner, "vocab": vocab, "operators": operators, "sinks": sinks,
                      "threads": threads, "kept": kept, "largest": max(kept.values()), "planned": planned}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="C = 1024 only")
    parser.add_argument("--out", default=None, help=out_help("blas_residue"))
    parser.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        width, operators, sinks = args.worker
        worker(int(width), operators, sinks == "sinks")
        return
    rows = []
    for width in (1024,) if args.quick else (1024, 4096):
        for operators, sinks in CASES.items():
            sinks = sinks and width == 1024  # at C = 4096 ten I×I solves take most of an hour: two candidates
            done = subprocess.run([sys.executable, __file__, "--worker", str(width), operators,
                                   "sinks" if sinks else "none"], capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}"})
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            if "error" in r:
                print(r["error"])
                return
            print(f"C = {width}, {operators}: MKL keeps {r['largest'] / MIB:.1f} MiB at most "
                  f"({', '.join(f'{k} {v / MIB:.1f}' for k, v in r['kept'].items())}), planned "
                  f"{r['planned'] / MIB:.1f} MiB on {r['threads']} threads", flush=True)
    out = result_path("blas_residue", args.quick, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/blas_residue.py " + " ".join(sys.argv[1:]), "rows": rows,
                               "load_average": os.getloadavg(),
                               "all_within": all(r["largest"] <= r["planned"] for r in rows)}, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
