"""The app under faults: a client gone mid-run, out of memory, a model that fails to load halfway, a full disk."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
import zipfile
from concurrent.futures import ThreadPoolExecutor

import gradio as gr
import pytest
import torch

from ghosted_core.errors import GhostedError
from studio import cache, handlers, outputs
from studio.guard import LOCAL_MODELS_ENV
from studio.runs import RUNS

BASE = dict(criterion="streamline", depth=2, manual_blocks="", operators=["none", "ghost"], calibration="ptb",
            samples=2, seqlen=64, seed=0, eval_corpora=["ptb"], eval_tokens=256, prompt="", new_tokens=4,
            tasks_on=False, task_names=[], task_examples=5)

# A remote user: submits a run and prints each update's status line, until killed.
CLIENT = """
import sys
from gradio_client import Client
client = Client(sys.argv[1], verbose=False)
job = client.submit(api_name="/run", model=sys.argv[2], criterion="streamline", depth=2, samples=2, seqlen=64,
                    operators=["none", "diag", "rotate", "ghost", "ghost_capped", "replaceme"], calibration="ptb",
                    eval_corpora=["ptb", "wiki"], eval_tokens=16384, prompt="")
seen = 0
while not job.done():
    updates = job.outputs()
    for update in updates[seen:]:
        print(update[0].splitlines()[0], flush=True)
    seen = len(updates)
"""


def test_a_client_that_disconnects_mid_run_frees_its_slot_within_one_batch_and_the_next_run_starts(tiny_server):
    from gradio_client import Client

    stopped = []
    original_end = RUNS.end

    def end(run):  # when each run stops computing, and where
        stopped.append((time.perf_counter(), run.stopped_at, run.current))
        original_end(run)

    RUNS.end = end
    user = subprocess.Popen([sys.executable, "-c", CLIENT, tiny_server.url, tiny_server.model], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        for line in user.stdout:
            if "Running:** perplexity" in line:
                break
        time.sleep(0.5)  # well into the stage: 2 corpora × 64 batches × 7 variants
        following = Client(tiny_server.url, verbose=False).submit(api_name="/run", **tiny_server.run_kwargs(seed=3))
        time.sleep(0.5)
        assert RUNS.active() == 1 and not following.done()  # one slot: the next user waits
        killed = time.perf_counter()
        user.send_signal(signal.SIGKILL)
        result = following.result(timeout=120)
    finally:
        RUNS.end = original_end
        user.kill()
    first = stopped[0]
    assert first[1] == "perplexity"  # stopped inside the stage, at a batch, not at its end
    assert first[0] - killed < 2 + 3  # a heartbeat (2 s) to notice, then the next batch
    assert "Run complete" in result[0]


def test_out_of_memory_names_the_way_out_frees_what_the_run_held_and_the_next_run_succeeds(tiny_model_folder,
                                                                                           monkeypatch):
    from ghosted_core.run import pipeline

    real, held = pipeline.collect_stats, []

    def out_of_memory(*args, **kwargs):
        stats = real(*args, **kwargs)
        held.append(weakref.ref(stats[0]))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(pipeline, "collect_stats", out_of_memory)
    updates = []
    with pytest.raises(gr.Error) as caught:
        for update in handlers.on_run(model=str(tiny_model_folder), **BASE):
            updates.append(update)
    message = caught.value.message
    assert "out of memory after score blocks" in message and "'Sequences'" in message and "'Sequence length'" in message
    assert "Run failed" in dict(zip(outputs.OUTPUT_NAMES, updates[-1]))["status"] and RUNS.active() == 0
    del caught
    gc.collect()
    assert held[0]() is None  # the statistics the failed stage built are gone
    monkeypatch.setattr(pipeline, "collect_stats", real)
    final = dict(zip(outputs.OUTPUT_NAMES, list(handlers.on_run(model=str(tiny_model_folder), **BASE))[-1]))
    assert "Run complete" in final["status"]


def test_the_model_cache_recovers_when_a_load_fails_halfway(tiny_model_folder, tmp_path, monkeypatch):
    monkeypatch.setenv(LOCAL_MODELS_ENV, "1")  # the broken copy lives outside the tiny server's folder
    models = cache.ModelCache(capacity=2)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_folder, broken)
    weights = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    with pytest.raises(GhostedError, match="a weights file is damaged or incomplete"):
        models.get(str(broken))
    assert models.held() == 0  # no slot stays taken by the failed load
    (broken / "model.safetensors").write_bytes(weights)
    assert models.get(str(broken)).num_layers == 6 and models.held() == 1

    # Two users ask for one model; the first load dies halfway: the waiting user loads it, nobody hangs.
    release, attempts = threading.Event(), []

    def load(name, options=None):
        attempts.append(name)
        if len(attempts) == 1:
            assert release.wait(30)
            partial = torch.zeros(1 << 20)  # what it had read so far
            raise RuntimeError(f"connection reset after {partial.numel()} values")
        return f"model {name}"

    monkeypatch.setattr(cache, "load_model", load)
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(models.get, "other")
        time.sleep(0.2)
        second = pool.submit(models.get, "other")
        time.sleep(0.2)
        release.set()
        with pytest.raises(RuntimeError, match="connection reset"):
            first.result(timeout=30)
        assert second.result(timeout=30) == "model other"
    assert attempts == ["other", "other"] and models.held() == 2


def test_a_full_disk_while_zipping_the_download_is_one_message_and_leaves_no_file(tiny_model_folder, monkeypatch,
                                                                                  tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the run's own temporary folder goes here
    monkeypatch.setattr("tempfile.tempdir", None)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zipfile.ZipFile, "write", full)
    updates = []
    with pytest.raises(gr.Error, match="no room to write the zip") as caught:
        for update in handlers.on_run(model=str(tiny_model_folder), **BASE | {"save_variant": "ghost"}):
            updates.append(update)
    assert "Run failed** during save model" in dict(zip(outputs.OUTPUT_NAMES, updates[-1]))["status"]
    assert "nothing was left half-written" in caught.value.message
    assert not list(tmp_path.glob("ghosted-run-*"))  # the run's folder is gone, and with it any staged export
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".zip", ".partial", ".safetensors")]
