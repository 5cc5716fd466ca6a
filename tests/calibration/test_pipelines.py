"""Tests for ghosted_core.calibration.pipelines: the blocks pipeline leaves a shared model undisturbed."""

from __future__ import annotations

import threading

import torch

from conftest import make_tiny_model, random_tokens
from ghosted_core.calibration import pipelines
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.plan import Boundary
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.recovery.operators import FitOptions, get_operator
from ghosted_core.selection.similarity import measure_similarity

BLOCKS = CalibrationOptions(quiet=True, pipeline="blocks")
BOUNDARIES = [Boundary(1, 3), Boundary(4, 5)]


def _same_stats(a, b) -> bool:
    return all(x.tokens == y.tokens and torch.equal(x.ordinary.xtx, y.ordinary.xtx)
               and torch.equal(x.ordinary.mtd, y.ordinary.mtd) for x, y in zip(a, b))


def test_blocks_calibration_does_not_disturb_another_threads_forwards():
    """One thread calibrates with `blocks` (and measures held-out errors through it) again and again
    while this one runs plain forwards and `measure_similarity` on the same model: this thread's
    logits and cosines are bit-identical to a run alone, and so are the other thread's statistics."""
    model = make_tiny_model("gemma3")  # sliding and global layers: per-layer masks and rotary embeddings
    ids = random_tokens(4, 24, seed=3)
    batches = make_batches(random_tokens(6, 24, seed=1), random_tokens(2, 24, seed=2), 2)
    with torch.no_grad():
        logits_alone = model(input_ids=ids).logits
    cosines_alone = measure_similarity(model, 2, batches, quiet=True)
    stats_alone = collect_stats(model, BOUNDARIES, batches, BLOCKS)
    fit = get_operator("replaceme").fit(stats_alone[0], FitOptions())
    errors_alone = measure_errors(model, [fit], batches, BLOCKS)[0]

    started, done = threading.Event(), threading.Event()
    passes, failures = [], []

    def calibrate_again_and_again() -> None:
        try:
            while not done.is_set():
                started.set()
                stats = collect_stats(model, BOUNDARIES, batches, BLOCKS)
                errors = measure_errors(model, [fit], batches, BLOCKS)[0]
                passes.append(_same_stats(stats, stats_alone) and errors == errors_alone)
        except Exception as err:  # reported below, in the main thread
            failures.append(err)
            started.set()

    worker = threading.Thread(target=calibrate_again_and_again)
    worker.start()
    try:
        assert started.wait(30)
        for _ in range(40):
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, logits_alone)
            assert measure_similarity(model, 2, batches, quiet=True) == cosines_alone
    finally:
        done.set()
        worker.join(60)
    assert not failures, failures
    assert len(passes) >= 2 and all(passes), passes  # it ran while this thread did, and was itself undisturbed


def test_a_block_computed_elsewhere_runs_as_a_copy_and_the_shared_one_never_moves(monkeypatch):
    """As on a GPU with the weights on the CPU: each block runs as one copy, block after block, every batch
    through it; the shared block's weights stay where they are (same storage), and the statistics equal `full`'s."""
    model = make_tiny_model("gemma3")
    monkeypatch.setattr(pipelines, "_same_device", lambda a, b: False)  # every block counts as living elsewhere
    shared = {j: block.mlp for j, block in enumerate(model.model.layers)}
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    runs = []
    for j, block in enumerate(model.model.layers):
        block.mlp.register_forward_pre_hook(lambda module, _args, j=j: runs.append((j, id(module))))
    batches = make_batches(random_tokens(6, 16), None, 2)
    stats = collect_stats(model, [Boundary(2, 4)], batches, BLOCKS)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == storage
    assert [j for j, _ in runs] == [j for j in range(4) for _ in range(3)]  # blocks 0..3 in order, 3 batches each
    for j in range(4):
        copies = {module for k, module in runs if k == j}
        assert len(copies) == 1 and copies != {id(shared[j])}  # one copy per block, never the shared module
    for module in shared.values():
        module._forward_pre_hooks.clear()
    full = collect_stats(model, [Boundary(2, 4)], batches, CalibrationOptions(quiet=True))
    torch.testing.assert_close(stats[0].ordinary.xtd, full[0].ordinary.xtd, rtol=1e-10, atol=1e-10)


def test_host_copy_keeps_a_broadcast_mask_broadcast():
    mask = torch.rand(1, 1, 64, 64).lt(0.5).expand(8, 1, 64, 64)  # as Gemma-3's sliding mask arrives
    copy = pipelines.host_copy(mask)
    assert torch.equal(copy, mask) and copy.untyped_storage().nbytes() == 64 * 64
