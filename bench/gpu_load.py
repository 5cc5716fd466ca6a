"""Loading straight onto the GPU: host memory and time against a CPU load plus a copy (needs a CUDA GPU).

    python bench/gpu_load.py                     # Llama-3.2-1B shapes (1.24B parameters, 2.5 GB in bf16)
    python bench/gpu_load.py --out results.json

Builds a random Llama of the given shape on the GPU and saves it (fp32 by default). Then, each
in a fresh subprocess (so the numbers are its own), it loads that folder:
- `direct`: `load_model(folder, LoadOptions(device="cuda"))`, i.e. `from_pretrained(device_map="cuda")`
  in bf16, what `ghosted_core.model.loading` does;
- `staged`: `from_pretrained` on the CPU, then `.to("cuda")`, what it did before.
Per method: load seconds, peak anonymous host memory above the process's level after CUDA
start-up (RssAnon sampled every 2 ms; file-backed pages of the memory-mapped checkpoint are not
copies and are not counted) and the GPU memory allocated.
The `direct` worker then runs calibration, every operator's fit and prefix-shared perplexity in
bf16 on the GPU (random tokens: this checks devices, dtypes and finiteness, not quality), and
the same on the model loaded with `--device map` under a GPU cap that leaves part of the blocks
on the CPU, and reports how far the two disagree.
Writes bench/results/gpu_load.json (or --out) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import result_path  # noqa: E402  (bench/ is the script's folder)
from process_memory import PeakSampler, status_bytes  # noqa: E402

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

VARIANTS = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme")


def rss_anon() -> int:
    return status_bytes("RssAnon")


def build(folder: Path, args) -> int:
    """A random Llama of the requested shape, saved as safetensors in --checkpoint_dtype; returns its bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(getattr(torch, args.checkpoint_dtype))
    model.save_pretrained(folder)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))  # load_model reads a tokenizer too
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(folder)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return nbytes


def pipeline_on(model, removed: tuple[int, ...], seed: int = 0) -> dict:
    """Calibrate, fit every operator and evaluate perplexity on random tokens; what came out, and where."""
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
    from ghosted_core.evaluation.perplexity import perplexity
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
    from ghosted_core.run.options import VariantSpec
    from ghosted_core.run.fitting import build_recovered
    from ghosted_core.plan import PruningPlan

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    fit_ids = torch.randint(0, vocab, (8, 256), generator=generator)
    held_ids = torch.randint(0, vocab, (2, 256), generator=generator)
    windows = torch.randint(0, vocab, (4, 256), generator=generator)
    plan = PruningPlan(model.config.num_hidden_layers, removed, "manual")
    clock = time.perf_counter()
    stats = collect_stats(model, plan.boundaries, make_batches(fit_ids, held_ids, 4), CalibrationOptions(quiet=True),
                          needs=needs_of(VARIANTS))
    torch.cuda.synchronize()
    calibrate = time.perf_counter() - clock
    fits = {name: [get_operator(name).fit(s, FitOptions()) for s in stats] for name in VARIANTS}
    models = {"dense": model, **{name: build_recovered(model, plan, VariantSpec(name, name), fits[name])
                                 for name in VARIANTS}}
    clock = time.perf_counter()
    ppl = perplexity(model, models, windows, batch_size=2, quiet=True)
    torch.cuda.synchronize()
    return {"removed": list(removed), "stats_device": str(stats[0].ordinary.xtx.device),
            "stats_dtype": str(stats[0].ordinary.xtx.dtype), "calibrate_s": calibrate,
            "perplexity_s": time.perf_counter() - clock, "perplexity": ppl,
            "updates": {name: [None if u is None else u.cpu() for u in map(update_of, fits[name])] for name in VARIANTS},
            "operator_weight_dtype": str(next(m for n, m in models["ghost"].named_parameters() if ".patch." in n).dtype),
            "variant_logits_dtype": str(models["ghost"](windows[:1, :8].to(input_device(model))).logits.dtype)}


def update_of(fit) -> torch.Tensor | None:
    """M = W − I of a fit; for a scale in an orthonormal basis, its diagonal r − 1 (same Frobenius norms)."""
    return fit.update if fit.update is not None else None if fit.scale is None else fit.scale - 1


def input_device(model) -> torch.device:
    """Where input ids go: the embeddings' device, or the CPU when accelerate offloaded them (it moves them)."""
    device = model.model.embed_tokens.weight.device
    return device if device.type != "meta" else torch.device("cpu")


def worker(method: str, folder: str, out: str, removed: tuple[int, ...], gpu_cap: str) -> None:
    from ghosted_core.model.loading import LoadOptions, load_model

    torch.zeros(1, device="cuda")  # CUDA start-up is not part of loading
    torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter()
    with PeakSampler(rss_anon, 0.002) as host:
        if method == "direct":
            model = load_model(folder, LoadOptions(device="cuda")).model
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
        torch.cuda.synchronize()
    report = {"method": method, "load_s": time.perf_counter() - clock, "host_peak_extra_bytes": host.extra,
              "host_anon_after_bytes": rss_anon() - host.base, "host_peak_resident_bytes": status_bytes("VmHWM"),
              "gpu_allocated_bytes": torch.cuda.memory_allocated(),
              "param_devices": sorted({str(p.device) for p in model.parameters()}),
              "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    if method == "direct":
        report["gpu"] = on_gpu = pipeline_on(model, removed)
        del model
        torch.cuda.empty_cache()
        mapped = load_model(folder, LoadOptions(device="map", max_memory={0: gpu_cap, "cpu": "200GiB"})).model
        placed = mapped.hf_device_map
        report["map"] = on_map = pipeline_on(mapped, removed)
        report["map"]["placement"] = {str(device): sum(1 for v in placed.values() if v == device)
                                      for device in set(placed.values())}
        report["map_vs_gpu"] = {
            "perplexity_relative": {n: abs(on_map["perplexity"][n] / p - 1) for n, p in on_gpu["perplexity"].items()},
            "update_relative": {n: max((float((a - b).norm() / b.norm()) for a, b in zip(on_map["updates"][n], ups)
                                        if b is not None), default=0.0) for n, ups in on_gpu["updates"].items()}}
        for run in (on_gpu, on_map):
            run.pop("updates")
    torch.save(report, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--checkpoint_dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype the checkpoint is saved in (loaded in bf16 either way); float32 is what "
                             "the embedded models' cache and many checkpoints hold, and what a CPU staging copy costs")
    parser.add_argument("--removed", default="4,5,6,10,11", help="blocks removed in the pipeline check")
    parser.add_argument("--gpu_cap", default="1.5GiB", help="GPU cap of the --device map run (the rest on the CPU)")
    parser.add_argument("--out", default=None, help="results file (default: bench/results/gpu_load.json)")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    removed = tuple(int(i) for i in args.removed.split(","))
    if args.worker:
        worker(*args.worker, removed, args.gpu_cap)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_load.py needs a CUDA GPU")
    out = result_path("gpu_load", out=args.out)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        clock = time.perf_counter()
        nbytes = build(folder, args)
        print(f"random Llama {args.hidden}x{args.layers} saved in {args.checkpoint_dtype}: {nbytes / 2**30:.2f} GiB "
              f"({time.perf_counter() - clock:.0f} s)", flush=True)
        runs = {}
        for method in ("direct", "staged"):
            report = Path(tmp) / f"{method}.pt"
            subprocess.run([sys.executable, __file__, "--worker", method, str(folder), str(report),
                            "--removed", args.removed, "--gpu_cap", args.gpu_cap], check=True)
            runs[method] = torch.load(report)
    report = {"shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")},
              "checkpoint_dtype": args.checkpoint_dtype,
              "parameter_bytes": nbytes, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    for method, run in runs.items():
        print(f"{method:>7}: load {run['load_s']:.1f} s, host peak extra {run['host_peak_extra_bytes'] / 2**30:.2f} GiB "
              f"(checkpoint {nbytes / 2**30:.2f} GiB), GPU allocated {run['gpu_allocated_bytes'] / 2**30:.2f} GiB, "
              f"params on {run['param_devices']} as {run['param_dtypes']}")
    direct = runs["direct"]
    print(f"pipeline in bf16 on the GPU: statistics {direct['gpu']['stats_dtype']} on {direct['gpu']['stats_device']}, "
          f"calibrate {direct['gpu']['calibrate_s']:.2f} s, perplexity {direct['gpu']['perplexity_s']:.2f} s")
    print(f"--device map with a {args.gpu_cap} GPU cap: placement {direct['map']['placement']}; "
          f"largest relative difference to the all-GPU run: perplexity "
          f"{max(direct['map_vs_gpu']['perplexity_relative'].values()):.2e}, operator "
          f"{max(direct['map_vs_gpu']['update_relative'].values()):.2e}")
    print(f"written {out}")


if __name__ == "__main__":
    main()
