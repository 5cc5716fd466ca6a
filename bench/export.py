"""Export at real width: a random Llama with Llama-3-8B's block shapes (C = 4096) and a few blocks, on the CPU.

    .venv/bin/python bench/export.py            # 4 blocks, 12 x 512 calibration tokens
    .venv/bin/python bench/export.py --quick    # 3 blocks, 6 x 256 tokens (rank-deficient: relative ridge)

Builds the model (fp32, vocab 32000, tied embeddings), removes block 1, calibrates that
boundary on random tokens, fits `replaceme_keepsink` (five candidate counts of sink
directions, chosen on held-out sequences) and `ghost_capped`, then measures each new path at
C = 4096: the fits, the stock export (keepsink folded into down_proj), the remote-code export
(ghost_capped), reloading both and comparing their logits with the in-memory variants, and
the orthogonal fold (Procrustes rotation folded upstream). Time and peak resident memory
above the loaded model are sampled every 20 ms per step. The numbers exercise the code paths
and their memory; the random model's perplexities mean nothing and are not reported.
Writes bench/results/export.json (export_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)
from process_memory import PeakSampler, rss_bytes  # noqa: E402

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.export.folder import export_variant, load_recovered
from ghosted_core.recovery.operators import needs_of
from ghosted_core.run.options import RunOptions, VariantSpec
from ghosted_core.run.fitting import build_recovered, fit_variant
from ghosted_core.plan import PruningPlan  # noqa: E402
from rotation_fold import fold_upstream_rotation, procrustes_map  # noqa: E402  (an experiment kept beside its bench)


@contextmanager
def measured(steps: dict, name: str):
    """Wall time and peak RSS above the RSS at entry, sampled every 20 ms."""
    memory = PeakSampler(rss_bytes, 0.02)
    clock = time.perf_counter()
    try:
        with memory:
            yield
    finally:
        steps[name] = {"seconds": round(time.perf_counter() - clock, 2),
                       "peak_extra_mib": round(memory.extra / 2**20, 1)}
        print(f"  {name}: {steps[name]['seconds']:.1f} s, peak +{steps[name]['peak_extra_mib']:.0f} MiB", flush=True)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=4096, help="C (Llama-3-8B: 4096)")
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--out", default=None, help=out_help("export"))
    args = parser.parse_args()
    out = result_path("export", args.quick, args.out)
    blocks, sequences, seqlen = (3, 6, 256) if args.quick else (4, 12, 512)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads,
                         num_hidden_layers=blocks, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=4096)
    steps: dict = {}
    with measured(steps, "build random model"):
        dense = LlamaForCausalLM(config).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in dense.parameters())
    plan = PruningPlan(blocks, (1,), "manual")
    ids = torch.randint(0, config.vocab_size, (sequences + 2, seqlen), generator=torch.Generator().manual_seed(1))
    batches = make_batches(ids[:sequences], ids[sequences:], 2)
    # position rule: the first token of every sequence counts as a sink, so keepsink has sink rows to keep
    options = RunOptions(calibrate=CalibrationOptions(sink_rule="position", sink_positions=1, quiet=True), quiet=True)
    operators = ("replaceme_keepsink", "ghost_capped")
    with measured(steps, "calibrate (branch + residual statistics)"):
        stats = collect_stats(dense, plan.boundaries, batches, options.calibrate, needs_of(operators))
    variants, notes = {}, {}
    for name in operators:
        spec = VariantSpec(name, name)
        with measured(steps, f"fit {name}"):
            fits, reports = fit_variant(dense, plan, spec, stats, batches, options)
        variants[name] = build_recovered(dense, plan, spec, fits)
        notes[name] = list(reports[0].notes)
    sample = ids[:1, :32]
    checks = {}
    folder = Path(tempfile.mkdtemp(prefix="ghosted-export-bench-"))
    try:
        for name, mode in (("replaceme_keepsink", "stock"), ("ghost_capped", "remote_code")):
            with measured(steps, f"export {name} ({mode})"):
                result = export_variant(variants[name], None, folder / name, mode=mode)
            with measured(steps, f"reload {name} ({mode})"):
                reloaded = AutoModelForCausalLM.from_pretrained(result.folder) if mode == "stock" else \
                    load_recovered(result.folder)[0]
            checks[name] = {"mode": result.mode, "files": list(result.files), "weight_bytes": result.weight_bytes,
                            "logits_relative_gap": relative_gap(reloaded(sample).logits, variants[name](sample).logits)}
            del reloaded
            shutil.rmtree(result.folder)
        with measured(steps, "orthogonal fold (Procrustes + upstream rotation)"):
            rotated = fold_upstream_rotation(build_recovered(dense, plan, VariantSpec("none", "none"), []), 1,
                                             procrustes_map(stats[0]))
        del rotated
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"model": {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "blocks": blocks,
                        "vocab_size": 32000,
                        "dtype": "float32", "weight_bytes": weight_bytes, "removed": list(plan.removed)},
              "calibration": {"sequences": sequences, "heldout_sequences": 2, "seqlen": seqlen,
                              "tokens": sequences * seqlen},
              "steps": steps, "exports": checks, "fit_notes": notes, "load_average": os.getloadavg(),
              "threads": torch.get_num_threads()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for name, check in checks.items():
        print(f"  {name}: {check['mode']}, {check['weight_bytes'] / 2**30:.2f} GiB, "
              f"logits relative gap {check['logits_relative_gap']:.2e}")
    print(f"written {out}")


if __name__ == "__main__":
    main()
