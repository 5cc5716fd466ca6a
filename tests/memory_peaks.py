"""Measure one registry entry's peak against its declaration, in a process of its own (run as a script).

    python tests/memory_peaks.py FOLDER criterion NAME [--memo_budget B]   # its scoring on the model in FOLDER
    python tests/memory_peaks.py FOLDER operator NAME                       # its fit on one boundary's statistics
    python tests/memory_peaks.py - refit NAME --inner 2500 --sinks 8        # a refit on synthetic statistics

Measured: the peak resident size (VmHWM, reset once the model is loaded, the text made and the
statistics collected, and glibc's free heap trimmed) minus the resident size then, as
bench/memory_plan.py measures whole runs. Planned: the entry's own declaration for that phase
(a criterion's `memory`, an operator's `cost` through `memory_parts.fit_bytes`). One JSON line out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ghosted_core  # noqa: E402,F401  first: sets the thread settings before torch loads
import torch  # noqa: E402

from process_memory import reset_peak, status_bytes  # noqa: E402

SEQUENCES, SEQLEN, BATCH = 8, 128, 4  # calibration text of the criteria and operators cases
BOUNDARY = (1, 2)  # the operators' boundary: block 1 removed
SINK_TOKEN = 0  # its embedding is massive in the test's model: one attention-sink row per window, as in real models


def _settle() -> int:
    """Free what can be freed, reset the peak, and return the resident size the peak is measured from."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status_bytes("VmRSS")
    reset_peak()
    return base


def _batches(vocab: int, sequences: int = SEQUENCES, seqlen: int = SEQLEN, batch: int = BATCH):
    from ghosted_core.calibration.collect import make_batches

    ids = torch.randint(1, vocab, (sequences, seqlen), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = SINK_TOKEN  # every window starts with the model's sink token, as real text starts with BOS
    return make_batches(ids, None, batch)


def _load(folder: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.requires_grad_(False)
    for parameter in model.parameters():  # own memory, not pages of the mapped file that the first forward would
        parameter.data = parameter.data.clone()  # bring in and the peak would count as the entry's
    return model


def criterion(folder: str, name: str, memo_budget: int | None) -> dict:
    """The criterion's scoring alone (its similarity pass included) against its `memory` declaration."""
    import ghosted_core.selection  # noqa: F401  registers every criterion
    from ghosted_core.selection.criteria import Scoring, SelectionRequest, get_criterion
    from ghosted_core.selection.footprint import ScoreShapes
    from ghosted_core.selection.similarity import measure_similarity

    model = _load(folder)
    config, spec = model.config, get_criterion(name)
    n = 2
    request = SelectionRequest(config.num_hidden_layers, n, (1, 2) if name == "manual" else ())
    batches = _batches(config.vocab_size)
    base = _settle()
    with torch.no_grad():
        sim = measure_similarity(model, n, batches, quiet=True) if spec.needs_similarity else None
        spec.select(request, Scoring(model, batches, sim, memo_budget=memo_budget))
    measured = status_bytes("VmHWM") - base
    footprint = spec.memory(ScoreShapes(config, 4, SEQUENCES, SEQLEN, BATCH, n, memo_budget=memo_budget))
    return {"measured": measured, "planned": footprint.bytes, "note": footprint.note}


def operator(folder: str, name: str) -> dict:
    """The operator's fit on one boundary's statistics against `memory_parts.fit_bytes` of its cost."""
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats
    from ghosted_core.memory_parts import fit_bytes, inner_width
    from ghosted_core.plan import Boundary
    from ghosted_core.recovery.operators import FitOptions, get_operator, needs_of

    model = _load(folder)
    config, spec, opts = model.config, get_operator(name), FitOptions()
    needs = needs_of([name])
    calibrate = CalibrationOptions(quiet=True, sink_rule="position")  # the first token of every window: 8 sink rows
    (stats,) = collect_stats(model, [Boundary(*BOUNDARY)], _batches(config.vocab_size), calibrate, needs)
    base = _settle()
    spec.fit(stats, opts)
    measured = status_bytes("VmHWM") - base
    planned = fit_bytes(spec.cost, config, len(set(opts.sink_directions)), inner_width(config, needs),
                        opts.refit_candidates)
    return {"measured": measured, "planned": planned, "sinks": stats.sinks.tokens}


def refit(name: str, inner: int, sinks: int, width: int = 256, tokens: int = 3000) -> dict:
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
    base = _settle()
    spec, opts = get_operator(name), FitOptions()
    spec.fit(stats, opts)
    measured = status_bytes("VmHWM") - base
    config = LlamaConfig(hidden_size=width, intermediate_size=inner, num_hidden_layers=4, num_attention_heads=4)
    planned = fit_bytes(spec.cost, config, len(set(opts.sink_directions)), inner, opts.refit_candidates)
    return {"measured": measured, "planned": planned, "sinks": stats.sinks.tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("kind", choices=("criterion", "operator", "refit"))
    parser.add_argument("name")
    parser.add_argument("--memo_budget", type=int, default=None)
    parser.add_argument("--inner", type=int, default=2500)
    parser.add_argument("--sinks", type=int, default=8)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.kind == "criterion":
        row = criterion(args.folder, args.name, args.memo_budget)
    elif args.kind == "operator":
        row = operator(args.folder, args.name)
    else:
        row = refit(args.name, args.inner, args.sinks)
    print(json.dumps(row | {"kind": args.kind, "name": args.name}))


if __name__ == "__main__":
    main()
