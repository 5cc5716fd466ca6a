"""Every offered GGUF type of one SmolLM2 variant: size, time to write, llama-perplexity, decode speed.

    .venv/bin/python bench/gguf_types.py            # SmolLM2-135M without blocks 12-15, magcomp_refit
    .venv/bin/python bench/gguf_types.py --quick    # 4 perplexity windows, 8 importance-matrix windows

Fits magcomp_refit on 16 x 128 tokens of mix, exports it with `export_gguf` twice from one variant: every type
without an importance matrix, then the k-quants with one (llama-imatrix on the run's calibration text, mix).
Each file is scored by llama-perplexity on PTB (valid, exact), beside transformers' fp32 on the same windows,
and timed by llama-bench (1 thread; the machine is shared, so speeds are indicative). Writes
bench/results/gguf_types.json (gguf_types_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches  # noqa: E402
from ghosted_core.data.corpora import calibration_windows, load_corpus  # noqa: E402
from ghosted_core.export.gguf import GGUF_OUTTYPES, GGUFOptions, export_gguf  # noqa: E402
from ghosted_core.export.llamacpp import LLAMACPP_COMMIT, llamacpp_bench  # noqa: E402
from ghosted_core.model.loading import load_model  # noqa: E402
from ghosted_core.plan import PruningPlan  # noqa: E402
from ghosted_core.recovery.operators import FitOptions, get_operator  # noqa: E402
from ghosted_core.run.fitting import build_recovered  # noqa: E402
from ghosted_core.run.options import VariantSpec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help=out_help("gguf_types"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m")
    fit_ids, _ = calibration_windows(loaded.tokenizer, "mix", 16, 128, 0, 0)
    plan = PruningPlan(30, (12, 13, 14, 15), "manual")
    operator = get_operator("magcomp_refit")
    stats = collect_stats(loaded.model, plan.boundaries, make_batches(fit_ids, None, 4), CalibrationOptions(quiet=True),
                          operator.needs)
    variant = build_recovered(loaded.model, plan, VariantSpec("magcomp_refit", "magcomp_refit"),
                              [operator.fit(s, FitOptions()) for s in stats])
    ptb, mix = load_corpus("ptb"), load_corpus("mix", "calibration")
    base = GGUFOptions(eval_text=ptb.text, eval_label=ptb.label, context=512, ppl_chunks=4 if args.quick else 16,
                       imatrix_chunks=8 if args.quick else 32)
    report = {"model": "smollm2-135m without blocks 12-15, magcomp_refit (16 x 128 mix)", "llama.cpp": LLAMACPP_COMMIT,
              "context": base.context, "ppl_chunks": base.ppl_chunks, "imatrix_chunks": base.imatrix_chunks,
              "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, types, options in (("plain", GGUF_OUTTYPES, base),
                                      ("imatrix", ("q6_k", "q5_k_m", "q4_k_m"),
                                       GGUFOptions(**{**vars(base), "imatrix_text": mix.text,
                                                      "imatrix_label": mix.label}))):
            result = export_gguf(variant, loaded.tokenizer, Path(tmp) / label, types, options)
            files = []
            for g in result.ggufs:
                speed = llamacpp_bench(g.path, threads=1, n_prompt=128, n_gen=32, repetitions=3)
                files.append(g.to_json() | {"path": None, "bench": speed.to_json()})
                print(f"{label:8s} {g.outtype:7s} {g.bytes / 1e6:7.1f} MB  written {g.seconds:5.1f} s  ppl "
                      f"{g.perplexity.value:8.3f} ± {g.perplexity.error:.3f}  pp {speed.prefill.mean:7.1f} t/s  "
                      f"tg {speed.decode.mean:6.1f} t/s", flush=True)
            report["runs"][label] = {"transformers_fp32_ppl": result.reference_ppl, "imatrix": result.imatrix,
                                     "files": files}
            print(f"{label}: transformers fp32 {result.reference_ppl:.3f}", flush=True)
    path = result_path("gguf_types", args.quick, args.out)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
