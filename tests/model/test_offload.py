"""`--device map`: a model larger than its memory cap, offloaded by accelerate, runs the pipeline exactly.

No GPU here, so the cap is on the CPU: accelerate's device_map="auto" with max_memory={"cpu": cap}
keeps what fits on the CPU and leaves the rest of the blocks on disk (their parameters sit on the
meta device and are read from the safetensors file during each forward). On a GPU machine the
same code path puts blocks on the GPU first; the maths does not change.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors import safe_open

from conftest import random_tokens
from ghosted_core.cli import main
from ghosted_core.export.folder import load_recovered
from ghosted_core.model.loading import LoadOptions, load_model, parse_max_memory
from ghosted_core.recovery.assessment import Diagnostics
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run

VARIANTS = "none,diag,rotate,ghost,ghost_capped,replaceme,ghost+seq"
REMOVED = (1, 3, 4)  # two boundaries, so the sequential fit runs through an offloaded upstream model


def cap_below_model(folder) -> tuple[int, int]:
    """(cap, model bytes): a CPU cap that holds the embeddings and about half of the blocks, not the whole model."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    nbytes = {k: 4 * int(torch.tensor(shape).prod()) for k, shape in sizes.items()}  # fp32
    total = sum(nbytes.values())
    embeddings = nbytes["model.embed_tokens.weight"]
    return embeddings + (total - embeddings) // 2, total


@pytest.fixture(scope="module")
def capped(tiny_model_folder, smollm2_tokenizer, tmp_path_factory):
    """The tiny Llama folder loaded under a CPU cap smaller than the model (the rest on disk)."""
    cap, total = cap_below_model(tiny_model_folder)
    options = LoadOptions(device="map", max_memory={"cpu": cap}, offload_folder=str(tmp_path_factory.mktemp("offload")))
    loaded = load_model(str(tiny_model_folder), options)
    return dataclasses.replace(loaded, tokenizer=smollm2_tokenizer), cap, total


def run_options(model: str) -> RunOptions:
    return RunOptions(model=model, criterion="manual", layers=REMOVED, variants=parse_variants(VARIANTS),
                      calibration="ptb", train_size=4, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=128,
                      quiet=True, diagnostics=Diagnostics())


def test_max_memory_flag_is_parsed_into_bytes():
    assert parse_max_memory("0=20GiB, cpu=1.5GB,disk=1000") == {0: 20 * 2**30, "cpu": 1_500_000_000, "disk": 1000}
    assert parse_max_memory("") is None and parse_max_memory(None) is None


def test_the_cap_really_offloads_part_of_the_model_to_disk(capped):
    loaded, cap, total = capped
    assert cap < total
    placed = loaded.model.hf_device_map
    assert set(placed.values()) == {"cpu", "disk"}, placed
    blocks = loaded.model.model.layers
    on_disk = [i for i, block in enumerate(blocks) if block.mlp.down_proj.weight.device.type == "meta"]
    assert 0 < len(on_disk) < len(blocks)  # some blocks' weights are not in memory at all


def test_device_map_under_a_memory_cap_runs_calibration_and_perplexity(capped, tiny_model_folder, smollm2_tokenizer):
    """Calibration, fits (independent and sequential), perplexity, drift and generation on the offloaded model
    equal those of the same model in memory."""
    loaded, _cap, _total = capped
    plain = dataclasses.replace(load_model(str(tiny_model_folder), LoadOptions(device="cpu")),
                                tokenizer=smollm2_tokenizer)
    options = dataclasses.replace(run_options(str(tiny_model_folder)), prompt="The market")
    offloaded, reference = run(options, loaded), run(options, plain)
    assert [b.start for b in offloaded.plan.boundaries] == [1, 3]
    for name, ppl in reference.perplexity["ptb"].items():
        assert offloaded.perplexity["ptb"][name] == pytest.approx(ppl, rel=1e-6), name
    for name, reports in reference.fits.items():
        for mine, theirs in zip(offloaded.fits[name], reports):
            assert mine.fit_error == pytest.approx(theirs.fit_error, rel=1e-6, abs=1e-9), name
            assert mine.heldout_error == pytest.approx(theirs.heldout_error, rel=1e-6, abs=1e-9), name
    assert offloaded.generations == reference.generations
    ids = random_tokens(2, 16, seed=8)
    for name, model in reference.models.items():
        with torch.no_grad():
            torch.testing.assert_close(offloaded.models[name](ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5,
                                       msg=name)


def test_cli_device_map_with_a_memory_cap_runs_calibration_perplexity_and_save(tiny_model_folder, smollm2_tokenizer,
                                                                               tmp_path, caplog):
    """Issue 9's acceptance, end to end through the flags: --device map --max_memory cpu=<less than the model>
    --offload_folder DIR runs calibration and perplexity as the in-memory run does, and --save_model writes
    every variant from the offload; each saved variant reloads with the in-memory variant's logits."""
    cap, total = cap_below_model(tiny_model_folder)
    common = ["--model", str(tiny_model_folder), "--pruning_method", "manual", "--layers", "1,3-4",
              "--insert_type", VARIANTS, "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
              "--eval_ppl", "ptb", "--eval_max_tokens", "128", "--quiet", "--diagnostics"]
    with caplog.at_level(logging.INFO, logger="ghosted_core.model.loading"):
        assert main([*common, "--device", "map", "--max_memory", f"cpu={cap}", "--offload_folder",
                     str(tmp_path / "offload"), "--outdir", str(tmp_path / "map"), "--save_model",
                     str(tmp_path / "saved")]) == 0
    assert cap < total and any("'disk'" in record.getMessage() for record in caplog.records)
    assert main([*common, "--device", "cpu", "--outdir", str(tmp_path / "cpu")]) == 0
    mapped, plain = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("map", "cpu"))
    assert mapped["boundaries"] == plain["boundaries"] == [[1, 2], [3, 5]]
    for name, entry in plain["variants"].items():
        assert mapped["variants"][name]["ppl"]["ptb"] == pytest.approx(entry["ppl"]["ptb"], rel=1e-6), name
        for mine, theirs in zip(mapped["variants"][name].get("boundary_error", []), entry.get("boundary_error", [])):
            assert mine["fit"] == pytest.approx(theirs["fit"], rel=1e-6, abs=1e-9), name

    in_memory = run(run_options(str(tiny_model_folder)),
                    dataclasses.replace(load_model(str(tiny_model_folder), LoadOptions(device="cpu")),
                                        tokenizer=smollm2_tokenizer))
    assert set(mapped["exports"]) == set(in_memory.models) - {"dense"}
    ids = random_tokens(2, 16, seed=8)
    for name, export in mapped["exports"].items():
        reloaded, _tokenizer = load_recovered(tmp_path / "saved" / name)
        assert not any(p.device.type == "meta" for p in reloaded.parameters()), name  # real weights, not the offload's
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, in_memory.models[name](ids).logits, rtol=1e-5,
                                       atol=1e-5, msg=f"{name} ({export['mode']})")


def test_blocks_pipeline_on_an_offloaded_model_gives_the_in_memory_statistics(capped, tiny_model_folder):
    """Block by block over accelerate-dispatched blocks (some read from disk): the recorded call
    arguments, the hooks' own onloading and the restored forwards give the in-memory fits."""
    from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
    from ghosted_core.recovery.operators import FitOptions, get_operator
    from ghosted_core.plan import Boundary

    loaded, _cap, _total = capped
    dense = load_model(str(tiny_model_folder), LoadOptions(device="cpu")).model
    batches = make_batches(random_tokens(4, 16), None, 2)
    boundaries = [Boundary(1, 2), Boundary(3, 5)]
    full = collect_stats(dense, boundaries, batches, CalibrationOptions(quiet=True, pipeline="full"))
    hooked = [vars(block).get("forward") for block in loaded.model.model.layers]  # accelerate's wrapped forwards
    blocks = collect_stats(loaded.model, boundaries, batches, CalibrationOptions(quiet=True, pipeline="blocks"))
    assert [vars(block).get("forward") for block in loaded.model.model.layers] == hooked
    for a, b in zip(full, blocks):
        for name in ("ghost", "ghost_capped", "replaceme"):
            fa, fb = get_operator(name).fit(a, FitOptions()).update, get_operator(name).fit(b, FitOptions()).update
            assert float((fa - fb).norm() / fa.norm()) < 1e-6, name
    with torch.no_grad():  # the dispatched model still computes as before (its hooked forwards were restored)
        torch.testing.assert_close(loaded.model(random_tokens(1, 8)).logits, dense(random_tokens(1, 8)).logits,
                                   rtol=1e-4, atol=1e-4)
