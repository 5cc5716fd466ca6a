"""The served app on the real SmolLM2 (slow): launched in-process on a free port and driven with gradio_client
as a remote user would: the default configuration at small sizes, bad input, Stop, distillation, concurrency."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

import app
from ghosted_core.report import tables
from studio import cache, layout, runs, settings
from studio.outputs import OUTPUT_NAMES  # the tests name their local results `outputs`

SMALL = dict(samples=8, seqlen=128, eval_tokens=256, new_tokens=8)  # the defaults otherwise


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def client(smollm2):
    """The app served in-process on a free port, with the session's SmolLM2 in its model cache."""
    from gradio_client import Client

    cache.MODELS.put(smollm2)
    port = free_port()
    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                    **layout.launch_options())
    try:
        # Stop returns once the stage computing at the time has finished (tens of seconds on a
        # busy 2-core machine): wait for it rather than time out at httpx's default 5 s.
        yield Client(f"http://127.0.0.1:{port}/", verbose=False, httpx_kwargs={"timeout": 300})
    finally:
        app.demo.close()


def run_kwargs(**changes) -> dict:
    """The page's defaults at small sizes, as keyword arguments of the /run endpoint."""
    return SMALL | changes


def plot_traces(output: dict) -> list[dict]:
    assert output["type"] == "plotly"
    return json.loads(output["plot"])["data"]


def plot_title(output: dict) -> str:
    return json.loads(output["plot"])["layout"]["title"]["text"]


@pytest.mark.slow
def test_default_run_streams_and_fills_every_output(client, all_threads):
    job = client.submit(api_name="/run", **run_kwargs(speed_on=True))  # the page's default (the suite turns it off)
    outputs = dict(zip(OUTPUT_NAMES, job.result(timeout=900)))
    streamed = [u for u in job.outputs() if "⏳" not in u[0]]  # one update per stage; progress inside one apart
    variants = ["dense", *settings.DEFAULTS.operators]

    # streaming: one update per stage; perplexity shows up before the generations do
    assert len(streamed) >= 8
    partial = dict(zip(OUTPUT_NAMES, streamed[5]))
    assert partial["ppl_table"]["data"] and "data-variant" not in partial["generations"]

    assert "Run complete" in outputs["status"] and "smollm2-135m" in outputs["status"]

    cards = dict(re.findall(r"data-variant='([^']+)'.*?<div class='gen-text'>(.*?)</div>", outputs["generations"]))
    assert list(cards) == variants and all(text.strip() and "(empty)" not in text for text in cards.values())

    assert "Stage times" in outputs["status"] and "Queued" not in outputs["status"]
    table = outputs["ppl_table"]
    assert [row[0] for row in table["data"]] == variants
    assert table["headers"][1:] == ["ptb (exact) ppl (254 tokens)", "ptb (exact) recovered", "wiki (stand-in) ppl (254 tokens)",
                                    "wiki (stand-in) recovered", tables.HELD_OUT_COLUMN, tables.SIZE_COLUMN,
                                    tables.SPEED_COLUMN]
    assert all(float(row[1]) > 1 and float(row[3]) > 1 for row in table["data"])
    sizes = {row[0]: row[-2] for row in table["data"]}
    speeds = {row[0]: re.findall(r"([0-9.]+)×", row[-1]) for row in table["data"]}
    assert sizes["dense"].endswith("MB · 1.00×") and speeds["dense"] == ["1.00", "1.00"]
    assert all(len(speeds[name]) == 2 and all(float(x) > 0 for x in speeds[name]) for name in variants)
    assert "remote code" in sizes["ghost"] and "remote code" not in sizes["magcomp_refit"]
    assert "median of 3 rounds" in outputs["ppl_caption"]
    tradeoff = plot_traces(outputs["tradeoff"])
    assert {t["name"] for t in tradeoff} >= {"dense", "Pareto front", *settings.DEFAULTS.operators}
    for text in ("PTB (valid split, exact)", "stand-in for WikiText-2", "smollm2-135m", "removed"):
        assert text in outputs["ppl_caption"]

    for name in ("scores", "errors", "drift", "structure"):
        traces = plot_traces(outputs[name])
        assert traces and all(trace.get("y") for trace in traces), name
        assert "smollm2-135m" in plot_title(outputs[name]) and "removed" in plot_title(outputs[name]), name
    error_variants = {t["name"] for t in plot_traces(outputs["errors"])}
    assert error_variants == set(settings.DEFAULTS.operators)

    report = json.loads(Path(outputs["results_file"]).read_text())
    assert len(report["removed_layers"]) == settings.DEFAULTS.depth
    assert list(report["variants"]) == variants
    for name, entry in report["variants"].items():
        assert set(entry["ppl"]) == {"ptb", "wiki"} and entry["generation"].strip(), name
        gain = entry["gain"]
        assert gain["weight_bytes"] > 0 and gain["prefill_tokens_per_s"]["median"] > 0, name
        assert gain["decode_tokens_per_s"]["median"] > 0 and gain["decode_vs_dense"] > 0, name
    dense = report["variants"]["dense"]["gain"]
    assert dense["size_vs_dense"] == dense["prefill_vs_dense"] == dense["decode_vs_dense"] == 1.0
    assert report["corpora"]["wiki"]["real"] is False and report["corpora"]["ptb"]["real"] is True


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    (dict(depth=30), "leaves none"),
    (dict(model="no-such-model"), "unknown model"),
    (dict(criterion="manual", manual_blocks="27-31"), "out of range"),
])
def test_bad_input_gives_a_clear_message(client, changes, message):
    from gradio_client.exceptions import ValidationError

    start = time.perf_counter()
    with pytest.raises(ValidationError, match=message) as caught:  # refused before it takes a place in the queue
        client.predict(api_name="/run", **run_kwargs(**changes))
    assert "--" not in str(caught.value)
    assert time.perf_counter() - start < 60  # refused before any model work


def wait_for_status(job, text: str, seconds: float = 600) -> None:
    """Until a streamed update's status contains `text`."""
    deadline = time.time() + seconds
    while not any(text in update[0] for update in job.outputs()) and time.time() < deadline:
        assert not job.done(), job.outputs()[-1][0] if job.outputs() else "no update"
        time.sleep(0.2)
    assert any(text in update[0] for update in job.outputs()), text


@pytest.mark.slow
def test_stop_during_perplexity_says_where_it_stopped_and_the_next_run_succeeds(client, all_threads):
    job = client.submit(api_name="/run", **run_kwargs(eval_tokens=2048))  # 4 batches of perplexity per corpus
    wait_for_status(job, "**Running:** perplexity")
    start = time.perf_counter()
    stopped, history, _csv = client.predict(api_name="/stop")  # waits up to STOP_WAIT_SECONDS for the run to stop
    assert any(str(row[3]).startswith("stopped during perplexity") for row in history["data"])  # in the session history
    assert "Run stopped** during perplexity" in stopped and "not computed: perplexity, drift, generate" in stopped
    final = job.result(timeout=120)
    assert time.perf_counter() - start < settings.STOP_WAIT_SECONDS  # at the next variant, not the stage's end
    assert "Run stopped** during perplexity" in final[0] and "finished stages (load model, score blocks" in final[0]
    assert "Running" not in final[0]

    outputs = dict(zip(OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(operators=["none", "ghost_capped"], eval_corpora=["ptb"], prompt=""))))
    assert "Run complete" in outputs["status"]
    assert [row[0] for row in outputs["ppl_table"]["data"]] == ["dense", "none", "ghost_capped"]
    assert "generation skipped" in outputs["generations"]


@pytest.mark.slow
def test_stop_mid_distillation_then_a_small_budget_reports_each_variant_before_and_after(client, all_threads):
    distilling = run_kwargs(operators=["none", "ghost_capped"], eval_corpora=["ptb"], prompt="", distill_on=True,
                            distill_train="both")
    job = client.submit(api_name="/run", **distilling | {"distill_steps": settings.DISTILL_STEPS[1]})
    wait_for_status(job, "**Running:** distill")
    start = time.perf_counter()
    stopped, history, _csv = client.predict(api_name="/stop")
    assert any(str(row[3]).startswith("stopped during distill") for row in history["data"])
    final = job.result(timeout=120)
    assert time.perf_counter() - start < settings.STOP_WAIT_SECONDS  # between two steps, not at the budget's end
    assert "Run stopped** during distill" in final[0] and "Running" not in final[0]

    outputs = dict(zip(OUTPUT_NAMES, client.predict(api_name="/run", **distilling | {"distill_steps": 3})))
    assert "Run complete" in outputs["status"]
    report = json.loads(Path(outputs["results_file"]).read_text())
    assert {"ghost_capped+kd", "ghost_capped+kd_mlp", "none+kd_mlp"} <= set(report["variants"])
    for name in ("ghost_capped+kd", "ghost_capped+kd_mlp", "none+kd_mlp"):
        entry = report["variants"][name]
        d = entry["distill"]
        assert d["steps"] == 3 and len(d["loss_curve"]) == 3 and d["val_curve"][0][0] == 0, name
        assert d["best_val"] <= d["start_val"] and d["stock"] == (d["base"] == "none"), name  # ghost stays remote code
        assert entry["ppl"]["ptb"] > 1 and report["variants"][d["base"]]["ppl"]["ptb"] > 1, name
    assert json.loads(outputs["distill_plot"]["plot"])["data"]


@pytest.mark.slow
def test_too_small_calibration_and_a_cut_through_the_last_block_are_flagged(client, all_threads):
    check = dict(model="smollm2-135m", criterion="streamline", depth=7, manual_blocks="", operators=["none", "ghost"],
                 samples=12, seqlen=256)
    assert client.predict(**check, api_name="/check") == ""
    assert "fewer than 2·C = 1152" in client.predict(**check | {"samples": 2}, api_name="/check")
    assert "reaches the last block (29)" in client.predict(**check | {"criterion": "manual", "manual_blocks": "25-29"},
                                                           api_name="/check")
    outputs = dict(zip(OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(criterion="manual", manual_blocks="25-29", samples=2, seqlen=256,
                                      operators=["none", "ghost"], eval_corpora=["ptb"], eval_tokens=256, prompt=""))))
    assert "Run complete" in outputs["status"]
    assert "reaches the last block (29)" in outputs["status"]
    assert "512 calibration tokens is fewer than 2·C = 1152" in outputs["status"]


# Loads an exported folder in a process that cannot import ghosted_core (the cwd is the folder's parent).
LOAD_EXPORT = """
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
assert importlib.util.find_spec("ghosted_core") is None
folder, remote = sys.argv[1], sys.argv[2] == "remote_code"
refused = None
if remote:
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        raise SystemExit("a remote_code folder loaded without trust_remote_code")
    except (ValueError, KeyError, OSError) as err:
        refused = type(err).__name__
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
    new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
print("RESULT", json.dumps({"layers": model.config.num_hidden_layers, "finite": bool(torch.isfinite(logits).all()),
                            "class": type(model).__name__, "new_tokens": len(new), "refused": refused}))
"""


def load_in_fresh_process(archive: Path, mode: str, where: Path) -> dict:
    """Unzip the app's download and load it with plain transformers in a new process without ghosted_core."""
    import subprocess
    import sys
    import zipfile

    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(where)
    folder = where / archive.stem
    done = subprocess.run([sys.executable, "-c", LOAD_EXPORT, str(folder), mode], cwd=where, capture_output=True,
                          stdin=subprocess.DEVNULL, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(where)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1].strip().splitlines()[0])


@pytest.mark.slow
@pytest.mark.parametrize("variant, mode", [("replaceme", "stock"), ("ghost_capped", "remote_code")])
def test_the_saved_model_loads_in_plain_transformers_as_stock_or_with_remote_code(client, tmp_path, variant, mode,
                                                                                    all_threads):
    outputs = dict(zip(OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(operators=["none", variant], eval_corpora=["ptb"], prompt="", save_variant=variant))))
    assert "Run complete" in outputs["status"] and f"**{mode}**" in outputs["save_note"]
    archive = Path(outputs["model_file"])
    assert archive.name == f"smollm2-135m-{variant}.zip"
    loaded = load_in_fresh_process(archive, mode, tmp_path)
    assert loaded["layers"] == 30 - settings.DEFAULTS.depth and loaded["finite"] and loaded["new_tokens"] == 6
    if mode == "stock":
        assert loaded["class"] == "LlamaForCausalLM" and loaded["refused"] is None
    else:  # plain transformers refuses it loudly; with remote code it is the Ghosted subclass
        assert loaded["class"] == "GhostedLlamaForCausalLM" and loaded["refused"] == "ValueError"


@pytest.mark.slow
def test_a_sweep_of_five_depths_streams_its_curve_and_table(client, all_threads):
    # default operators at the small sizes: the curve, table and streaming are checked here; the default calibration's
    # five-depth sweep is the command line's (tests/test_cli.py)
    job = client.submit(api_name="/run", **run_kwargs(mode="sweep", depths="2:10:2", eval_corpora=["ptb"]))
    outputs = dict(zip(OUTPUT_NAMES, job.result(timeout=1800)))
    assert "Run complete" in outputs["status"]
    operators = list(settings.DEFAULTS.operators)
    curve = plot_traces(outputs["curve"])
    lines = {t["legendgroup"]: t for t in curve if not t["legendgroup"].startswith("corpus")}  # ptb only here
    assert set(lines) == {"dense", *operators}
    assert all(lines[name]["x"] == [2, 4, 6, 8, 10] and all(y > 1 for y in lines[name]["y"]) for name in operators)
    assert json.loads(outputs["curve"]["plot"])["layout"]["yaxis"]["type"] == "log"
    recovered = {t["legendgroup"] for t in plot_traces(outputs["recovered"]) if not t["legendgroup"].startswith("corpus")}
    assert recovered == set(operators) - {"none"}
    rows = outputs["sweep_table"]["data"]
    assert [(row[0], row[2]) for row in rows] == [(n, name) for n in (2, 4, 6, 8, 10) for name in operators]
    points = [len(json.loads(update[OUTPUT_NAMES.index("curve")]["plot"])["data"][1].get("x", []))
              for update in job.outputs() if "plot" in (update[OUTPUT_NAMES.index("curve")] or {})  # progress: no plot
              and json.loads(update[OUTPUT_NAMES.index("curve")]["plot"])["data"]]
    assert points[:5] == [1, 2, 3, 4, 5]  # the curve grew depth by depth
    report = json.loads(Path(outputs["results_file"]).read_text())
    assert report["sweep"]["statistics"]["calibration_passes"] == 1 and len(report["sweep"]["results"]) == 5
    front = [t for t in plot_traces(outputs["sweep_tradeoff"]) if t["name"] == "Pareto front"]
    assert len(front) == 1 and front[0]["text"][-1] == "dense"  # sizes only: the suite does not time speed


@pytest.mark.slow
def test_four_bad_uploads_each_get_a_message_and_then_your_text_calibrates_and_evaluates(client, tmp_path, all_threads):
    from gradio_client import handle_file
    from gradio_client.exceptions import AppError, ValidationError

    from ghosted_core.data import corpora

    bad = {"empty.txt": (b"", "is empty"), "binary.txt": (bytes(range(256)) * 64, "not UTF-8 text"),
           "short.txt": (b"Far too short to calibrate on.", "your text"),
           "huge.txt": (b"word " * (1_100_000), "exceeds the maximum file size")}  # refused before it uploads
    for name, (content, message) in bad.items():
        path = tmp_path / name
        path.write_bytes(content)
        # refused before it uploads (huge), before it queues (a text no run can read), or once tokenized (too short)
        with pytest.raises(ValueError if name == "huge.txt" else (ValidationError, AppError), match=message):
            client.predict(api_name="/run", **run_kwargs(your_file=handle_file(str(path)), text_use="both",
                                                         eval_corpora=["ptb"], prompt=""))
    good = tmp_path / "mine.txt"
    good.write_text(corpora.load_corpus("books", "evaluation").text[:60_000])
    outputs = dict(zip(OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(your_file=handle_file(str(good)), text_use="both", operators=["none", "ghost"],
                                      eval_corpora=["ptb"], prompt=""))))
    assert "Run complete" in outputs["status"]
    assert any(header.startswith("your text ppl (") for header in outputs["ppl_table"]["headers"])
    report = json.loads(Path(outputs["results_file"]).read_text())
    assert report["calibration"]["corpus"] == "your text" and "your text" in report["variants"]["ghost"]["ppl"]
    assert "disjoint" in report["corpora"]["your text"]["label"] and "mine.txt" in report["corpora"]["your text"]["label"]


@pytest.mark.slow
def test_quick_tasks_fill_the_table_and_chart(client, all_threads):
    outputs = dict(zip(OUTPUT_NAMES, client.predict(
        api_name="/run", **run_kwargs(operators=["none", "ghost"], eval_corpora=["ptb"], prompt="", tasks_on=True,
                                      task_names=["copa", "arc_easy"], task_examples=5))))
    table = outputs["tasks_table"]
    assert [row[0] for row in table["data"]] == ["dense", "none", "ghost"]
    assert any("copa" in h for h in table["headers"]) and any("mean" in h for h in table["headers"])
    bars = {t["name"]: t["y"] for t in plot_traces(outputs["tasks_plot"]) if t["type"] == "bar"}
    assert set(bars) == {"dense", "none", "ghost"} and all(0 <= y <= 1 for ys in bars.values() for y in ys)
    report = json.loads(Path(outputs["results_file"]).read_text())
    assert report["variants"]["ghost"]["tasks"]["scores"][0]["n"] == 5
    assert "5 examples per task" in outputs["tasks_caption"]


@pytest.mark.slow
def test_model_change_bounds_the_depth_and_explains_unknown_models(client):
    note, depth, blocks = client.predict("no-such-model", api_name="/model_info")
    assert "unknown model" in note
    start = time.perf_counter()
    note, depth, blocks = client.predict("gemma3-270m", api_name="/model_info")
    assert "18 decoder blocks" in note and (depth["maximum"], depth["value"]) == (18, 4)
    note, depth, blocks = client.predict("smollm2-135m", api_name="/model_info")
    assert "30 decoder blocks" in note and (depth["maximum"], depth["value"]) == (30, 7)
    assert time.perf_counter() - start < 10  # no weights loaded, nothing converted


@pytest.fixture(scope="module")
def concurrent_client(smollm2):
    """A second server whose page lets two runs compute at once (as GHOSTED_APP_CONCURRENCY=2 does)."""
    from gradio_client import Client

    cache.MODELS.put(smollm2)
    demo = layout.build_demo(concurrency=2)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **layout.launch_options())
    try:
        yield lambda: Client(f"http://127.0.0.1:{port}/", verbose=False, httpx_kwargs={"timeout": 300})
    finally:
        demo.close()


def run_summary(outputs: tuple) -> dict:
    """What two runs must agree on: perplexities, generations, removed blocks, fits and boundary errors."""
    named = dict(zip(OUTPUT_NAMES, outputs))
    report = json.loads(Path(named["results_file"]).read_text())
    return {"status": "Run complete" in named["status"], "ppl": named["ppl_table"]["data"],
            "generations": named["generations"], "removed": report["removed_layers"],
            "variants": {name: {k: v for k, v in entry.items() if k != "tasks"} for name, entry in report["variants"].items()}}


@pytest.mark.slow
def test_two_concurrent_runs_equal_the_same_runs_one_after_the_other(concurrent_client, all_threads):
    first = run_kwargs(operators=["none", "ghost_capped"], eval_corpora=["ptb"])
    second = run_kwargs(seed=1, criterion="shortgpt", depth=5, operators=["none", "ghost", "diag"],
                        eval_corpora=["wiki"], prompt="The capital of France is")
    alone_client = concurrent_client()
    alone = [run_summary(alone_client.predict(api_name="/run", **kwargs)) for kwargs in (first, second)]
    jobs = [concurrent_client().submit(api_name="/run", **kwargs) for kwargs in (first, second)]
    overlap = 0
    while not all(job.done() for job in jobs):
        overlap = max(overlap, runs.RUNS.active())
        time.sleep(0.1)
    together = [run_summary(job.result()) for job in jobs]
    assert overlap == 2  # both computed at once
    assert together == alone and alone[0]["status"] and alone[0] != alone[1]
