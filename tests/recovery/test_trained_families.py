"""Recovery still helps on the new kinds of block: a tiny mixture-of-experts and a tiny hybrid (linear attention)
model, trained here on PTB's bytes for a few hundred steps (random weights cannot show recovery), then cut: the
sink-aware ghost fit's held-out boundary error and its perplexity on PTB's validation text beat plain pruning's."""

from __future__ import annotations

import pytest
import torch

from conftest import _tiny_config
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.evaluation.perplexity import perplexity
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec

SEQLEN, STEPS, BATCH = 64, 300, 16


def byte_windows(split: str, count: int, seed: int) -> torch.Tensor:
    """`count` seeded windows of PTB's bytes (vocabulary 256): (count, SEQLEN)."""
    import treebank

    data = torch.tensor(list(treebank.penn["train" if split == "train" else "valid"].encode()[:400_000]))
    starts = torch.randint(0, len(data) - SEQLEN, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[s:s + SEQLEN] for s in starts.tolist()])


def trained(family: str):
    """The family's tiny model at a byte vocabulary, trained STEPS steps of next-byte prediction (AdamW)."""
    cls, config = _tiny_config(family, vocab_size=256)
    torch.manual_seed(0)
    model = cls(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = byte_windows("train", STEPS * BATCH, seed=1).view(STEPS, BATCH, SEQLEN)
    model.train()
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval().requires_grad_(False), float(loss.detach())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])  # experts; Gated DeltaNet among attention blocks
def test_ghost_capped_beats_plain_pruning_on_a_trained_model(family):
    torch.set_num_threads(1)
    model, last_loss = trained(family)
    assert last_loss < 3.0, last_loss  # it learned something (uniform over bytes: ln 256 = 5.5)
    calibration = byte_windows("train", 40, seed=2)
    batches = make_batches(calibration[:32], calibration[32:], 8)  # 2,048 fit tokens (≥ 4·C), 512 held out
    plan = PruningPlan(6, (2, 3), "manual")
    options = CalibrationOptions(quiet=True)
    stats = collect_stats(model, plan.boundaries, batches, options)
    fits = {name: [get_operator(name).fit(s, FitOptions()) for s in stats] for name in ("none", "ghost_capped")}
    errors = {name: measure_errors(model, found, batches, options)[0] for name, found in fits.items()}
    assert errors["none"].relative == pytest.approx(1.0)
    assert errors["ghost_capped"].relative < 0.9, errors["ghost_capped"]  # held-out tokens, not the fitted ones
    variants = {name: build_recovered(model, plan, VariantSpec(name, name), found) for name, found in fits.items()}
    ppl = perplexity(model, variants | {"dense": model}, byte_windows("valid", 16, seed=3), quiet=True)
    assert ppl["dense"] < ppl["ghost_capped"] < ppl["none"], ppl
