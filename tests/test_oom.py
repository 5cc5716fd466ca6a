"""Out of memory: one message naming the settings to lower, what the stage held freed, and the next run succeeds.

The allocation failure is simulated by patching the calibration pass (a real one needs a
machine filled to the brim); the test that a real allocator failure is recognised runs the CLI
under a 3 GiB address-space limit.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import weakref

import pytest
import torch

from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.oom import guard_stages, is_out_of_memory
from ghosted_core.run import pipeline
from ghosted_core.run.options import RunOptions, parse_variants

FAILURES = [MemoryError(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
            RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory: you tried "
                         "to allocate 30000000000 bytes.")]


@pytest.mark.parametrize("failure", FAILURES, ids=["python", "cuda", "cpu"])
def test_an_allocation_failure_becomes_one_message_and_frees_the_stage(failure):
    held = []

    def stages():
        yield "load model", 1
        big = torch.zeros(1 << 20)  # what the failing stage holds (4 MiB)
        held.append(weakref.ref(big))
        raise failure

    with pytest.raises(GhostedError, match="out of memory after load model: what the run held is freed; try "
                                           "fewer or shorter calibration sequences .*--train_size") as caught:
        list(guard_stages(stages(), "load model"))
    assert caught.value.__context__ is None and caught.value.__cause__ is None  # the failure's frames are not kept
    gc.collect()
    assert held[0]() is None


def test_other_errors_pass_through_unchanged():
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("memory"))

    def stages():
        raise KeyError("a bug")
        yield

    with pytest.raises(KeyError):
        list(guard_stages(stages(), "load model"))


def test_a_run_that_runs_out_of_memory_names_the_way_out_and_the_next_run_succeeds(tiny_model_folder, monkeypatch):
    options = RunOptions(model=str(tiny_model_folder), num_prune=2, variants=parse_variants("none,ghost"),
                         calibration="ptb", train_size=4, seqlen=32, eval_corpora=("ptb",), eval_max_tokens=64,
                         quiet=True, calibrate=CalibrationOptions(quiet=True))
    real, held = pipeline.collect_stats, []

    def out_of_memory(*args, **kwargs):
        stats = real(*args, **kwargs)  # the pass ran: its statistics are what must be freed
        held.append(weakref.ref(stats[0]))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(pipeline, "collect_stats", out_of_memory)
    seen = []
    with pytest.raises(GhostedError, match="out of memory after score blocks") as caught:
        for stage, _ in pipeline.run_stages(options):
            seen.append(stage)
    assert seen == ["load model", "score blocks"] and "--seqlen" in str(caught.value)
    del caught
    gc.collect()
    assert held[0]() is None
    monkeypatch.setattr(pipeline, "collect_stats", real)
    assert pipeline.run(options).perplexity["ptb"]["ghost"] > 1


LIMITED = """
import resource, sys
from ghosted_core.cli import main
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_a_real_allocator_failure_under_a_memory_limit_is_one_line(tiny_model_folder, tmp_path):
    """The CLI under an address-space limit 3 GiB above what it has mapped: 1.8·10⁷ sink rows per boundary ask for ~10 GiB, which the memory plan lets through (the machine has it) but the limit does not."""
    with open(f"/proc/{os.getpid()}/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    limit = mapped + 3 * 2**30
    assert limit < resource.getrlimit(resource.RLIMIT_AS)[1] or resource.getrlimit(resource.RLIMIT_AS)[1] < 0
    done = subprocess.run([sys.executable, "-c", LIMITED, str(limit), "--model", str(tiny_model_folder),
                           "--total_num_prune", "2", "--insert_type", "none,ghost", "--calibration_data", "ptb",
                           "--train_size", "2", "--seqlen", "32", "--eval_ppl", "none", "--sink_capacity", "18000000",
                           "--outdir", str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    # (a machine with less than ~10 GiB free is refused by the memory plan instead, as it should be)
    assert lines[0].startswith("error: ") and ("out of memory after" in lines[0] and "--train_size" in lines[0]
                                              or "does not fit in memory" in lines[0]), lines[0]
