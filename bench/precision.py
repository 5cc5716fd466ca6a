"""bf16 against fp32, end to end on the embedded SmolLM2: block choice, operators and perplexity.

    .venv/bin/python bench/precision.py            # 32 x 256 calibration tokens, 4096 evaluation tokens per corpus
    .venv/bin/python bench/precision.py --quick    # 16 x 256 and 2048

The same model is loaded twice on the CPU, in fp32 and in bf16 (`LoadOptions(dtype=...)`), and
each goes through the pipeline's stages: streamline scores the blocks (n = 7), one streamed
calibration pass (float64 statistics whatever the model dtype) feeds every operator, variants
are built (operators keep fp32 weights and are applied in the model's dtype) and perplexity is
evaluated with the LM head's logits cast to fp32. Both runs use the blocks fp32 chose. Reported:
the blocks each dtype would choose, per operator the relative difference of M (‖M_bf16 − M_fp32‖
/ ‖M_fp32‖, per boundary) and of the held-out boundary error, and per variant and corpus the
perplexity in each dtype and their relative difference. `mix` is a stand-in for C4 and `wiki`
for WikiText-2 (see the README's corpus table).
Writes bench/results/precision.json (precision_quick.json with --quick, or --out).
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

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.data import corpora
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.evaluation.perplexity import perplexity
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.recovery.operators import Fit, needs_of
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.fitting import build_recovered, fit_variant
from ghosted_core.selection.choose import select_blocks
from ghosted_core.selection.criteria import SelectionRequest

OPERATORS = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme")
CORPORA = ("ptb", "wiki")
DTYPES = ("float32", "bfloat16")


def run_dtype(dtype: str, plan, args) -> dict:
    """One dtype through select → calibrate → fit → build → perplexity; fits kept for the comparison."""
    loaded = load_model("smollm2-135m", LoadOptions(device="cpu", dtype=dtype))
    dense, tokenizer = loaded.model, loaded.tokenizer
    fit_ids, held_ids = corpora.calibration_windows(tokenizer, "mix", args.train_size, args.seqlen, args.seed,
                                                 heldout=max(1, args.train_size // 8))
    batches = make_batches(fit_ids, held_ids, 8)
    clock = time.perf_counter()
    chosen, _ = select_blocks(dense, "streamline", SelectionRequest(loaded.num_layers, args.n), batches, quiet=True)
    plan = plan or chosen
    timings = {"score blocks": time.perf_counter() - clock}
    clock = time.perf_counter()
    options = RunOptions(calibrate=CalibrationOptions(quiet=True), quiet=True)
    stats = collect_stats(dense, plan.boundaries, batches, options.calibrate, needs=needs_of(OPERATORS))
    timings["calibrate"] = time.perf_counter() - clock
    fits, reports, models = {}, {}, {"dense": dense}
    for spec in parse_variants(OPERATORS):
        fits[spec.name], reports[spec.name] = fit_variant(dense, plan, spec, stats, batches, options)
        models[spec.name] = build_recovered(dense, plan, spec, fits[spec.name])
    clock = time.perf_counter()
    ppl = {corpus: perplexity(dense, models, corpora.evaluation_windows(tokenizer, corpus, args.seqlen, args.eval_tokens),
                              quiet=True) for corpus in CORPORA}
    timings["perplexity"] = time.perf_counter() - clock
    return {"plan": plan, "chosen": list(chosen.removed), "fits": fits, "reports": reports, "perplexity": ppl,
            "timings": timings, "stats_dtype": str(stats[0].ordinary.xtx.dtype),
            "variant_logits_dtype": str(models["ghost"](fit_ids[:1, :8]).logits.dtype)}


def update_of(fit: Fit) -> torch.Tensor | None:
    """M = W − I of a fit; for a scale in an orthonormal basis, its diagonal r − 1 (same Frobenius norms)."""
    return fit.update if fit.update is not None else None if fit.scale is None else fit.scale - 1


def relative(a: Fit, b: Fit) -> float | None:
    """‖M_a − M_b‖ / ‖M_b‖ (None for plain pruning)."""
    ma, mb = update_of(a), update_of(b)
    return None if ma is None or mb is None else float((ma - mb).norm() / mb.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=7, help="blocks streamline removes")
    parser.add_argument("--train_size", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval_tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=out_help("precision"))
    args = parser.parse_args()
    if args.quick:
        args.train_size, args.eval_tokens = 16, 2048
    out = result_path("precision", args.quick, args.out)
    torch.set_grad_enabled(False)

    clock = time.perf_counter()
    runs: dict[str, dict] = {}
    plan = None
    for dtype in DTYPES:
        runs[dtype] = run_dtype(dtype, plan, args)
        plan = runs[dtype]["plan"]
    ref, low = runs["float32"], runs["bfloat16"]
    operators = {name: {
        "update_relative_difference": [relative(b, a) for a, b in zip(ref["fits"][name], low["fits"][name])],
        "heldout_error": {dtype: [r.heldout_error for r in runs[dtype]["reports"][name]] for dtype in DTYPES},
        "heldout_error_ordinary": {dtype: [r.heldout_error_ordinary for r in runs[dtype]["reports"][name]]
                                   for dtype in DTYPES}} for name in OPERATORS}
    ppl = {corpus: {name: {"float32": value, "bfloat16": low["perplexity"][corpus][name],
                           "relative_difference": low["perplexity"][corpus][name] / value - 1}
                    for name, value in ref["perplexity"][corpus].items()} for corpus in CORPORA}
    report = {"model": "smollm2-135m", "criterion": "streamline", "n": args.n, "removed": list(plan.removed),
              "chosen": {dtype: runs[dtype]["chosen"] for dtype in DTYPES},
              "calibration": {"corpus": "mix (stand-in for C4)", "sequences": args.train_size, "seqlen": args.seqlen,
                              "seed": args.seed},
              "evaluation": {"tokens_per_corpus": args.eval_tokens, "corpora": corpora.describe(CORPORA)},
              "stats_dtype": {dtype: runs[dtype]["stats_dtype"] for dtype in DTYPES},
              "variant_logits_dtype": {dtype: runs[dtype]["variant_logits_dtype"] for dtype in DTYPES},
              "timings": {dtype: runs[dtype]["timings"] for dtype in DTYPES}, "operators": operators,
              "perplexity": ppl, "seconds": time.perf_counter() - clock, "load_average": os.getloadavg()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    print(f"SmolLM2-135M, streamline n = {args.n}: fp32 chose {report['chosen']['float32']}, bf16 chose "
          f"{report['chosen']['bfloat16']}; both use {report['removed']}. Statistics: "
          f"{report['stats_dtype']['bfloat16']} in the bf16 run. Calibration {args.train_size} x {args.seqlen} mix "
          f"(stand-in for C4); perplexity on the first {args.eval_tokens} tokens of each corpus.")
    print(f"{'operator':<14}{'M rel. diff':>12}{'held-out err fp32':>19}{'bf16':>8}")
    for name, entry in operators.items():
        diff = max((d for d in entry["update_relative_difference"] if d is not None), default=None)
        errs = entry["heldout_error"]
        print(f"{name:<14}{'-' if diff is None else f'{diff:.2e}':>12}{errs['float32'][0]:>19.4f}{errs['bfloat16'][0]:>8.4f}")
    print(f"{'variant':<14}" + "".join(f"{c + ' fp32':>12}{c + ' bf16':>12}{'rel.':>9}" for c in CORPORA))
    for name in ref["perplexity"][CORPORA[0]]:
        print(f"{name:<14}" + "".join(f"{ppl[c][name]['float32']:>12.2f}{ppl[c][name]['bfloat16']:>12.2f}"
                                      f"{100 * ppl[c][name]['relative_difference']:>+8.2f}%" for c in CORPORA))
    print(f"timings (s): " + "; ".join(f"{d}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[d]["timings"].items())
                                      for d in DTYPES))
    print(f"written {out} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
