"""What each distillation target trains: only copies or low-rank changes, never the dense weights; declared sizes."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions
from ghosted_core.distill.targets import TRAINABLES, CutSites, RotatedScale, finalize, get_trainable, lora_blocks, \
    make_student
from ghosted_core.errors import GhostedError
from ghosted_core.recovery.operators import get_operator
from students import PLAN, fitted, peaked  # noqa: F401 (a fixture)

OPERATORS_TRIED = ["ghost", "diag", "rotate", "magcomp_refit", "replaceme", "none", "magcomp"]


def _shares(tensor: torch.Tensor, dense) -> bool:
    return any(tensor.data_ptr() == p.data_ptr() for p in dense.parameters())


@pytest.mark.parametrize("target", list(TRAINABLES))
@pytest.mark.parametrize("operator", OPERATORS_TRIED)
def test_students_start_where_their_variant_is_and_train_no_dense_tensor(peaked, operator, target):
    variant = fitted(peaked, operator)
    opts = DistillOptions()
    try:
        student = make_student(variant, peaked, PLAN, target, opts, {"operator": operator})
    except GhostedError as err:
        assert target == OPERATOR_TARGET and operator in ("none", "magcomp") or \
            operator == "magcomp_refit" and peaked.config.model_type == "gemma3_text", err  # no refit on Gemma-3
        return
    assert student.parameters and all(p.requires_grad for p in student.parameters)
    assert not any(_shares(p, peaked) for p in student.parameters)
    trainable = {id(p) for p in student.parameters}
    assert all(not p.requires_grad for p in student.model.parameters() if id(p) not in trainable)
    ids = random_tokens(2, 12, seed=5)
    with torch.no_grad():
        assert torch.allclose(student.model(ids).logits, variant(ids).logits, atol=1e-4, rtol=1e-4)
    declared = get_trainable(target).parameters(peaked.config, len(PLAN.boundaries), opts,
                                                get_operator(operator).cost.kept)
    assert declared >= student.count  # the memory plan never counts fewer than what trains
    if target in ("mlp", "down") or target == OPERATOR_TARGET and operator in ("ghost", "diag", "rotate"):
        assert declared == student.count


def test_rotate_trains_its_scale_in_the_hadamard_basis(peaked):
    """LinearPatch-R's structure is kept: D trains, W = H D Hᵀ stays symmetric with Hᵀ W H diagonal."""
    variant = fitted(peaked, "rotate")
    student = make_student(variant, peaked, PLAN, OPERATOR_TARGET, DistillOptions(), {})
    (module,) = [m for m in student.model.modules() if isinstance(m, RotatedScale)]
    assert student.count == peaked.config.hidden_size
    with torch.no_grad():
        module.scale.mul_(torch.linspace(0.5, 1.5, module.scale.numel()))
    model = finalize(student, torch.float32)
    (weight,) = [m.weight for name, m in model.named_modules() if type(m).__name__ == "ResidualLinear"]
    h = module.rotation.double()
    inner = h.T @ weight.double() @ h
    assert torch.allclose(weight, weight.T, atol=1e-5)
    assert torch.allclose(inner - torch.diag(torch.diagonal(inner)), torch.zeros_like(inner), atol=1e-5)
    assert torch.allclose(torch.diagonal(inner), module.scale.double(), atol=1e-5)


def test_lora_blocks_sit_on_both_sides_of_each_cut():
    sites = CutSites((3, None, 9), (4, 0, None), 12)
    assert lora_blocks(sites, 2) == [0, 1, 2, 3, 4, 5, 8, 9]
    assert lora_blocks(sites, 0) == list(range(12))


def test_lora_wraps_the_plain_projections_and_not_a_router_that_subclasses_linear():
    """Llama-4's router is an nn.Linear subclass returning (scores, logits): a rank-r change wraps only the plain
    projections around it (it crashed the forward before); the student starts where the variant is, and the
    declared count is exactly what trains."""
    from conftest import make_tiny_model
    from ghosted_core.plan import PruningPlan

    from students import fitted as fit

    model = make_tiny_model("llama4_text")
    plan = PruningPlan(6, (2,), "manual")
    variant = fit(model, "none", plan)
    opts = DistillOptions()
    student = make_student(variant, model, plan, "lora", opts, {"operator": "none"})
    wrapped = set(student.paths)
    assert wrapped and not any(path.endswith("router") for path in wrapped)
    assert any(path.endswith("feed_forward.shared_expert.down_proj") for path in wrapped)
    ids = random_tokens(2, 12, seed=5)
    with torch.no_grad():
        assert torch.allclose(student.model(ids).logits, variant(ids).logits, atol=1e-5, rtol=1e-5)
    assert get_trainable("lora").parameters(model.config, 1, opts, "") >= student.count


def test_a_cut_at_block_zero_has_no_block_before_it(tiny_llama):
    from ghosted_core.plan import PruningPlan

    plan = PruningPlan(6, (0, 1), "manual")
    variant = fitted(tiny_llama, "none", plan)
    with pytest.raises(GhostedError, match="block s−1"):
        make_student(variant, tiny_llama, plan, "mlp", DistillOptions(), {})
    assert make_student(variant, tiny_llama, plan, "lora", DistillOptions(), {}).first_block == 0


@pytest.mark.parametrize("target", list(TRAINABLES))
def test_after_distillation_only_the_chosen_weights_changed(peaked, target):
    """A few steps, then the finished model: every tensor outside the trained modules is bit-identical to its
    start's, the start itself and the dense model are untouched; the trained modules moved while training, and
    the finished model holds them moved unless no step beat the start (the best state is kept)."""
    from ghosted_core.distill.teacher import build_teacher
    from ghosted_core.distill.train import DistillReport, distill_student

    variant = fitted(peaked, "ghost")
    start = {name: t.clone() for name, t in variant.state_dict().items()}
    dense_before = {name: t.clone() for name, t in peaked.state_dict().items()}
    opts = DistillOptions(steps=4, lr=1e-3, eval_every=1, patience=0)
    try:
        student = make_student(variant, peaked, PLAN, target, opts, {})
    except GhostedError as err:  # a target this family lacks (e.g. no post-feedforward norm outside Gemma-3)
        assert target == "norm" and peaked.config.model_type != "gemma3_text", err
        return
    cache = build_teacher(peaked, random_tokens(6, 16, seed=7), random_tokens(2, 16, seed=8), kept=20,
                          prefix_blocks=[student.first_block], prefix_budget=2**30)
    report = DistillReport(f"ghost+{target}", "ghost", target, "", False, student.count, student.paths, 4, 2, 16,
                           1e-3, 20.0, 0, 0.0, 20, peaked.config.vocab_size, "topk", "auto", "", "random tokens")
    initial = [p.detach().clone() for p in student.parameters]
    moved_while_training = False
    for _ in distill_student(student, peaked, cache, opts, report):
        moved_while_training |= any(not torch.equal(p, q) for p, q in zip(student.parameters, initial))
    assert moved_while_training
    model = finalize(student, peaked.dtype).state_dict()
    trained = lambda name: any(name.startswith(path + ".") for path in student.paths)  # noqa: E731
    assert all(torch.equal(model[name], tensor) for name, tensor in start.items() if not trained(name))
    assert all(torch.equal(variant.state_dict()[name], tensor) for name, tensor in start.items())
    assert all(torch.equal(peaked.state_dict()[name], tensor) for name, tensor in dense_before.items())
    moved = [name for name in model if trained(name) and (not torch.equal(model[name], start[name]) if name in start
                                                          else name.endswith("lora_b") and bool(model[name].any()))]
    assert bool(moved) == (report.best_step > 0), report.val  # the best state kept: the start where nothing helped
