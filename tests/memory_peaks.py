"""Measure registry entries' peaks against their declarations, in a process of their own (run as a script).

    python tests/memory_peaks.py FOLDER CASE [CASE ...]     one JSON line per case, in order
    python tests/memory_peaks.py --table                     every case on a fresh model: docs/scale.md's table

A CASE is `criterion:NAME` (its scoring on the model in FOLDER), `criterion:NAME:memo_budget=B`
(also `:sequences=S:seqlen=T:batch=B` for other text sizes),
`operator:NAME` (its fit on one boundary's statistics, and the fold of the chosen fit) or
`refit:NAME:inner=2500:sinks=8` (a refit on synthetic statistics; FOLDER may be `-` if every case is one)
or `stage:size_and_speed` (the run's last stage, `export.gain.measure_gain`, on dense and two variants).

Measured: the peak resident size (VmHWM, reset once the model is loaded, the text made and the
statistics collected, what any process sets up once warmed, and glibc's free heap trimmed) minus
the resident size then, as bench/memory_plan.py measures whole runs. Planned: the entry's own
declaration for that phase (a criterion's `memory`, an operator's `cost` through
`memory_parts.fit_bytes`, the size-and-speed stage's `memory_parts.speed_bytes`). The cases of one
process share its model and its one-time set-up; each starts from a settled heap (what an earlier
case freed is returned to the system first), so each is measured as if alone (checked against one
process per case: the same figures within 0.3 MiB).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ghosted_core  # noqa: E402,F401  first: sets the thread settings before torch loads
import torch  # noqa: E402

from process_memory import reset_peak, status_bytes  # noqa: E402

SEQUENCES, SEQLEN, BATCH = 8, 512, 4  # calibration text of the operators' cases: one window per sink direction
SCORE_SEQUENCES, SCORE_BATCH = 4, 2  # the criteria's: two batches (what one batch leaves must not pile up), each with
# residual states of 4 MiB, half the operators' text (the probes of swap_kl and sleb take most of the worker's time)
BOUNDARY = (1, 2)  # the operators' boundary: block 1 removed
SINK_TOKENS = 8  # tokens 0…7 have massive embeddings in the test's model: one attention-sink row per window, as in
# real models, in 8 different directions, so that every sink-direction candidate of a fit is distinct (the worst case
# the declarations count: with a single sink direction, k = 1, 2, 4, 8 would all be one candidate)


def save_model(folder: Path) -> Path:
    """The shared random model (seeded): C = 1024, 4 blocks, I = 2816, 8,192-token vocabulary, fp32, tokens 0…7
    with embeddings 100× the others' (a massive activation at the first position of every window, in 8 directions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, vocab_size=8192, tie_word_embeddings=True,
                         max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:SINK_TOKENS].mul_(100.0)
    model.save_pretrained(folder)
    return folder


def registry_cases() -> list[str]:
    """Every criterion and every operator of the registries, and four cases beside them."""
    import ghosted_core.selection  # noqa: F401  registers every criterion
    from ghosted_core.recovery.operators import OPERATORS
    from ghosted_core.selection.criteria import CRITERIA

    return [f"criterion:{name}" for name in CRITERIA] + [f"operator:{name}" for name in OPERATORS] + [
        "criterion:sleb:memo_budget=0",  # every kept state but the embeddings recomputed
        "refit:refit:inner=2500:sinks=8",  # the down_proj refits at I = 2500 with 8 sink rows (synthetic statistics)
        "refit:magcomp_refit:inner=2500:sinks=8",
        "stage:size_and_speed",  # the run's last stage: sizes (meta walk) and batch-1 speed of dense and 2 variants
    ]


def _settle() -> int:
    """Free what can be freed, reset the peak, and return the resident size the peak is measured from."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status_bytes("VmRSS")
    reset_peak()
    return base


def _warm(model=None, batches=None) -> None:
    """What any process sets up once, before the peak is reset, so that it is not counted as the entry's: the
    thread pools, kernels and per-thread heaps of a first forward, and the BLAS/LAPACK buffers of a first float64
    product, Cholesky factorization and triangular solve (measured: about 7 MiB, kept for the process's life)."""
    with torch.no_grad():
        if model is not None:
            model.model(input_ids=batches[0].input_ids)
        gram = torch.randn(1024, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        gram = gram @ gram.T + 1024 * torch.eye(1024, dtype=torch.float64)
        factor = torch.linalg.cholesky(gram)
        torch.linalg.solve_triangular(factor, gram, upper=False)
        torch.linalg.eigvalsh(gram[:256, :256])


def _batches(vocab: int, sequences: int = SEQUENCES, seqlen: int = SEQLEN, batch: int = BATCH):
    from ghosted_core.calibration.collect import make_batches

    ids = torch.randint(1, vocab, (sequences, seqlen), generator=torch.Generator().manual_seed(0))
    ids = ids.clamp(min=SINK_TOKENS)  # ordinary tokens elsewhere
    ids[:, 0] = torch.arange(sequences) % SINK_TOKENS  # each window starts with a sink token, as real text with BOS
    return make_batches(ids, None, batch)


def _load(folder: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.requires_grad_(False)
    for parameter in model.parameters():  # own memory, not pages of the mapped file that the first forward would
        parameter.data = parameter.data.clone()  # bring in and the peak would count as the entry's
    return model


def criterion(model, name: str, memo_budget: int | None = None, sequences: int = SCORE_SEQUENCES,
              seqlen: int = SEQLEN, batch: int = SCORE_BATCH) -> dict:
    """The criterion's scoring alone (its similarity pass included) against its `memory` declaration."""
    import ghosted_core.selection  # noqa: F401  registers every criterion
    from ghosted_core.selection.criteria import Scoring, SelectionRequest, get_criterion
    from ghosted_core.selection.footprint import ScoreShapes
    from ghosted_core.selection.similarity import measure_similarity

    config, spec = model.config, get_criterion(name)
    n = 2
    request = SelectionRequest(config.num_hidden_layers, n, (1, 2) if name == "manual" else ())
    batches = _batches(config.vocab_size, sequences, seqlen, batch)
    _warm(model, batches)
    base = _settle()
    with torch.no_grad():
        sim = measure_similarity(model, n, batches, quiet=True) if spec.needs_similarity else None
        spec.select(request, Scoring(model, batches, sim, memo_budget=memo_budget))
    measured = status_bytes("VmHWM") - base
    footprint = spec.memory(ScoreShapes(config, 4, sequences, seqlen, batch, n, memo_budget=memo_budget))
    return {"measured": measured, "planned": footprint.bytes, "note": footprint.note}


_STATS: dict = {}  # StatNeeds → one boundary's statistics, read (never changed) by every operator case that needs them


def operator(model, name: str) -> dict:
    """The operator's fit on one boundary's statistics, and its realization in the model (a fold), against
    `memory_parts.fit_bytes` of its cost."""
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats
    from ghosted_core.memory_parts import fit_bytes, inner_width
    from ghosted_core.plan import Boundary
    from ghosted_core.recovery.operators import FitOptions, choose_by_heldout, get_operator, needs_of
    from ghosted_core.run.fitting import _realize

    config, spec, opts = model.config, get_operator(name), FitOptions()
    needs = needs_of([name])
    if needs not in _STATS:  # operators that need the same statistics share one pass, as a run's variants do
        calibrate = CalibrationOptions(quiet=True, sink_rule="position")  # the first token of every window: 8 sinks
        (_STATS[needs],) = collect_stats(model, [Boundary(*BOUNDARY)], _batches(config.vocab_size), calibrate, needs)
    stats = _STATS[needs]
    _warm()
    base = _settle()
    fit = spec.fit(stats, opts)
    fit = choose_by_heldout(fit, [None] * len(fit.candidates))  # the candidates go once one is chosen
    realized = _realize(model, [fit])  # then the chosen fit's fold (a down_proj changed in float64), same phase
    measured = status_bytes("VmHWM") - base
    sinks = stats.sinks.tokens
    del realized, fit
    planned = fit_bytes(spec.cost, config, len(set(opts.sink_directions)), inner_width(config, needs),
                        opts.refit_candidates)
    return {"measured": measured, "planned": planned, "sinks": sinks}


def refit(_model, name: str, inner: int = 2500, sinks: int = 8, width: int = 256, tokens: int = 3000) -> dict:
    """A refit operator on synthetic statistics: I = `inner`, C = `width`, `sinks` massive rows of a."""
    from transformers import LlamaConfig

    from ghosted_core.calibration.collect import BoundaryAccumulator, CalibrationOptions
    from ghosted_core.memory_parts import fit_bytes
    from ghosted_core.plan import Boundary
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1, tokens, inner, dtype=torch.float64, generator=generator)  # (1, T, I)
    x_pre = torch.randn(1, tokens, width, dtype=torch.float64, generator=generator)  # (1, T, C)
    x_post = 1.3 * x_pre + a @ (0.02 * torch.randn(inner, width, dtype=torch.float64, generator=generator))
    x_pre[:, :sinks] *= 100.0
    x_post[:, :sinks] *= 100.0
    a[:, :sinks] *= 30.0
    accumulator = BoundaryAccumulator(Boundary(2, 4), CalibrationOptions(), needs_of([name]))
    accumulator.add(x_pre, x_post, None, torch.ones(1, tokens, dtype=torch.bool), a)
    stats = accumulator.freeze()
    del a, x_pre, x_post, accumulator
    _warm()
    base = _settle()
    spec, opts = get_operator(name), FitOptions()
    spec.fit(stats, opts)
    measured = status_bytes("VmHWM") - base
    config = LlamaConfig(hidden_size=width, intermediate_size=inner, num_hidden_layers=4, num_attention_heads=4)
    planned = fit_bytes(spec.cost, config, len(set(opts.sink_directions)), inner, opts.refit_candidates)
    return {"measured": measured, "planned": planned, "sinks": stats.sinks.tokens}


def stage(model, name: str) -> dict:
    """The size-and-speed stage (`export.gain.measure_gain`, its default prompt and new tokens) on dense and two
    variants of one boundary (plain pruning, and magcomp's folded scales), against `memory_parts.speed_bytes`:
    the variants share the dense weights and are timed one at a time, so nothing grows with their number."""
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats
    from ghosted_core.export.gain import SpeedOptions, measure_gain
    from ghosted_core.memory_parts import speed_bytes
    from ghosted_core.plan import PruningPlan
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of
    from ghosted_core.run.fitting import build_recovered
    from ghosted_core.run.options import VariantSpec

    if name != "size_and_speed":
        raise SystemExit(f"unknown stage {name!r}")
    config, plan = model.config, PruningPlan(model.config.num_hidden_layers, tuple(range(*BOUNDARY)), "manual")
    operators = ("none", "magcomp")
    stats = collect_stats(model, plan.boundaries, _batches(config.vocab_size), CalibrationOptions(quiet=True),
                          needs_of(operators))
    models = {"dense": model} | {op: build_recovered(model, plan, VariantSpec(op, op),
                                                     [get_operator(op).fit(s, FitOptions()) for s in stats])
                                 for op in operators}
    del stats
    options = SpeedOptions(measure=True, repeats=1)
    measure_gain({"dense": model}, options, quiet=True)  # generate's one-time set-up (as _warm does for a forward)
    base = _settle()
    clock = time.perf_counter()
    report = measure_gain(models, options, quiet=True)
    seconds = time.perf_counter() - clock
    measured = status_bytes("VmHWM") - base
    planned = speed_bytes(config, options.prefill_tokens + options.decode_tokens, torch.float32)
    return {"measured": measured, "planned": planned, "seconds": seconds,
            "weight_bytes": {name: size.weight_bytes for name, size in report.sizes.items()}}


def parse_case(case: str) -> tuple[str, str, dict]:
    """`kind:name[:key=value…]` → (kind, name, integer options)."""
    kind, name, *options = case.split(":")
    if kind not in ("criterion", "operator", "refit", "stage"):
        raise SystemExit(f"unknown kind {kind!r} in {case!r}")
    return kind, name, {key: int(value) for key, value in (option.split("=") for option in options)}


def markdown(rows: list[dict]) -> list[str]:
    """docs/scale.md's table: one row per case, MiB and the ratio."""
    lines = ["| entry | options | measured (MiB) | declared (MiB) | declared / measured |", "|---|---|---|---|---|"]
    for row in rows:
        options = ", ".join(f"{k} = {v}" for k, v in row["options"].items()) or "-"
        measured, planned = row["measured"] / 2**20, row["planned"] / 2**20
        lines.append(f"| {row['kind']} `{row['name']}` | {options} | {measured:.1f} | {planned:.1f} | "
                     f"{planned / measured:.2f} |" if measured > 0 and planned > 0 else
                     f"| {row['kind']} `{row['name']}` | {options} | {measured:.1f} | {planned:.1f} | - |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=None)
    parser.add_argument("cases", nargs="*", help="kind:name[:key=value…]")
    parser.add_argument("--table", action="store_true", help="every case on a fresh model, as a markdown table")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.table:
        import tempfile

        folder = tempfile.mkdtemp(prefix="memory_c1024_")
        save_model(Path(folder))
        args.folder, args.cases = folder, registry_cases()
    if not args.folder or not args.cases:
        parser.error("give FOLDER and at least one CASE, or --table")
    cases = [parse_case(case) for case in args.cases]
    model = _load(args.folder) if any(kind != "refit" for kind, _, _ in cases) else None
    measure = {"criterion": criterion, "operator": operator, "refit": refit, "stage": stage}
    rows = []
    for kind, name, options in cases:
        row = measure[kind](model, name, **options) | {"kind": kind, "name": name, "options": options}
        rows.append(row)
        if not args.table:
            print(json.dumps(row), flush=True)
    if args.table:
        print("\n".join(markdown(rows)))


if __name__ == "__main__":
    main()
