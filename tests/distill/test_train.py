"""One student's training: the schedule, a lower validation KL, the best state kept, early stop, Stop."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_tokens
from ghosted_core.distill.loss import distill_loss
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions
from ghosted_core.distill.targets import make_student
from ghosted_core.distill.teacher import build_teacher, validation_rows
from ghosted_core.distill.train import DistillReport, distill_student, learning_rate
from ghosted_core.model.surgery import slice_view
from ghosted_core.stopping import RunStopped
from students import PLAN, fitted, peaked_model


def test_cosine_schedule_runs_from_lr_to_its_floor():
    rates = [learning_rate(s, 10, 1e-3, 20.0) for s in range(10)]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-3 / 20)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert rates[5] == pytest.approx(1e-3 / 20 + (1e-3 - 1e-3 / 20) * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    warm = [learning_rate(s, 10, 1e-3, 20.0, warmup=3) for s in range(4)]
    assert warm[:3] == pytest.approx([2.5e-4, 5e-4, 7.5e-4]) and warm[3] == pytest.approx(1e-3)


@pytest.fixture(scope="module")
def setup():
    dense = peaked_model("gemma3", seed=1)
    cache = build_teacher(dense, random_tokens(16, 24, seed=7), random_tokens(4, 24, seed=8), kept=20,
                          prefix_blocks=[2], prefix_budget=2**30)
    return dense, cache


def _report(name: str, steps: int, lr: float, loss: str = "topk") -> DistillReport:
    return DistillReport(name, "ghost", OPERATOR_TARGET, "", False, 0, (), steps, 2, 24, lr, 20.0, 0, 0.0, 20, 97,
                         loss, "auto", "", "random tokens")


def _validation_kl(model, dense, cache, first_block: int, loss: str = "topk") -> float:
    """The validation KL recomputed from whole forwards of the model (not the training loop's prefix and suffix)."""
    total = count = 0
    for rows in validation_rows(cache, 2):
        with torch.no_grad():
            hidden = slice_view(model, dense, 0).model(input_ids=cache.val_ids[rows.start - 16:rows.stop - 16]) \
                .last_hidden_state
        log_probs, indices = cache.targets(rows)
        total += distill_loss(model, hidden, log_probs, indices, loss=loss) * hidden.shape[0] * hidden.shape[1]
        count += hidden.shape[0] * hidden.shape[1]
    return total / count


@pytest.mark.parametrize("loss", ["topk", "topk_tail"])
def test_distillation_lowers_validation_kl_keeps_the_best_and_leaves_the_dense_model(setup, loss):
    dense, cache = setup
    before = {n: p.clone() for n, p in dense.named_parameters()}
    variant = fitted(dense, "ghost")
    opts = DistillOptions(steps=8, lr=3e-3, eval_every=2, patience=0, loss=loss)
    student = make_student(variant, dense, PLAN, OPERATOR_TARGET, opts, {})
    report = _report("ghost+kd", 8, 3e-3, loss)
    snapshots = [len(r.val) for r in distill_student(student, dense, cache, opts, report)]
    assert snapshots[0] == 1 and snapshots[-1] == 5  # step 0, then every 2 steps, live
    assert report.steps == 8 and report.stopped == "budget" and report.prefix.startswith("dense states")
    assert report.best_val < report.start_val
    assert report.start_val == pytest.approx(_validation_kl(variant, dense, cache, student.first_block, loss), rel=1e-4)
    assert _validation_kl(student.model, dense, cache, student.first_block, loss) == \
        pytest.approx(report.best_val, rel=1e-4)
    assert all(torch.equal(before[n], p) for n, p in dense.named_parameters())


def test_a_distillation_that_only_gets_worse_returns_its_start(setup):
    dense, cache = setup
    variant = fitted(dense, "none")
    opts = DistillOptions(steps=6, lr=0.9, eval_every=1, patience=2)
    student = make_student(variant, dense, PLAN, "mlp", opts, {})
    start = [p.detach().clone() for p in student.parameters]
    report = _report("none+kd_mlp", 6, 0.9)
    for _ in distill_student(student, dense, cache, opts, report):
        pass
    assert report.best_step == 0 and report.stopped == "early stop" and report.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(start, student.parameters))


def test_stop_is_honoured_between_steps(setup):
    dense, cache = setup
    variant = fitted(dense, "ghost")
    opts = DistillOptions(steps=50, lr=1e-3)
    student = make_student(variant, dense, PLAN, OPERATOR_TARGET, opts, {})
    report = _report("ghost+kd", 50, 1e-3)
    calls = iter(range(100))
    with pytest.raises(RunStopped, match="distill"):
        for _ in distill_student(student, dense, cache, opts, report, should_stop=lambda: next(calls) >= 3):
            pass
    assert report.steps == 2
