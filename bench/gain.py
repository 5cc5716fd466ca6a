"""What pruning buys in llama.cpp: size, prefill and decode speed of every stock variant and GGUF type, and its
perplexity against its own f16, beside the ideal speed-up and what keeps it out of reach.

    flock /tmp/ghosted-heavy.lock .venv/bin/python bench/gain.py                 # SmolLM2 and Gemma-3, several depths
    .venv/bin/python bench/gain.py --settings smollm2-n7 --types f16,q4_k_m --quick
    .venv/bin/python bench/gain.py --rescore_references gemma3-n6                # one setting's fp32 references again

For each setting (a model, streamline's blocks at one depth, the stock operators): one run fits the operators
(the app's calibration: mix, 256-token windows); dense and every variant are exported stock, converted to f16 by
llama.cpp's converter, and quantized by llama-quantize to each type, the k-quants with an importance matrix that
llama-imatrix computes on the run's own calibration text (as gguf-my-repo offers). Each file gets:
- its size on disk;
- llama-bench prefill (pp) and decode (tg) tokens/s (f16, q8_0 and q4_k_m by default), with 1 thread and with
  every core: the files of one type are timed in rounds, each round visiting dense and every variant once, and
  each figure is the median over every round's repetitions, so a variant's ratio is to the dense file of the
  same type under the same load;
- llama-perplexity on the first windows of ptb (exact), beside transformers' fp32 perplexity of the same variant
  on the same windows (`evaluation.perplexity.llamacpp_windowed_perplexity`).

The ideal decode speed-up is L / kept blocks. Per token, llama.cpp also multiplies by the LM head (V × C, tied to
the embeddings here) and looks up one embedding row (no multiply); a stock variant has no boundary operator
(it is folded into down_proj or the writers' scales), so the predicted speed-up from the weights that run per
token is (L · block + head) / (kept · block + head). The table puts measured, ideal and predicted side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import out_help, result_path  # noqa: E402  (bench/ is the script's folder)

import ghosted_core  # noqa: E402,F401  first: sets OMP_WAIT_POLICY before torch loads
import torch  # noqa: E402

from ghosted_core.data import corpora  # noqa: E402
from ghosted_core.evaluation.perplexity import llamacpp_windowed_perplexity  # noqa: E402
from ghosted_core.errors import GhostedError  # noqa: E402
from ghosted_core.export.folder import export_variant  # noqa: E402
from ghosted_core.export.gain import SpeedOptions, cpu_name  # noqa: E402
from ghosted_core.export.gguf import convert_to_gguf  # noqa: E402
from ghosted_core.export.llamacpp import LLAMACPP_COMMIT, compute_imatrix, llamacpp_bench, llamacpp_perplexity, \
    quantize_gguf  # noqa: E402
from ghosted_core.model.embedded import convert_embedded  # noqa: E402
from ghosted_core.model.loading import load_model  # noqa: E402
from ghosted_core.run.options import RunOptions, parse_variants  # noqa: E402
from ghosted_core.run.pipeline import run  # noqa: E402

SETTINGS = {  # name: (model, blocks removed by streamline, stock operators)
    "smollm2-n4": ("smollm2-135m", 4, "none,magcomp_refit"),
    "smollm2-n7": ("smollm2-135m", 7, "none,magcomp,magcomp_refit,replaceme,refit"),
    "smollm2-n11": ("smollm2-135m", 11, "none,magcomp_refit"),
    "gemma3-n6": ("gemma3-270m", 6, "none,magcomp"),  # replaceme's map sits before Gemma-3's post-norm: not stock
}
TYPES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
SPEED_TYPES = ("f16", "q8_0", "q4_k_m")  # timed (every type is sized and scored)
CONTEXT = 256  # llama-perplexity's and llama-imatrix's windows
CHUNKS = 8  # perplexity windows (2048 tokens of ptb)
IMATRIX_CHUNKS = 16  # importance-matrix windows of the calibration text (4096 tokens)


def text_file(folder: Path, name: str, split: str) -> Path:
    """A corpus split as one text file (what llama.cpp's tools read)."""
    path = folder / f"{name}-{split}.txt"
    path.write_text(corpora.get_corpus(name, split).text)
    return path


def retried(call):
    """A llama.cpp tool run, once more if it fails: on a machine shared with a test suite, a run was seen to end
    without its final line (its output cut after 7 of 8 windows)."""
    try:
        return call()
    except GhostedError as err:
        print(f"  retrying once: {err}", flush=True)
        return call()


def weights_per_token(config) -> dict:
    """Multiply-adds per decoded token, from the config: one block's weights, and the LM head's (V × C)."""
    c, v, i = int(config.hidden_size), int(config.vocab_size), int(config.intermediate_size)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or c // heads)
    block = c * heads * head_dim * 2 + c * kv * head_dim * 2 + 3 * c * i
    return {"block": block, "head": v * c, "layers": int(config.num_hidden_layers)}


def bench_rounds(files: dict[str, Path], threads: list[int], args) -> dict[str, dict]:
    """llama-bench on every file at each thread count, in `args.rounds` rounds that each visit every file once (in a
    rotated order), so that load that comes and goes on a shared machine hits every file alike; per file and thread
    count, the median over all rounds' repetitions."""
    samples = {name: {str(t): {"prefill": [], "decode": []} for t in threads} for name in files}
    names = list(files)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            for t in threads:
                result = llamacpp_bench(files[name], threads=t, n_prompt=args.prefill, n_gen=args.decode,
                                        repetitions=args.repetitions)
                samples[name][str(t)]["prefill"] += list(result.prefill.samples)
                samples[name][str(t)]["decode"] += list(result.decode.samples)
    return {name: {t: {"prefill_tps": statistics.median(s["prefill"]), "decode_tps": statistics.median(s["decode"]),
                       "prefill_samples": s["prefill"], "decode_samples": s["decode"]} for t, s in per.items()}
            for name, per in samples.items()}


def setting_run(name: str):
    """(the loaded model, the run) of one setting: streamline's blocks at its depth, its stock operators fitted on
    the app's calibration (mix, 256-token windows), perplexity on ptb; no speed stage (llama.cpp times the files)."""
    model_name, depth, operators = SETTINGS[name]
    loaded = load_model(model_name)
    options = RunOptions(model=model_name, criterion="streamline", num_prune=depth, variants=parse_variants(operators),
                         calibration="mix", seqlen=256, eval_corpora=("ptb",), eval_max_tokens=2048, drift_windows=0,
                         speed=SpeedOptions(measure=False), quiet=True)
    return loaded, run(options, loaded)


def measure_setting(name: str, args, work: Path, threads: list[int]) -> dict:
    """One setting: the run, then every variant × type, files timed type by type, dense first."""
    model_name, depth, operators = SETTINGS[name]
    start = time.perf_counter()
    loaded, result = setting_run(name)
    calibration, ptb = text_file(work, "mix", "calibration"), text_file(work, "ptb", "evaluation")
    folders = {"dense": convert_embedded(model_name)}
    for variant in operators.split(","):
        folders[variant] = export_variant(result.models[variant], result.tokenizer, work / name / variant, "stock").folder
    files: dict[str, dict[str, Path]] = {}
    rows: dict[str, dict] = {}
    for variant, folder in folders.items():
        f16 = convert_to_gguf(folder, work / name / f"{variant}-f16.gguf", "f16").path
        imatrix = compute_imatrix(f16, calibration, work / name / f"{variant}-imatrix.gguf", CONTEXT, IMATRIX_CHUNKS,
                                  threads=max(threads)) if any("_k" in t for t in args.types) else None
        files[variant] = {t: f16 if t == "f16" else quantize_gguf(f16, work / name / f"{variant}-{t}.gguf", t,
                                                                  imatrix if "_k" in t else None).path
                          for t in args.types}
        model = result.models[variant] if variant != "dense" else loaded.model
        reference = llamacpp_windowed_perplexity(model, result.tokenizer, ptb.read_text(), CONTEXT, CHUNKS)
        rows[variant] = {"transformers_fp32_ppl": reference, "types": {}}
        for t, path in files[variant].items():
            ppl = retried(lambda: llamacpp_perplexity(path, ptb, CONTEXT, CHUNKS, threads=max(threads)))
            rows[variant]["types"][t] = {"bytes": path.stat().st_size, "ppl": ppl.value, "ppl_error": ppl.error}
        print(f"  {name} {variant}: files written and scored ({time.perf_counter() - start:.0f} s)", flush=True)
    for t in [t for t in args.types if t in args.speed_types]:  # type by type: dense and every variant in rounds
        for variant, speed in bench_rounds({v: files[v][t] for v in folders}, threads, args).items():
            rows[variant]["types"][t]["speed"] = speed
        print(f"  {name} {t}: timed ({time.perf_counter() - start:.0f} s)", flush=True)
    for variant in folders:  # what each file's perplexity and speed are against
        for t, entry in rows[variant]["types"].items():
            entry["ppl_vs_own_f16"] = entry["ppl"] / rows[variant]["types"]["f16"]["ppl"] if "f16" in args.types else None
            for n, speed in entry.get("speed", {}).items():
                dense = rows["dense"]["types"][t]["speed"][n]
                speed["prefill_vs_dense"] = speed["prefill_tps"] / dense["prefill_tps"]
                speed["decode_vs_dense"] = speed["decode_tps"] / dense["decode_tps"]
                none = rows.get("none", {}).get("types", {}).get(t, {}).get("speed", {}).get(n)
                speed["decode_vs_none"] = speed["decode_tps"] / none["decode_tps"] if none else None
    shapes = weights_per_token(loaded.model.config)
    layers, kept = shapes["layers"], shapes["layers"] - depth
    predicted = (layers * shapes["block"] + shapes["head"]) / (kept * shapes["block"] + shapes["head"])
    shutil.rmtree(work / name, ignore_errors=True)
    return {"model": model_name, "depth": depth, "removed": list(result.plan.removed), "layers": layers,
            "ideal_speedup": layers / kept, "predicted_speedup": predicted,
            "head_share_dense": shapes["head"] / (layers * shapes["block"] + shapes["head"]),
            "head_share_pruned": shapes["head"] / (kept * shapes["block"] + shapes["head"]),
            "run_ppl_ptb": result.perplexity.get("ptb", {}), "variants": rows,
            "seconds": time.perf_counter() - start}


def rescore_references(name: str, args) -> None:
    """Recompute one setting's transformers fp32 references in an existing results file (the same run, windows and
    text), without redoing its files and timings: for a results file written before `llamacpp_tokens` read
    special-token strings as llama.cpp does (Gemma-3's <unk>)."""
    report = json.loads(Path(args.out).read_text())
    entry = report["settings"][name]
    loaded, result = setting_run(name)
    assert list(result.plan.removed) == entry["removed"], (result.plan.removed, entry["removed"])
    text = corpora.get_corpus("ptb", "evaluation").text
    for variant, row in entry["variants"].items():
        model = result.models[variant] if variant != "dense" else loaded.model
        row["transformers_fp32_ppl"] = llamacpp_windowed_perplexity(model, result.tokenizer, text, CONTEXT, CHUNKS)
        print(f"  {name} {variant}: transformers fp32 {row['transformers_fp32_ppl']:.2f}, llama.cpp f16 "
              f"{row['types'].get('f16', {}).get('ppl', float('nan')):.2f}", flush=True)
    entry["references_rescored"] = " ".join(sys.argv)
    Path(args.out).write_text(json.dumps(report, indent=2))


def print_setting(entry: dict, threads: list[int]) -> None:
    print(f"\n{entry['model']}, streamline n = {entry['depth']} of {entry['layers']} (blocks {entry['removed']}): "
          f"ideal decode speed-up {entry['ideal_speedup']:.3f}x, predicted with the LM head {entry['predicted_speedup']:.3f}x "
          f"(the head is {100 * entry['head_share_dense']:.0f}% of a dense token's multiply-adds, "
          f"{100 * entry['head_share_pruned']:.0f}% of a pruned one's)")
    header = f"{'variant':<14}{'type':<8}{'MB':>8}{'ppl':>10}{'vs f16':>8}" + "".join(
        f"{f'pp x dense ({t}t)':>18}{f'tg x dense ({t}t)':>18}{f'tg tok/s ({t}t)':>16}" for t in threads) + \
        f"{'tg vs none (1t)':>17}"
    print(header)
    for variant, row in entry["variants"].items():
        for t, e in row["types"].items():
            line = f"{variant:<14}{t:<8}{e['bytes'] / 1e6:>8.1f}{e['ppl']:>10.2f}{e['ppl_vs_own_f16'] or 0:>8.3f}"
            if "speed" not in e:
                print(line)
                continue
            for n in map(str, threads):
                s = e["speed"][n]
                line += f"{s['prefill_vs_dense']:>17.3f}x{s['decode_vs_dense']:>17.3f}x{s['decode_tps']:>16.1f}"
            vs_none = e["speed"][str(threads[0])].get("decode_vs_none")
            print(line + (f"{vs_none:>16.3f}x" if vs_none else f"{'-':>17}"))
        print(f"{'':<14}{'(transformers fp32 ppl on the same windows: ' + format(row['transformers_fp32_ppl'], '.2f') + ')'}")


def markdown(report: dict) -> str:
    """docs/results.md's tables from a results file: per setting, each variant × type with its size, perplexity
    against its own f16, and (where timed) decode and prefill against dense and decode against plain pruning."""
    out = []
    for name, entry in report["settings"].items():
        threads = [str(t) for t in report["threads"]]
        out.append(f"**{entry['model']}, streamline n = {entry['depth']} of {entry['layers']}** (blocks "
                   f"{entry['removed'][0]}–{entry['removed'][-1]}): ideal decode speed-up {entry['ideal_speedup']:.3f}×, "
                   f"predicted with the LM head {entry['predicted_speedup']:.3f}× (the head is "
                   f"{100 * entry['head_share_dense']:.0f}% of a dense token's multiply-adds, "
                   f"{100 * entry['head_share_pruned']:.0f}% of a pruned one's).\n")
        cols = "".join(f" tg × dense ({t}t) | pp × dense ({t}t) |" for t in threads)
        out.append(f"| variant | type | MB | ppl ptb | × own f16 |{cols} tg × none (1t) |")
        out.append("|---|---|---|---|---|" + "---|---|" * len(threads) + "---|")
        for variant, row in entry["variants"].items():
            for t, e in row["types"].items():
                speed = e.get("speed")
                cells = "".join(f" {speed[n]['decode_vs_dense']:.3f} | {speed[n]['prefill_vs_dense']:.3f} |"
                                for n in threads) if speed else " – | – |" * len(threads)
                none = speed[threads[0]].get("decode_vs_none") if speed else None
                out.append(f"| {variant} | {t} | {e['bytes'] / 1e6:.1f} | {e['ppl']:.2f} | {e['ppl_vs_own_f16']:.3f} |"
                           f"{cells} {'–' if none is None or variant in ('dense', 'none') else f'{none:.3f}'} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--prefill", type=int, default=64, help="llama-bench prompt tokens (pp)")
    parser.add_argument("--decode", type=int, default=64, help="llama-bench generated tokens (tg)")
    parser.add_argument("--repetitions", type=int, default=2, help="llama-bench repetitions per call")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over every file of a type (see bench_rounds)")
    parser.add_argument("--speed_types", default=",".join(SPEED_TYPES), help="the types that are timed")
    parser.add_argument("--quick", action="store_true", help="one setting's speed at 1 thread, 2 repetitions")
    parser.add_argument("--out", default=None, help=out_help("gain"))
    parser.add_argument("--table", default=None, metavar="JSON", help="print the markdown tables of a results file")
    parser.add_argument("--rescore_references", default=None, choices=list(SETTINGS),
                        help="recompute one setting's transformers fp32 references in the results file (--out)")
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if args.rescore_references:
        args.out = str(result_path("gain", args.quick, args.out))
        torch.set_num_threads(os.cpu_count() or 1)
        torch.set_grad_enabled(False)
        rescore_references(args.rescore_references, args)
        return
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    args.speed_types = [t.strip() for t in args.speed_types.split(",") if t.strip()]
    args.out = str(result_path("gain", args.quick, args.out))
    torch.set_num_threads(os.cpu_count() or 1)
    torch.set_grad_enabled(False)
    threads = [1] if args.quick else sorted({1, os.cpu_count() or 1})
    if args.quick:
        args.repetitions, args.rounds = 1, 2
    report = {"command": " ".join(sys.argv), "cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads,
              "llamacpp": LLAMACPP_COMMIT, "prefill_tokens": args.prefill, "decode_tokens": args.decode,
              "repetitions": args.repetitions, "rounds": args.rounds, "perplexity": f"ptb (exact), {CHUNKS} windows of {CONTEXT} tokens, "
              "second halves scored", "imatrix": f"mix calibration text (a stand-in for C4), {IMATRIX_CHUNKS} × "
              f"{CONTEXT} tokens", "load_average_start": os.getloadavg()[0], "settings": {}}
    with tempfile.TemporaryDirectory(prefix="ghosted-gain-") as tmp:
        for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
            print(f"{name}: running", flush=True)
            report["settings"][name] = measure_setting(name, args, Path(tmp), threads)
            print_setting(report["settings"][name], threads)
            report["load_average_end"] = os.getloadavg()[0]
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2))  # after each setting: a cut-off run keeps its part
    print(f"\nwritten {args.out} (load average {report['load_average_start']:.1f} at the start, "
          f"{report['load_average_end']:.1f} at the end)")


if __name__ == "__main__":
    main()
