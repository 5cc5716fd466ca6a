"""Command line: `python -m ghosted_core` with the seed repository's flags.

Parses, builds `RunOptions`, calls `run.pipeline.run` (or `run.sweep.run_sweep` for a depth range
`--total_num_prune START:STOP:STEP`, or `run.compare.run_compare` for a comma list of criteria),
writes OUTDIR/results.json and prints a summary table.
Holds no method logic. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ghosted_core.progress import StderrSink, reporting
from ghosted_core.data import corpora
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.calibration.pipelines import CALIBRATION_PIPELINES
from ghosted_core.cli_distill import add_distill_arguments, distill_options, insert_types
from ghosted_core.cli_summary import summary, sweep_summary
from ghosted_core.errors import GhostedError
from ghosted_core.files import check_new_folder, check_writable_folder, write_text
from ghosted_core.evaluation.generation import GenerationOptions
from ghosted_core.export.folder import EXPORT_MODES, check_export, export_variant
from ghosted_core.export.gain import SpeedOptions
from ghosted_core.export.gguf import (GGUF_FORMAT, GGUF_OUTTYPES, GGUFOptions, export_gguf, find_llamacpp,
                                      parse_gguf_types)
from ghosted_core.model.embedded import DEFAULT_MODEL, embedded_names
from ghosted_core.model.loading import LoadOptions, parse_max_memory, peek_config
from ghosted_core.recovery.assessment import SHOWN, Diagnostics
from ghosted_core.recovery.magcomp import MAGCOMP_FORMS
from ghosted_core.recovery.operators import OPERATORS, FitOptions
from ghosted_core.run.options import DEFAULT_VARIANTS, SEQUENTIAL_SUFFIX, RunOptions, gguf_options, parse_variants
from ghosted_core.run.result import RunResult
from ghosted_core.run.pipeline import run
from ghosted_core.selection.criteria import COSINE_AXES, CRITERIA, parse_layers
from ghosted_core.run.compare import CompareResult, parse_criteria, run_compare
from ghosted_core.run.sweep import SweepResult, parse_depths, run_sweep
from ghosted_core.evaluation.tasks import parse_tasks
from ghosted_core.data.user_text import USER_CORPUS, canonical, from_file

log = logging.getLogger("ghosted_core")


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line on stderr with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip() and item.strip().lower() != "none")


def _criteria(text: str) -> str:
    """One criterion, or a comma list of them (a comparison); argparse reports an unknown name."""
    for name in (n.strip() for n in text.split(",")):
        if name not in CRITERIA:
            raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(CRITERIA)})")
    return text


def _gguf_types(text: str) -> tuple[str, ...]:
    """--gguf_type: a comma list of GGUF types; argparse reports an unknown one before anything loads."""
    try:
        return parse_gguf_types(text)
    except GhostedError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def is_comparison(args: argparse.Namespace) -> bool:
    return "," in args.pruning_method


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m ghosted_core",
                       description="Prune decoder blocks of a causal LM and recover them without training.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded model ({', '.join(embedded_names())}), local folder, or Hub id")
    p.add_argument("--pruning_method", default="streamline", type=_criteria,
                   help=f"how blocks are chosen: {', '.join(CRITERIA)}; a comma list (streamline,shortgpt,sleb) "
                        "compares the criteria in one run (one calibration pass for every plan)")
    p.add_argument("--layers", default="", help="blocks to remove for --pruning_method manual, e.g. 20,21,25-27")
    p.add_argument("--total_num_prune", default="7",
                   help="number of blocks to remove, or a depth sweep START:STOP:STEP with STOP included "
                        "(2:10:2 = 2, 4, 6, 8, 10) from one scoring and one calibration pass")
    p.add_argument("--cosine", default="hidden", choices=COSINE_AXES,
                   help="hidden: per-token cosine (papers); token-axis: the reference repos' variant")
    p.add_argument("--insert_type", default=",".join(DEFAULT_VARIANTS),
                   help=f"recovery operator(s), comma list of {', '.join(OPERATORS)}; "
                        f"append {SEQUENTIAL_SUFFIX} for the sequential fit (e.g. ghost{SEQUENTIAL_SUFFIX})")
    p.add_argument("--calibration_data", default="mix",
                   help="calibration corpus: " + ", ".join(corpora.corpus_names()) + ", or yours (with --user_text)")
    p.add_argument("--user_text", default=None, metavar="FILE",
                   help="your own text (.txt, or .jsonl with a \"text\" field per line; at most 5 MB), used where "
                        "--calibration_data or --eval_ppl names yours; kept in memory only")
    p.add_argument("--train_size", type=int, default=None,
                   help="calibration sequences (paper: 128); default: enough for at least 4·C fit tokens, at least 64 "
                        "(C = hidden size; e.g. 32 at --seqlen 512 for C = 4096); fewer than C tokens make the "
                        "least-squares fits rank-deficient (a relative ridge then decides them, with a warning)")
    p.add_argument("--seqlen", type=int, default=512, help="calibration sequence length (paper: 2048)")
    p.add_argument("--bos", default="auto", choices=list(corpora.BOS_RULES),
                   help="start every calibration and perplexity window with the BOS token: auto (when the tokenizer "
                        "adds one, as Gemma-3's does), window (always) or none (plain text windows)")
    p.add_argument("--heldout_size", type=int, default=None, help="held-out calibration sequences (default train_size/8)")
    p.add_argument("--eval_ppl", default="ptb,wiki",
                   help="comma list of perplexity corpora ('none' to skip; yours = --user_text)")
    p.add_argument("--eval_seqlen", type=int, default=None, help="perplexity window length (default: --seqlen)")
    p.add_argument("--eval_max_tokens", type=int, default=8192,
                   help="perplexity token cap per corpus for quick runs; 0 = the whole split")
    p.add_argument("--eval_tasks", default="", help="zero-shot tasks through lm-eval: comma list, 'paper' or 'all'")
    p.add_argument("--task_limit", type=int, default=None, help="examples per task (seeded, same for every variant)")
    p.add_argument("--task_batch_size", type=int, default=8)
    p.add_argument("--prompt", default=None, help="also generate a continuation of this prompt with every variant")
    p.add_argument("--max_new_tokens", type=int, default=40)
    p.add_argument("--sink_rule", default="norm", choices=["norm", "position", "none"],
                   help="how massive-activation tokens are found (for ghost_nosink and the ordinary-token errors)")
    p.add_argument("--sink_ratio", type=float, default=CalibrationOptions.sink_ratio,
                   help="a token is a sink when its norm exceeds this multiple of the batch median")
    p.add_argument("--ridge", default="absolute", choices=["absolute", "relative"],
                   help="absolute: the paper's ε; relative: ε = λ·tr(XᵀX)/C")
    p.add_argument("--epsilon", type=float, default=FitOptions.epsilon, help="absolute ridge ε")
    p.add_argument("--ridge_lambda", type=float, default=FitOptions.ridge_lambda, help="relative ridge λ")
    p.add_argument("--magcomp_form", default=FitOptions.magcomp_form, choices=MAGCOMP_FORMS,
                   help="magcomp's scalar: global = mean|X_post| / mean|X_pre| (issue 18), channel = the mean of "
                        "per-channel ratios (Prune&Comp's code); _ordinary: attention-sink tokens left out")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per calibration forward pass")
    p.add_argument("--calibration_pipeline", default="auto", choices=["auto", *CALIBRATION_PIPELINES],
                   help="full: one forward per batch; blocks: hidden states on the CPU, one block at a time on the "
                        "compute device (models larger than the GPU); auto: the memory plan chooses")
    p.add_argument("--stats_device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where calibration statistics are summed (float64): auto = on the GPU when the memory plan "
                        "has room, else on the CPU")
    p.add_argument("--fp32_products", action="store_true",
                   help="per-batch statistics products in fp32, summed in float64 (GPUs with slow FP64)")
    p.add_argument("--sink_capacity", type=int, default=None,
                   help="attention-sink token rows kept per boundary (default 4 per calibration sequence, at least 64); "
                        "more spill into C×C moments with a warning")
    p.add_argument("--diagnostics", action="store_true",
                   help="also compute, per fit, its condition number, singular values and calibration-token boundary "
                        "errors (results.json; O(C³) each, off by default: the summary shows none of them)")
    p.add_argument("--outdir", default="out", help="folder for results.json")
    p.add_argument("--save_model", default=None, metavar="DIR",
                   help="save each pruned variant to DIR/<variant> as a Hugging Face folder (see --export)")
    p.add_argument("--export", default="auto", choices=[*EXPORT_MODES, GGUF_FORMAT],
                   help="format of --save_model: stock (plain transformers and serving engines; "
                        + ", ".join(name for name, spec in OPERATORS.items() if spec.stock)
                        + "), remote_code (needs trust_remote_code=True; every operator), auto (stock "
                        "where the variant folds, remote_code otherwise), gguf (stock plus a GGUF written by "
                        "llama.cpp's converter; needs `make llamacpp`)")
    p.add_argument("--gguf_type", default=("f16",), type=_gguf_types,
                   help=f"GGUF weights for --export gguf, a comma list of {', '.join(GGUF_OUTTYPES)} (f16 by "
                        "llama.cpp's converter, the others by llama-quantize from it; e.g. q4_k_m,q8_0)")
    p.add_argument("--gguf_imatrix", action="store_true",
                   help="quantize the k-quants (q4_k_m, q5_k_m, q6_k) with an importance matrix computed by "
                        "llama-imatrix on the run's own calibration text")
    p.add_argument("--gguf_imatrix_chunks", type=int, default=None, metavar="N",
                   help=f"windows of {GGUFOptions.context} tokens the importance matrix reads (llama-imatrix's "
                        f"--chunks; {GGUFOptions.imatrix_chunks} by default; time grows with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto",
                   help="auto (cuda if present, else cpu), cpu, cuda, cuda:N, or map (accelerate: GPUs, then CPU, "
                        "then disk); weights load straight onto it")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--max_memory", default=None, metavar="CAPS",
                   help="with --device map: memory cap per device, e.g. 0=20GiB,cpu=60GiB (the rest goes to disk)")
    p.add_argument("--offload_folder", default=None, metavar="DIR",
                   help="with --device map: folder for weights that must be re-saved to be offloaded to disk "
                        "(default: the cache folder's offload/<model>)")
    p.add_argument("--no_speed", action="store_true",
                   help="report each variant's size only, without timing its prefill and decode against dense "
                        "(a few seconds per variant and depth)")
    p.add_argument("--speed_repeats", type=int, default=SpeedOptions.repeats,
                   help="rounds of the speed measurement (each variant and dense once per round; the median is kept)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_distill_arguments(p)
    return p


def is_sweep(args: argparse.Namespace) -> bool:
    """A depth range (START:STOP[:STEP]) asks for a sweep, even one that holds a single depth."""
    return ":" in str(args.total_num_prune)


def _depth(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise GhostedError(f"--total_num_prune {text!r}: write a number of blocks (7) or a sweep START:STOP:STEP "
                           "(2:10:2)") from None


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """Widget-free translation of the flags into the library's options."""
    calibration = canonical(args.calibration_data)
    eval_corpora = tuple(canonical(name) for name in _comma_list(args.eval_ppl))
    user_text = None
    if args.user_text:
        if USER_CORPUS not in (calibration, *eval_corpora):
            raise GhostedError("--user_text is given but not used: add --calibration_data yours and/or yours to "
                               "--eval_ppl")
        user_text = from_file(args.user_text)
    return RunOptions(
        model=args.model,
        load=LoadOptions(device=args.device, dtype=args.dtype, max_memory=parse_max_memory(args.max_memory),
                         offload_folder=args.offload_folder),
        criterion=parse_criteria(args.pruning_method)[0] if is_comparison(args) else args.pruning_method,
        num_prune=parse_depths(args.total_num_prune)[0] if is_sweep(args) else _depth(args.total_num_prune),
        layers=parse_layers(args.layers),
        cosine=args.cosine,
        variants=parse_variants(insert_types(args)),
        distill=distill_options(args),
        calibration=calibration,
        user_text=user_text,
        train_size=args.train_size,
        seqlen=args.seqlen,
        heldout_size=args.heldout_size,
        seed=args.seed,
        bos=args.bos,
        eval_corpora=eval_corpora,
        eval_seqlen=args.eval_seqlen,
        eval_max_tokens=args.eval_max_tokens or None,
        tasks=tuple(parse_tasks(args.eval_tasks)) if args.eval_tasks else (),
        task_limit=args.task_limit,
        task_batch_size=args.task_batch_size,
        prompt=args.prompt,
        generation=GenerationOptions(max_new_tokens=args.max_new_tokens, seed=args.seed),
        speed=SpeedOptions(measure=False) if args.no_speed else SpeedOptions(repeats=args.speed_repeats),
        fit=FitOptions(epsilon=args.epsilon, ridge=args.ridge, ridge_lambda=args.ridge_lambda,
                       magcomp_form=args.magcomp_form, condition_number=args.diagnostics),
        diagnostics=Diagnostics() if args.diagnostics else SHOWN,
        calibrate=CalibrationOptions(sink_rule=args.sink_rule, sink_ratio=args.sink_ratio, batch_size=args.batch_size,
                                     quiet=args.quiet, pipeline=args.calibration_pipeline,
                                     stats_device=args.stats_device, sink_capacity=args.sink_capacity,
                                     products="float32" if args.fp32_products else "float64"),
        quiet=args.quiet,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "accelerate", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.quiet:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    try:
        options = options_from_args(args)
        outdir = check_outputs(args, options)
        with reporting(None if args.quiet else StderrSink()):  # long loops: a progress line on stderr
            if is_comparison(args):
                result = run_compare(options, parse_criteria(args.pruning_method))
            else:
                result = run_sweep(options, parse_depths(args.total_num_prune)) if is_sweep(args) else run(options)
        report = result.to_json()
        write_text(outdir / "results.json", json.dumps(report, indent=2))
        if isinstance(result, CompareResult):
            from ghosted_core.report.compare import compare_text, write_compare_html

            print(compare_text(report))
            print(f"charts: {write_compare_html(report, outdir / 'compare.html')}")
        elif isinstance(result, SweepResult):
            from ghosted_core.report.sweep import write_sweep_html  # the app's charts, drawn once more into a file

            print(sweep_summary(result))
            print(f"charts: {write_sweep_html(report, outdir / 'sweep.html')}")
        else:
            print(summary(result))
            if args.save_model:
                report["exports"] = save_variants(result, Path(args.save_model), args.export, args.gguf_type,
                                                  args.gguf_imatrix, args.gguf_imatrix_chunks)
                write_text(outdir / "results.json", json.dumps(report, indent=2))
    except GhostedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"results: {outdir / 'results.json'}")
    return 0


def check_outputs(args: argparse.Namespace, options: RunOptions) -> Path:
    """Everything about the run's outputs that can fail, checked before any work: the folders exist and
    can be written, an export target is new or empty, the export format suits the operators. Returns --outdir."""
    if (is_sweep(args) or is_comparison(args)) and args.save_model:
        raise GhostedError("--save_model saves the variants of one depth and one criterion; run a single "
                           "--total_num_prune and --pruning_method to save")
    if is_sweep(args) and is_comparison(args):
        raise GhostedError("a criteria comparison runs at one depth: give --total_num_prune a single number")
    outdir = check_writable_folder(args.outdir, "--outdir")
    if args.gguf_imatrix and not (args.save_model and args.export == GGUF_FORMAT):
        raise GhostedError("--gguf_imatrix quantizes GGUF files: add --save_model DIR --export gguf")
    if args.gguf_imatrix_chunks is not None and not args.gguf_imatrix:
        raise GhostedError("--gguf_imatrix_chunks sets the importance matrix's windows: add --gguf_imatrix")
    if args.gguf_imatrix_chunks is not None and args.gguf_imatrix_chunks < 1:
        raise GhostedError(f"--gguf_imatrix_chunks must be at least 1 (got {args.gguf_imatrix_chunks})")
    if args.save_model:
        check_export([v.operator for v in options.variants], "stock" if args.export == GGUF_FORMAT else args.export,
                     config=peek_config(options.model, options.load.local_folders))
        if args.export == GGUF_FORMAT:
            find_llamacpp()  # refused before the run, not after it
        check_new_folder(args.save_model, "--save_model")
    if args.offload_folder:
        check_writable_folder(args.offload_folder, "--offload_folder")
    return outdir


def save_variants(result: RunResult, folder: Path, mode: str, gguf_types: tuple[str, ...] = ("f16",),
                  imatrix: bool = False, imatrix_chunks: int | None = None) -> dict[str, dict]:
    """Export every pruned variant to folder/<variant>, saying in which format and why (gguf: stock + its GGUF
    files, each with its size and perplexity; the importance matrix over `imatrix_chunks` windows, when given)."""
    exports = {}
    chunks = {} if imatrix_chunks is None else {"imatrix_chunks": imatrix_chunks}
    for name, model in result.models.items():
        if name != "dense":
            if mode == GGUF_FORMAT:
                done = export_gguf(model, result.tokenizer, folder / name, gguf_types,
                                   gguf_options(result.options, imatrix, **chunks))
            else:
                done = export_variant(model, result.tokenizer, folder / name, mode)
            exports[name] = done.to_json()
            ggufs = getattr(done, "ggufs", ())
            files = f" and {', '.join(g.path.name for g in ggufs)}" if ggufs else ""
            print(f"saved {name} as {done.mode}{files} ({done.reason}): {done.folder}")
            for g in ggufs:
                ppl = "" if g.perplexity is None else f"  ppl {g.perplexity.value:.3f} ± {g.perplexity.error:.3f}"
                print(f"  {g.path.name}  {g.outtype}  {g.bytes / 1e6:.1f} MB{ppl}")
            if ggufs and ggufs[0].perplexity is not None:
                p = ggufs[0].perplexity
                print(f"  perplexity: llama-perplexity on {done.eval_label}, {p.chunks} windows of {p.context} "
                      f"tokens (second half scored); transformers fp32 on the same windows: {done.reference_ppl:.3f}"
                      + (f"; importance matrix on {done.imatrix}" if done.imatrix else ""))
    return exports
