"""Every criterion and every operator, run alone, peaks within its own memory declaration: measured ≤ planned ≤ 1.3×.

One random Llama (C = 1024, 4 blocks, I = 2816, 8,192-token vocabulary, fp32) is saved once per
session; every registry entry then runs in one worker process (`memory_peaks.py`, apart from the
test process), its scoring (a criterion) or its fit on one boundary's statistics and the fold of
the chosen fit (an operator), each from a settled heap, and its peak resident size is held
against what it declares. A new registry entry is measured here without a line added. A criterion
scores 4 windows of 512 tokens in batches of 2 (two batches, so that what one leaves behind would
show), an operator fits 8 windows in batches of 4: one batch's buffers (4 and 8 MiB per residual
state) dwarf the allocator's noise. Every window starts with a token whose embedding is massive,
so that the fits see attention-sink rows (8 directions) as in real models. Four cases beside the
registry: the down_proj refits at I = 2500 with 8 sink rows (synthetic statistics), sleb with a memo budget
of 0 (every kept state but the embeddings recomputed), and the run's size-and-speed stage on dense
and two variants (`memory_parts.speed_bytes`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ghosted_core.selection  # noqa: F401  registers every criterion
from ghosted_core.recovery.operators import OPERATORS
from ghosted_core.selection.criteria import CRITERIA

WORKER = Path(__file__).with_name("memory_peaks.py")
SLACK = 8 * 2**20  # allocator and interpreter noise, in bytes, on either side
RATIO = 1.3  # planned ≤ RATIO × measured

sys.path.insert(0, str(WORKER.parent))
from memory_peaks import registry_cases, save_model  # noqa: E402

CASES = registry_cases()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The shared random C = 1024 model on disk (`memory_peaks.save_model`)."""
    return save_model(tmp_path_factory.mktemp("memory_c1024"))


@pytest.fixture(scope="module")
def peaks(model_folder) -> dict[str, dict]:
    """Every case measured by one worker process (the model loaded once; each case from a settled heap)."""
    done = subprocess.run([sys.executable, str(WORKER), str(model_folder), *CASES], capture_output=True, text=True,
                          timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    found = dict(zip(CASES, rows))
    if done.returncode != 0:
        found["error"] = done.stderr[-4000:]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_declared_memory_holds_the_measured_peak(peaks, case):
    assert case in peaks, peaks.get("error", "no row")
    row = peaks[case]
    measured, planned = row["measured"], row["planned"]
    shown = f"{case}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"
    assert measured <= planned + SLACK, shown
    assert planned <= RATIO * measured + SLACK, shown


def test_an_entry_without_a_memory_declaration_fails_at_import():
    from ghosted_core.plan import PruningPlan
    from ghosted_core.recovery.operators import BoundaryStats, Fit, FitOptions, register_operator
    from ghosted_core.selection.criteria import Scoring, SelectionRequest, register_criterion

    with pytest.raises(TypeError):
        @register_criterion("undeclared", paper="-", needs="nothing", cost="-")
        def undeclared(request: SelectionRequest, scoring: Scoring) -> PruningPlan:
            return PruningPlan(request.num_layers, (), "undeclared")
    with pytest.raises(TypeError):
        @register_operator("undeclared", paper="-", description="-")
        def undeclared_fit(stats: BoundaryStats, opts: FitOptions) -> Fit:
            return Fit("undeclared", stats.boundary, "residual", None)
    assert "undeclared" not in CRITERIA and "undeclared" not in OPERATORS


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_the_score_phase_is_the_criterion_declaration(criterion):
    """The plan's score phase (CPU: host bytes beyond the weights) is what the criterion declares, nothing added."""
    import torch
    from transformers import LlamaConfig

    from ghosted_core.run.options import RunOptions, memory_plan
    from ghosted_core.selection.footprint import ScoreShapes

    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
                         vocab_size=512)
    options = RunOptions(model="x", criterion=criterion, num_prune=2, layers=(1, 2) if criterion == "manual" else (),
                         train_size=8, seqlen=64)
    plan = memory_plan(options, config, "cpu", torch.float32, boundaries=1, host_available=1 << 40)
    declared = CRITERIA[criterion].memory(ScoreShapes(config, 4, 8, 64, options.calibrate.batch_size, 2))
    assert plan.phases["score blocks"]["host"] - plan.weights_bytes == declared.bytes
    assert plan.score_note == declared.note
