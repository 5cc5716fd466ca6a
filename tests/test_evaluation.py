"""Evaluation: prefix-shared perplexity equals the plain computation; drift and generation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import TINY_LAYERS, random_tokens
from ghosted_core.calibration import CalibrationOptions, capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation import GenerationOptions, block_drift, generate, perplexity, shared_prefix
from ghosted_core.plan import PruningPlan
from ghosted_core.surgery import build_variant
from test_surgery import recovered_variants


def plain_perplexity(model, windows: torch.Tensor) -> float:
    """transformers' own loss, window by window, as an independent reference."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            loss = model(ids[None], labels=ids[None], use_cache=False).loss
            total += float(loss) * (len(ids) - 1)
            count += len(ids) - 1
    return math.exp(total / count)


def test_perplexity_with_shared_prefix_equals_plain(tiny_model):
    plan, variants = recovered_variants(tiny_model, (2, 3, 5))
    models = {"dense": tiny_model, **variants}
    windows = random_tokens(5, 12, seed=4)
    got = perplexity(tiny_model, models, windows, batch_size=2, quiet=True)
    for name, model in models.items():
        assert got[name] == pytest.approx(plain_perplexity(model, windows), rel=1e-5), name


def test_shared_prefix_counts_identical_leading_blocks(tiny_llama):
    assert shared_prefix(tiny_llama, tiny_llama) == TINY_LAYERS
    assert shared_prefix(tiny_llama, build_variant(tiny_llama, (3, 4))) == 3
    _plan, variants = recovered_variants(tiny_llama, (3, 4))
    assert shared_prefix(tiny_llama, variants["replaceme"]) == 2  # block 2's down projection is folded


def test_perplexity_needs_two_tokens(tiny_llama):
    with pytest.raises(GhostedError):
        perplexity(tiny_llama, {"dense": tiny_llama}, random_tokens(2, 1), quiet=True)


def test_block_drift_against_direct_computation(tiny_llama):
    plan = PruningPlan(TINY_LAYERS, (2, 3), "manual")
    pruned = build_variant(tiny_llama, plan.removed)
    ids = random_tokens(2, 10)
    drift = block_drift(tiny_llama, {"none": pruned}, plan, ids, CalibrationOptions(sink_rule="none"))["none"]
    assert drift.blocks == (4, 5, 6)
    with capture(tiny_llama, [2, 4]) as seen:
        run_forward(tiny_llama, ids)
    h_start, h_end = seen[("residual", 2)].double(), seen[("residual", 4)].double()
    assert drift.error[0] == pytest.approx(float((h_start - h_end).norm() / h_end.norm()), rel=1e-6)
    assert drift.error == drift.error_ordinary  # no sinks flagged with sink_rule="none"
    same = block_drift(tiny_llama, {"dense": tiny_llama}, plan, ids)["dense"]
    assert np.allclose(same.error, 0.0)


def test_generation_is_seeded_and_matches_transformers(tiny_llama):
    class Tokenizer:  # the smallest tokenizer generate() needs: digits as token ids
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, text, return_tensors="pt"):
            ids = torch.tensor([[int(t) for t in text.split()]])
            return type("Encoded", (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(int(i)) for i in ids)

    tokenizer = Tokenizer()
    models = {"dense": tiny_llama, "none": build_variant(tiny_llama, (2, 3))}
    greedy = generate(models, tokenizer, "5 17 23 4", GenerationOptions(max_new_tokens=6))
    with torch.no_grad():
        reference = tiny_llama.generate(torch.tensor([[5, 17, 23, 4]]), max_new_tokens=6, do_sample=False,
                                        pad_token_id=0)
    assert greedy["dense"] == tokenizer.decode(reference[0, 4:])
    sampled = GenerationOptions(max_new_tokens=8, do_sample=True, seed=3, temperature=1.0, top_p=1.0)
    first = generate(models, tokenizer, "5 17 23 4", sampled)
    assert first == generate(models, tokenizer, "5 17 23 4", sampled)
    with pytest.raises(GhostedError):
        generate(models, tokenizer, "   ")
