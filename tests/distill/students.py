"""Helpers of the distillation tests: a tiny model whose next-token distributions are far from uniform, and its
fitted variants."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec

PLAN = PruningPlan(TINY_LAYERS, (2, 3), "manual")


def peaked_model(family: str, seed: int = 0):
    """A tiny random model with a sharpened LM head, so that the teacher's distribution (and every KL) matters."""
    model = make_tiny_model(family, seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def fitted(model, operator: str, plan: PruningPlan = PLAN):
    stats = collect_stats(model, plan.boundaries, make_batches(random_tokens(8, 24, seed=3), None, 4),
                          CalibrationOptions(quiet=True))
    fits = [get_operator(operator).fit(s, FitOptions()) for s in stats]
    variant = build_recovered(model, plan, VariantSpec(operator, operator), fits)
    return variant


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def peaked(request):
    return peaked_model(request.param)
