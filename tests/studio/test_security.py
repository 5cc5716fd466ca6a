"""A public server's security: text escaped in every page output, local folders as the operator says, no remote code,
uploads bounded by the server, a canary from an upload found nowhere once its session ends, a session's files gone
with the session."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import time
from pathlib import Path

import gradio as gr
import httpx
import pytest

from ghosted_core.data import corpora
from ghosted_core.data.assets import cache_dir
from ghosted_core.data.user_text import MAX_BYTES
from ghosted_core.errors import GhostedError
from ghosted_core.model import loading
from ghosted_core.report.sweep import write_sweep_html
from studio import cache, guard, handlers, outputs
from studio.guard import LOCAL_MODELS_ENV
from studio.session_files import DELETE_CACHE, SESSION_FILES

ROOT = Path(__file__).resolve().parents[2]
XSS = "<script>window.__xss = 1</script><img src=x onerror=\"window.__xss = 2\">"
FOLDER_XSS = "<img src=x onerror=window.__xss=3>"  # a folder name may hold all of it but '/'


def hostile_model(tiny_model_folder) -> Path:
    """A model folder named like an HTML attack, inside the folder the server opens (its files linked, not copied)."""
    folder = Path(tiny_model_folder) / FOLDER_XSS
    if not folder.exists():
        folder.mkdir()
        for file in Path(tiny_model_folder).iterdir():
            if file.is_file():
                (folder / file.name).symlink_to(file)
    return folder


def run_outputs(**changes) -> list[tuple]:
    """Every update one press of Run yields (on_run called as Gradio would), the values in OUTPUT_NAMES order."""
    values = dict(criterion="streamline", depth=2, manual_blocks="", operators=["none", "ghost"], calibration="ptb",
                  samples=2, seqlen=64, seed=0, eval_corpora=["ptb"], eval_tokens=256, prompt="", new_tokens=4,
                  tasks_on=False, task_names=[], task_examples=5) | changes
    return list(handlers.on_run(**values))


def text_of(value) -> str:
    """What the page receives for one output, as text: markdown, HTML, a figure's JSON, a table's cells."""
    if hasattr(value, "to_plotly_json"):
        return value.to_json()
    if hasattr(value, "to_csv"):
        return value.to_csv()
    return value if isinstance(value, str) else json.dumps(value, default=str)


def test_model_and_user_text_are_escaped_in_every_page_output(tiny_model_folder, monkeypatch):
    from ghosted_core.run import pipeline

    monkeypatch.setenv(LOCAL_MODELS_ENV, str(tiny_model_folder))
    monkeypatch.setattr(pipeline, "generate", lambda models, *args, **kwargs: {name: f"{XSS} from {name}" for name in models})
    model = str(hostile_model(tiny_model_folder))
    text = (f"{XSS}\n\n" + corpora.load_corpus("books", "evaluation").text[:20_000])
    updates = run_outputs(model=model, prompt=f"Once {XSS}", your_text=text, text_use="both")
    final = dict(zip(outputs.OUTPUT_NAMES, updates[-1]))
    assert "Run complete" in final["status"] and "&lt;img src=x onerror=window.__xss=3&gt;" in final["status"]
    assert "&lt;script&gt;" in final["generations"] and "from ghost" in final["generations"]
    for update in updates:
        for name, value in zip(outputs.OUTPUT_NAMES, update):
            if name in ("results_file", "model_file", "history_file") or isinstance(value, dict) and value.get("__type__"):
                continue  # files are downloads, not page content; gr.skip() placeholders
            if hasattr(value, "to_csv"):
                continue  # a table's "str" cells are shown as text by Gradio's Dataframe (the browser test checks it)
            shown = text_of(value)
            assert not re.search(r"<(script|img)\b", shown, re.I), (name, shown[:300])
    with pytest.raises(gr.Error) as refused:  # a refusal quotes what was typed: escaped too
        run_outputs(model=f"nowhere/{FOLDER_XSS}")
    assert "<img" not in refused.value.message and "&lt;img" in refused.value.message


def test_the_sweep_page_escapes_the_model_name(tmp_path):
    report = {"model": f"/models/{FOLDER_XSS}", "num_layers": 6, "criterion": "streamline",
              "calibration": {"label": f"your text ({FOLDER_XSS}.txt, 10 characters)", "sequences": 2, "seqlen": 64},
              "corpora": {"ptb": {"label": "PTB", "real": True, "tokens": 256, "windows": 4}}, "timings": {},
              "sweep": {"depths": [1], "variants": ["none"], "dense": {"ppl": {"ptb": 10.0}},
                        "results": [{"n": 1, "removed_layers": [3], "variants": {
                            "none": {"ppl": {"ptb": 12.0}, "recovered": {"ptb": 0.0}, "boundary_error": []}}}]}}
    page = write_sweep_html(report, tmp_path / "sweep.html").read_text()
    assert FOLDER_XSS not in page and "&lt;img src=x onerror=window.__xss=3&gt;" in page


def test_local_folders_are_off_unless_the_operator_turns_them_on(tiny_model_folder, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a folder was looked up while local folders are off")

    monkeypatch.delenv(LOCAL_MODELS_ENV, raising=False)
    assert "**off**" in handlers.model_note("") and "a local folder" not in handlers.model_note("")
    monkeypatch.setattr(cache, "peek_config", never)
    note, _, _ = handlers.on_model_change(str(tiny_model_folder))
    assert "local model folders are off on this server" in note
    with pytest.raises(gr.Error, match="local model folders are off"):
        run_outputs(model=str(tiny_model_folder))
    monkeypatch.undo()
    monkeypatch.delenv(LOCAL_MODELS_ENV, raising=False)
    os.chdir(ROOT)  # 'tests/studio' is a folder here and reads as a Hub id: with folders off, the disk is not asked
    with pytest.raises(GhostedError, match="looks like a Hugging Face Hub id"):
        cache.model_shape("tests/studio")
    monkeypatch.setenv(LOCAL_MODELS_ENV, "1")
    assert "**on**" in handlers.model_note("")
    with pytest.raises(GhostedError, match="folder without config.json"):
        cache.model_shape("tests/studio")
    assert cache.model_shape(str(tiny_model_folder)) == (6, 36)
    monkeypatch.setenv(LOCAL_MODELS_ENV, str(tiny_model_folder))  # a folder: only the model folders inside it
    assert cache.model_shape(str(tiny_model_folder)) == (6, 36) and f"`{tiny_model_folder}`" in guard.local_folders_note()
    with pytest.raises(GhostedError, match="outside the folder this server opens"):
        guard.model_name(str(Path(tiny_model_folder).parent))
    assert "GHOSTED_APP_LOCAL_MODELS=$${GHOSTED_APP_LOCAL_MODELS-1}" in (ROOT / "Makefile").read_text()  # make app: on
    assert LOCAL_MODELS_ENV not in (ROOT / "Dockerfile").read_text()  # the image (and a Space): off


def test_remote_code_is_never_run_for_any_model_id(tiny_model_folder, monkeypatch):
    calls = []

    def recorder(original):
        def from_pretrained(*args, **kwargs):
            calls.append(kwargs.get("trust_remote_code"))
            if not Path(str(args[0])).exists():  # a Hub id: answer as a missing repository would
                raise OSError(f"{args[0]} is not a local folder and is not a valid model identifier")
            return original(*args, **kwargs)
        return from_pretrained

    for auto in (loading.AutoConfig, loading.AutoModelForCausalLM, loading.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", recorder(auto.from_pretrained))
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout=3.0: True)
    loading.load_model(str(tiny_model_folder))
    loading.peek_config("smollm2-135m")
    for hub_id in ("some-org/custom-model", "Qwen/Qwen2.5-0.5B", "deepseek-ai/DeepSeek-V3"):
        with pytest.raises(GhostedError):
            loading.load_model(hub_id)
    assert len(calls) >= 7 and all(flag is False for flag in calls), calls
    # and in the source: wherever trust_remote_code is passed, it is the constant False
    for path in [*ROOT.glob("ghosted_core/**/*.py"), *ROOT.glob("studio/*.py"), *ROOT.glob("bench/*.py"), ROOT / "app.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            for keyword in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
                if keyword.arg == "trust_remote_code":
                    assert isinstance(keyword.value, ast.Constant) and keyword.value.value is False, path


def test_the_server_refuses_an_upload_over_the_limit(tiny_server, tmp_path):
    big = tmp_path / "big-upload.txt"
    big.write_bytes(b"w" * (MAX_BYTES + 1))
    with open(big, "rb") as handle:
        answer = httpx.post(f"{tiny_server.url}gradio_api/upload", files={"files": (big.name, handle)}, timeout=120)
    assert answer.status_code == 413 and "maximum allowed size" in answer.text
    from gradio.utils import get_upload_folder
    # refused before it was stored (os.walk: another test file's server may remove its uploads while we look)
    assert not [folder for folder, _dirs, names in os.walk(get_upload_folder()) if big.name in names]
    fits = tmp_path / "fits.txt"
    fits.write_bytes(b"w " * (MAX_BYTES // 2))
    assert Path(tiny_server.upload(fits)["path"]).is_file()


def canary_text(canary: str) -> str:
    book = corpora.load_corpus("books", "evaluation").text[:40_000]
    return "\n\n".join(f"{canary} {paragraph}" for paragraph in book.split("\n\n"))


def uploads_holding(canary: str, root: Path | None = None) -> list[Path]:
    """The files under `root` (default: Gradio's upload folder) that hold `canary` (files removed while we look
    are skipped)."""
    from gradio.utils import get_upload_folder

    found = []
    for folder, _dirs, names in os.walk(root or get_upload_folder()):  # skips a folder removed while it walks
        for path in (Path(folder) / name for name in names):
            try:
                if canary.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                continue
    return found


def test_a_canary_in_an_upload_is_nowhere_after_the_run(tiny_server, tmp_path, caplog, capfd):
    from gradio.utils import get_upload_folder
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError, ValidationError

    canary = "CANARY-7f3a9c0d5e"
    good, short = tmp_path / "mine.txt", tmp_path / "short.txt"
    good.write_text(canary_text(canary))
    short.write_text(f"{canary} is far too short to calibrate on.")
    client = Client(tiny_server.url, verbose=False, download_files=str(tmp_path / "downloads"))
    seen = []
    with caplog.at_level(logging.DEBUG):
        result = client.predict(api_name="/run", **tiny_server.run_kwargs(your_file=handle_file(str(good)),
                                                                          text_use="both"))
        seen.append(result)
        for bad in (dict(your_file=handle_file(str(short)), text_use="both"),
                    dict(your_text=f"{canary} pasted and too short", text_use="calibration")):
            with pytest.raises((AppError, ValidationError)) as refused:
                client.predict(api_name="/run", **tiny_server.run_kwargs(**bad))
            seen.append(str(refused.value))
    assert "Run complete" in result[0]
    good.unlink()
    short.unlink()
    client.close()  # the tab closes: the uploads it used go with its session
    deadline = time.time() + 30
    while uploads_holding(canary) and time.time() < deadline:
        time.sleep(0.2)
    logs = capfd.readouterr()
    places = {"outputs": json.dumps(seen, default=str), "log records": "\n".join(r.getMessage() for r in caplog.records),
              "stdout": logs.out, "stderr": logs.err}
    found = [where for where, text in places.items() if canary in text]
    roots = [Path(get_upload_folder()), cache_dir(), tmp_path, *Path(os.environ.get("TMPDIR", "/tmp")).glob("ghosted-*")]
    for root in roots:
        found += map(str, uploads_holding(canary, root))
    assert not found, found
    assert "your text (mine.txt" in json.loads(Path(result[outputs.OUTPUT_NAMES.index("results_file")])
                                               .read_text())["calibration"]["label"]


def test_a_sessions_files_are_removed_when_its_tab_closes(tiny_server, tmp_path):
    from gradio_client import Client

    assert tiny_server.demo.delete_cache == DELETE_CACHE  # and what no unload reaches ages out within the hour
    mine, theirs = (Client(tiny_server.url, verbose=False, download_files=str(tmp_path / n)) for n in ("a", "b"))
    mine.predict(api_name="/run", **tiny_server.run_kwargs(seed=1))
    theirs.predict(api_name="/run", **tiny_server.run_kwargs(seed=2))
    served, kept = SESSION_FILES.held(mine.session_hash), SESSION_FILES.held(theirs.session_hash)
    assert served and all(Path(p).is_file() for p in served | kept)
    assert any(p.endswith("results.json") for p in served) and any(p.endswith(".csv") for p in served)
    mine.close()  # the tab closes: its heartbeat stream ends, Gradio calls the unload event
    deadline = time.time() + 30
    while any(Path(p).exists() for p in served) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(Path(p).exists() for p in served) and all(Path(p).is_file() for p in kept)
    theirs.close()


def test_sessions_no_unload_reaches_are_forgotten_once_their_files_age_out(tmp_path, monkeypatch):
    from studio import session_files

    monkeypatch.setattr(session_files, "PRUNE_ABOVE", 2)
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "cache"))
    files = session_files.SessionFiles()
    for k in range(3):
        (tmp_path / f"r{k}.json").write_text(str(k))
        files.serve(f"s{k}", str(tmp_path / f"r{k}.json"))
    Path(next(iter(files.held("s0")))).unlink()  # delete_cache aged the first session's file out
    (tmp_path / "r3.json").write_text("3")
    files.serve("s3", str(tmp_path / "r3.json"))
    assert not files.held("s0") and all(files.held(f"s{k}") for k in (1, 2, 3))
    assert files.end("s1") == 1 and not files.held("s1")
