"""Every criterion and every operator, run alone, peaks within its own memory declaration: measured ≤ planned ≤ 1.3×.

One random Llama (C = 1024, 4 blocks, I = 2816, 8,192-token vocabulary, fp32) is saved once per
session; each registry entry then runs in a process of its own (`memory_peaks.py`), its scoring
(a criterion) or its fit on one boundary's statistics (an operator), and its peak resident size
is held against what it declares. A new registry entry is measured here without a line added.
Every window starts with a token whose embedding is massive, so that
the fits see attention-sink rows as in real models. Two cases beside the registry: the down_proj refits at I = 2500 with 8 sink rows (synthetic
statistics) and sleb with a memo budget of 0 (every kept state but the embeddings recomputed).
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
SLACK = 8 * 2**20  # allocator, interpreter and LAPACK workspace noise, in bytes, on either side
RATIO = 1.3  # planned ≤ RATIO × measured

CASES = [("criterion", name, ()) for name in CRITERIA] + [("operator", name, ()) for name in OPERATORS] + [
    ("criterion", "sleb", ("--memo_budget", "0")),
    ("refit", "refit", ("--inner", "2500", "--sinks", "8")),
    ("refit", "magcomp_refit", ("--inner", "2500", "--sinks", "8")),
]
# declarations not yet confirmed on this 4-block model (issue 28 is open on them): reported, not yet required
UNSETTLED = {("criterion", "kl"), ("criterion", "swap_kl"), ("criterion", "swap_kl_repl"),
             ("operator", "replaceme_keepsink"), ("refit", "refit"), ("refit", "magcomp_refit")}
PARAMS = [pytest.param(*case, marks=pytest.mark.xfail(reason="declaration not yet settled (issue 28)", strict=False))
          if case[:2] in UNSETTLED else case for case in CASES]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The shared random C = 1024 model on disk (seeded), token 0's embedding 100× the others' (a massive
    activation at the first position of every window, so the sink-aware fits have all their candidates)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("memory_c1024")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, vocab_size=8192, tie_word_embeddings=True,
                         max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].mul_(100.0)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("kind, name, extra", PARAMS, ids=[f"{k}-{n}{'-' + '-'.join(e) if e else ''}" for k, n, e in CASES])
def test_declared_memory_holds_the_measured_peak(model_folder, kind, name, extra):
    folder = "-" if kind == "refit" else str(model_folder)
    done = subprocess.run([sys.executable, str(WORKER), folder, kind, name, *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    measured, planned = row["measured"], row["planned"]
    shown = f"{kind} {name}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"
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
