"""Resident memory of recovered variants: they share the dense weights, so building them costs
little beyond their operator matrices.

    .venv/bin/python bench/variant_memory.py [--model smollm2-135m]

Prints the process RSS after loading the dense model and after building every variant, the
bytes of operator tensors (boundary matrices and ReplaceMe's folded projection), and the
growth beyond those as a share of the dense model's resident size. Also builds the naive
alternative (a deepcopy per variant, as the official code does) for the same plan, for scale.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_paths import result_path  # noqa: E402  (bench/ is the script's folder)
from process_memory import rss_bytes  # noqa: E402

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.data import corpora
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.model.loading import load_model
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.options import DEFAULT_VARIANTS, parse_variants
from ghosted_core.run.fitting import build_recovered
from ghosted_core.plan import PruningPlan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--removed", default="20,21,22,23,24,25,26", help="blocks to remove")
    parser.add_argument("--out", default=None, help="results file (default: bench/results/variant_memory.json)")
    args = parser.parse_args()
    args.out = str(result_path("variant_memory", out=args.out))

    loaded = load_model(args.model)
    dense = loaded.model
    gc.collect()
    base = rss_bytes()
    plan = PruningPlan(loaded.num_layers, tuple(int(i) for i in args.removed.split(",")), "manual")
    fit_ids, _ = corpora.calibration_windows(loaded.tokenizer, "ptb", 8, 128, 0)
    stats = collect_stats(dense, plan.boundaries, make_batches(fit_ids, None, 8), CalibrationOptions(quiet=True))
    del fit_ids
    gc.collect()
    after_stats = rss_bytes()

    variants, operator_bytes = {}, 0
    dense_ptrs = {t.data_ptr() for t in dense.state_dict().values()}
    for spec in parse_variants(DEFAULT_VARIANTS):
        fits = [get_operator(spec.operator).fit(s, FitOptions()) for s in stats]
        variants[spec.name] = build_recovered(dense, plan, spec, fits)
        new = {t.data_ptr(): t for t in variants[spec.name].state_dict().values() if t.data_ptr() not in dense_ptrs}
        operator_bytes += sum(t.numel() * t.element_size() for t in new.values())
        del fits
    gc.collect()
    after_variants = rss_bytes()
    unique = {t.data_ptr(): t for t in dense.state_dict().values()}  # tied embeddings count once
    dense_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    growth = after_variants - after_stats - operator_bytes

    copies = [copy.deepcopy(dense) for _ in range(2)]  # what a deepcopy-per-variant design costs, for two variants
    gc.collect()
    deepcopy_growth = (rss_bytes() - after_variants) / len(copies)
    del copies

    result = {
        "model": args.model,
        "removed": list(plan.removed),
        "variants": list(variants),
        "dense_weight_bytes": dense_bytes,
        "rss_after_load": base,
        "rss_growth_building_variants": after_variants - after_stats,
        "operator_bytes": operator_bytes,
        "growth_beyond_operators": growth,
        "growth_beyond_operators_percent_of_dense": 100.0 * growth / dense_bytes,
        "deepcopy_rss_per_variant": deepcopy_growth,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    mib = 2**20
    print(f"model {args.model}: dense weights {dense_bytes / mib:.1f} MiB, RSS after load {base / mib:.1f} MiB")
    print(f"building {len(variants)} variants ({', '.join(variants)}): RSS +{(after_variants - after_stats) / mib:.1f} MiB, "
          f"of which operator tensors {operator_bytes / mib:.1f} MiB")
    print(f"growth beyond the operators: {growth / mib:+.1f} MiB = {result['growth_beyond_operators_percent_of_dense']:+.2f}% "
          f"of the dense weights")
    print(f"for scale, one deepcopy of the dense model: +{deepcopy_growth / mib:.1f} MiB RSS")
    print(f"written {args.out}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
