"""A public Space that one stranger cannot spoil for everyone else, tried as strangers would: plain HTTP and
gradio_client against the served app (the tiny model), with made-up session ids where the point is about sessions."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from ghosted_core.data import corpora
from studio import outputs
from studio.session_files import SESSION_FILES
from studio.uploads import SESSION_UPLOADS


@pytest.fixture(scope="module")
def run_parameters(tiny_server) -> list[str]:
    """The /run endpoint's parameter names, in the order its HTTP API takes them."""
    from gradio_client import Client

    api = Client(tiny_server.url, verbose=False).view_api(return_format="dict", print_info=False)
    return [p["parameter_name"] for p in api["named_endpoints"]["/run"]["parameters"]]


def run_data(server, parameters: list[str], **changes) -> list:
    """A /run request's values: the tiny server's short run with `changes`, every other value the page's default."""
    from gradio_client import Client

    defaults = {p["parameter_name"]: p.get("parameter_default") for p in
                Client(server.url, verbose=False).view_api(return_format="dict", print_info=False)
                ["named_endpoints"]["/run"]["parameters"]}
    values = defaults | server.run_kwargs(**changes)
    return [values[name] for name in parameters]


def refused(kind: str, answer: object) -> str:
    """The message of a refused /run: before it takes a place in the queue (the validator: HTTP 422 and a verdict
    per input), or as the run's gr.Error; '' when the call was not refused."""
    if kind == "http 422":
        return validator_message(answer)
    return str(answer.get("error") or "") if kind == "error" and isinstance(answer, dict) else ""


def validator_message(body: str) -> str:
    """The refusal in a validator's HTTP 422 answer ('' when every input passed)."""
    return " ".join(v.get("message", "") for v in json.loads(body)["detail"] if v.get("is_valid") is False)


def results_of(answer: list) -> dict:
    return json.loads(Path(answer[outputs.OUTPUT_NAMES.index("results_file")]["path"]).read_text())


def test_a_list_that_names_a_corpus_or_operator_forty_times_costs_one_pass(tiny_server):
    from gradio_client import Client

    client = Client(tiny_server.url, verbose=False)
    updates = {}
    for label, changes in {"once": dict(eval_corpora=["ptb", "wiki"], operators=["none", "ghost"]),
                           "forty": dict(eval_corpora=["ptb", "wiki"] * 20, operators=["none", "ghost"] * 20)}.items():
        job = client.submit(api_name="/run", **tiny_server.run_kwargs(**changes))
        final = job.result(timeout=300)
        assert "Run complete" in final[0]
        updates[label] = len(job.outputs())
        report = json.loads(Path(final[outputs.OUTPUT_NAMES.index("results_file")]).read_text())
        assert list(report["variants"]) == ["dense", "none", "ghost"]
        assert sorted(report["variants"]["ghost"]["ppl"]) == ["ptb", "wiki"]
    assert updates["forty"] == updates["once"]  # one update per stage: the same stages


def test_a_refusal_or_another_visitors_run_never_costs_an_upload(tiny_server, run_parameters, tmp_path):
    text = tmp_path / "ours.txt"
    text.write_text(corpora.load_corpus("books", "evaluation").text[:40_000])
    mine, theirs = tiny_server.upload(text), tiny_server.upload(text)
    assert mine["path"] == theirs["path"]  # the premise: the same content is one file for both visitors
    a, b = (f"visitor-{name}-{uuid.uuid4().hex[:8]}" for name in "ab")
    kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, your_file=mine, text_use="both",
                                                    depth=6), session=a)
    assert "leaves none" in refused(kind, answer)  # refused after reading the text (a typo): the upload must survive
    kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, your_file=mine, text_use="both"),
                                    session=a)
    assert kind == "complete" and "Run complete" in answer[0], answer
    assert "ours.txt" in results_of(answer)["corpora"]["your text"]["label"]
    kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, your_file=theirs, text_use="both"),
                                    session=b)
    assert kind == "complete" and "Run complete" in answer[0], answer
    assert SESSION_UPLOADS.claimed(mine["path"]) == {a, b}
    SESSION_UPLOADS.end(a)  # one visitor leaves: the other's upload stays
    assert Path(mine["path"]).is_file()
    SESSION_UPLOADS.end(b)  # the last one leaves: nothing of the file is left
    assert not Path(mine["path"]).exists()


def test_with_local_folders_off_a_model_name_never_reads_the_working_directory(tiny_server, tiny_model_folder,
                                                                                run_parameters, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from ghosted_core.model import loading
    from studio.guard import LOCAL_MODELS_ENV

    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(tiny_model_folder)  # a model folder spelled like a Hub id
    (tmp_path / "tests" / "studio").mkdir(parents=True)  # a folder without config.json, spelled like one
    monkeypatch.chdir(tmp_path)  # the server's working directory
    monkeypatch.setenv(LOCAL_MODELS_ENV, "0")  # a Space: local folders off
    monkeypatch.setattr(loading, "hub_reachable", lambda: True)  # the Hub is up, as on a Space...
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # ...but holds neither repo
    for name in ("org/name", "tests/studio"):
        kind, answer = tiny_server.call("model_info", [name])
        assert kind == "complete" and answer[0].startswith("**Cannot use this model:**"), answer
        assert "cannot download" in answer[0] and "config.json" not in answer[0] and "decoder blocks" not in answer[0]
        kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, model=name))
        assert "cannot download" in refused(kind, answer), answer


def test_hub_access_is_the_visitors_own_or_none_and_the_servers_only_where_the_operator_lends_it(
        tiny_server, run_parameters, monkeypatch):
    import httpx
    import huggingface_hub
    from gradio_client import Client
    from huggingface_hub.errors import RepositoryNotFoundError

    from ghosted_core.model import loading
    from studio.access import SERVER_TOKEN_ENV

    asked = []

    def recording_download(repo_id, token=None, **kwargs):  # the Hub, as far as this test goes: who asks, with what
        asked.append((repo_id, token))
        raise RepositoryNotFoundError(f"{repo_id} not found", response=httpx.Response(
            404, request=httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}")))

    monkeypatch.setenv("HF_TOKEN", "hf_server_secret")  # what an operator sets for the gated presets
    monkeypatch.setattr(loading, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording_download)
    monkeypatch.setenv(SERVER_TOKEN_ENV, "operator/lent-model")
    kind, answer = tiny_server.call("model_info", ["operator/private-model"])  # a stranger, signed out
    assert kind == "complete" and "is not a model on the Hugging Face Hub" in answer[0], answer
    kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, model="operator/private-model"))
    assert "is not a model on the Hugging Face Hub" in refused(kind, answer), answer
    signed_in = Client(tiny_server.url, verbose=False, oauth_token="hf_visitor_own")
    signed_in.predict("operator/private-model", api_name="/model_info")
    signed_in.predict("operator/lent-model", api_name="/model_info")
    # False: huggingface_hub sends no token (None would send the server's HF_TOKEN); the visitor's own; the server's
    assert asked == [("operator/private-model", False)] * 2 + [("operator/private-model", "hf_visitor_own"),
                     ("operator/lent-model", None)]


def test_requests_the_run_would_refuse_never_take_a_place_in_the_queue(tiny_server, run_parameters):
    import httpx

    from studio import layout

    refused = []
    for k in range(20):  # more than the queue holds (16), each from a made-up session, each refused by the page
        body = {"data": run_data(tiny_server, run_parameters, seed=-1), "session_hash": f"flood-{k}-{uuid.uuid4().hex}"}
        posted = httpx.post(f"{tiny_server.url}gradio_api/call/run", json=body, timeout=60)
        refused.append((posted.status_code, posted.text))
    assert all(code == 422 and "Seed" in validator_message(text) for code, text in refused), refused[:2]
    assert len(tiny_server.demo._queue) == 0  # nothing held a place
    kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters), session=f"honest-{uuid.uuid4().hex}")
    assert kind == "complete" and "Run complete" in answer[0], answer
    assert layout.QUEUE_SIZE == 16


def test_one_session_holds_one_place_and_one_address_a_few(tiny_server, run_parameters, monkeypatch):
    import httpx

    from studio import admission

    session = f"eager-{uuid.uuid4().hex}"
    slow = run_data(tiny_server, run_parameters, eval_tokens=4096, eval_corpora=["ptb", "wiki", "books"])
    first = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": slow, "session_hash": session}, timeout=60)
    assert first.status_code == 200
    second = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": slow, "session_hash": session},
                        timeout=60)
    assert second.status_code == 422 and "already have 1 run waiting or running" in second.text, second.text
    monkeypatch.setattr(admission, "RUNS_PER_ADDRESS", 2)  # the same address: one more session fits, then none
    other = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": slow, "session_hash": f"{session}-b"},
                       timeout=60)
    third = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": slow, "session_hash": f"{session}-c"},
                       timeout=60)
    assert other.status_code == 200 and third.status_code == 422 and "from your address" in third.text, third.text
    for answer in (first, other):  # the places are given back when the runs end
        with httpx.stream("GET", f"{tiny_server.url}gradio_api/call/run/{answer.json()['event_id']}", timeout=300) as s:
            for _ in s.iter_lines():
                pass
    deadline = time.time() + 30
    while admission.session_runs(tiny_server.demo._queue, session) and time.time() < deadline:
        time.sleep(0.2)
    again = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": run_data(tiny_server, run_parameters),
                                                                       "session_hash": session}, timeout=60)
    assert again.status_code == 200, again.text


def test_a_cpu_space_refuses_a_run_over_its_work_budget_before_it_queues(tiny_server, run_parameters, monkeypatch):
    import httpx

    from ghosted_core.recovery.operators import OPERATORS
    from studio import runner, settings

    monkeypatch.setenv("SPACE_ID", "someone/ghosted-layers")  # a Space without a GPU: the default budget applies
    monkeypatch.delenv(settings.RUN_BUDGET_ENV, raising=False)
    assert settings.run_budget_seconds() == 900
    page_maximums = dict(model="smollm2-135m", samples=settings.MAX_SAMPLES, seqlen=max(settings.SEQLENS),
                         operators=list(OPERATORS), eval_corpora=corpora.corpus_names(),
                         eval_tokens=settings.EVAL_TOKENS[1])
    posted = httpx.post(f"{tiny_server.url}gradio_api/call/run", timeout=60,
                        json={"data": run_data(tiny_server, run_parameters, **page_maximums),
                              "session_hash": f"greedy-{uuid.uuid4().hex}"})
    assert posted.status_code == 422 and "this run would take about" in posted.text, posted.text
    assert "more than the 15 min this server allows a run (GHOSTED_APP_RUN_BUDGET=900 s)" in posted.text
    assert len(tiny_server.demo._queue) == 0
    d = settings.DEFAULTS  # the page's defaults fit the budget
    options = runner.build_options(d.model, d.criterion, d.depth, "", list(d.operators), d.calibration, d.samples,
                                   d.seqlen, d.seed, list(d.eval_corpora), d.eval_tokens, "", d.new_tokens)
    runner.build_request(options, runner.QuickTasks(), settings.NO_SAVE, "auto", d.mode, d.depths)
    monkeypatch.setenv(settings.RUN_BUDGET_ENV, "0")  # the operator lifts it
    runner.build_request(replace(options, train_size=settings.MAX_SAMPLES, seqlen=2048), runner.QuickTasks(),
                         settings.NO_SAVE, "auto", d.mode, d.depths)


def test_strangers_cannot_fill_the_disk_with_uploads(tiny_server, tmp_path, monkeypatch):
    import httpx
    from gradio.utils import get_upload_folder

    from studio import disk

    url = f"{tiny_server.url}gradio_api/upload"
    tag = uuid.uuid4().hex[:8]  # the upload folder outlives one test run: names of this run only
    files = [tmp_path / f"part{k}-{tag}.txt" for k in range(40)]
    for k, path in enumerate(files):
        path.write_bytes(f"{k} ".encode() * (2**20 // 2))  # 1 MB each, each different
    many = httpx.post(url, files=[("files", (p.name, p.read_bytes())) for p in files], timeout=120)
    assert many.status_code == 413 and "one file of at most 5 MB per upload" in many.text
    stored = [name for _root, _dirs, names in os.walk(get_upload_folder()) for name in names]  # (os.walk: races skipped)
    assert not [name for name in stored if name.endswith(f"-{tag}.txt")]  # refused before anything was stored

    monkeypatch.setenv("GHOSTED_APP_TRUST_FORWARDED", "1")  # as behind a Space's proxy: each address its own
    monkeypatch.setenv(disk.UPLOADS_ENV, "3")
    stranger = {"x-forwarded-for": f"203.0.113.{uuid.uuid4().int % 250}"}
    answers = [httpx.post(url, files={"files": (p.name, p.read_bytes())}, headers=stranger, timeout=120).status_code
               for p in files[:5]]
    assert answers == [200, 200, 200, 429, 429]
    other = httpx.post(url, files={"files": (files[5].name, files[5].read_bytes())}, timeout=120,
                       headers={"x-forwarded-for": "198.51.100.7"})
    assert other.status_code == 200  # another visitor still uploads

    monkeypatch.setattr(disk, "SCAN_SECONDS", 0.0)
    stored = disk.folder_bytes(Path(get_upload_folder())) - SESSION_FILES.served_bytes()  # uploads only
    monkeypatch.setenv(disk.UPLOAD_DISK_ENV, str((stored + 2**20 // 2) / 2**20))  # room for half a file more
    full = httpx.post(url, files={"files": (files[6].name, files[6].read_bytes())}, timeout=120,
                      headers={"x-forwarded-for": "198.51.100.8"})
    assert full.status_code == 507 and "upload space is full" in full.text


def test_a_sessions_superseded_downloads_are_removed_at_once(tiny_server, run_parameters):
    session = f"saver-{uuid.uuid4().hex}"
    served = []
    for seed in (1, 2):
        kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, seed=seed, criterion="manual",
                                                        manual_blocks="2,3", operators=["none", "magcomp_refit"],
                                                        save_variant="magcomp_refit", export_format="stock"),
                                        session=session)
        assert kind == "complete" and "Run complete" in answer[0], answer
        served.append({name: answer[outputs.OUTPUT_NAMES.index(name)]["path"] for name in ("model_file", "results_file")})
    first, second = served
    assert first["model_file"] != second["model_file"] and first["model_file"].endswith(".zip")
    assert not Path(first["model_file"]).exists() and not Path(first["results_file"]).exists()
    assert Path(second["model_file"]).is_file() and Path(second["results_file"]).is_file()


def test_saved_models_stay_within_their_cap_and_the_oldest_go_first(tiny_server, run_parameters, monkeypatch):
    """Issue 37, point 7: every saved model (its export folder and its served zip) together stays within
    GHOSTED_APP_SAVED_MB, whatever the number of sessions that save; the oldest sessions' saved models go first,
    and a save the cap cannot hold at all is refused in one line with the run's other results kept."""
    import httpx

    from studio import disk
    from studio.saved import SAVED

    SAVED_ENV = "GHOSTED_APP_SAVED_MB"  # the operator's variable, read at each save
    tag = uuid.uuid4().hex[:8]
    files = {name: outputs.OUTPUT_NAMES.index(name) for name in ("model_file", "results_file", "save_note")}

    def save(k: int) -> list:
        kind, answer = tiny_server.call("run", run_data(tiny_server, run_parameters, seed=k + 1, criterion="manual",
                                                        manual_blocks="2,3", operators=["none", "magcomp_refit"],
                                                        save_variant="magcomp_refit", export_format="stock"),
                                        session=f"saver-{k}-{tag}")
        assert kind == "complete" and "Run complete" in answer[0], answer
        return answer

    def on_disk() -> int:
        """What saved models hold on the server's disk: every export folder, and every model zip served."""
        zips = {Path(p) for held in list(SESSION_FILES._files.values()) for p in held if p.endswith(".zip")}
        return disk.folder_bytes(SAVED._root()) + sum(p.stat().st_size for p in zips if p.exists())

    def downloads(answer: list) -> bool:
        """Whether the stranger's download link still gives its model (Gradio: 403 for a file that is gone)."""
        return httpx.get(answer[files["model_file"]]["url"], timeout=60).status_code == 200

    monkeypatch.setenv(SAVED_ENV, "100000")
    first = save(0)
    zip_bytes = Path(first[files["model_file"]]["path"]).stat().st_size
    one = disk.folder_bytes(SAVED.latest(f"saver-0-{tag}").parent) + zip_bytes  # one save: its folder and its zip
    cap = int(2.5 * one)  # two saves fit, not three
    monkeypatch.setenv(SAVED_ENV, str(cap / 2**20))
    answers, kept = [first], []
    for k in (1, 2, 3):
        answers.append(save(k))
        assert on_disk() <= cap, (k, on_disk(), cap)
        kept.append([downloads(a) for a in answers])
    assert kept == [[True, True], [False, True, True], [False, False, True, True]]  # the oldest went first
    assert [SAVED.latest(f"saver-{k}-{tag}") is None for k in (0, 1)] == [True, True]

    monkeypatch.setenv(SAVED_ENV, str(one / 5 / 2**20))  # smaller than one save
    refused = save(4)
    assert refused[files["model_file"]] is None and Path(refused[files["results_file"]]["path"]).is_file()
    assert "Not saved" in refused[files["save_note"]] and SAVED_ENV in refused[files["save_note"]], refused
    assert [downloads(a) for a in answers[2:]] == [True, True]  # a refused save evicts nobody
    assert SAVED.latest(f"saver-4-{tag}") is None


def test_saved_models_are_evicted_least_recently_used_first_and_never_while_written(tmp_path, monkeypatch):
    from studio.saved import SAVED_ENV, SavedModels

    saved = SavedModels(capacity=10, root=tmp_path)
    monkeypatch.setenv(SAVED_ENV, str(3 / 1024))  # 3 KiB

    def write(session: str, kib: float) -> Path:
        folder = saved.new_folder(session)
        (folder / "weights").write_bytes(b"0" * int(kib * 1024))
        return folder

    a, b = write("a", 1), write("b", 1)
    assert saved.admit("a", None) is None and saved.admit("b", None) is None
    saved.latest("a")  # pushed: "b" is now the least recently used
    c = write("c", 1.5)
    saved.reserve("c", 512)  # "c" is being written
    d = write("d", 1.2)
    assert saved.admit("d", None) is None and not b.exists() and a.exists() and c.exists()
    assert saved.admit("c", None) is None and not a.exists() and c.exists() and d.exists()
    assert saved.stored_bytes() <= 3 * 1024

    e = write("e", 1)
    saved.reserve("e", 1024)  # room made before it is written: the least recently used "c" goes, "d" is not needed
    assert not c.exists() and d.exists()
    f = write("f", 2.5)
    refusal = saved.admit("f", None)  # fits alone, not beside "e", which is still being written
    assert refusal and "try again in a few minutes" in refusal and not f.exists() and d.exists() and e.exists()
    g = write("g", 4)
    refusal = saved.admit("g", None)
    assert refusal and "retrying will not help" in refusal and SAVED_ENV in refusal and not g.exists() and d.exists()
    saved.release("e", e)  # its run failed: nothing to push, no room held
    assert not e.exists() and saved.latest("e") is None and saved.stored_bytes() == int(1.2 * 1024)


def test_the_saved_models_go_with_the_server_process(tmp_path):
    """A server's saved models live in a folder of its own, removed when its process exits (no session can reach
    them after that): a machine that serves the app again and again does not fill its disk."""
    import subprocess
    import sys

    script = ("from studio.saved import SavedModels\n"
              "folder = SavedModels().new_folder('s')\n"
              "(folder / 'model.safetensors').write_bytes(b'0' * 4096)\n"
              "print(folder.parent)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    root = Path(done.stdout.strip().splitlines()[-1])
    assert root.parent == tmp_path and root.name.startswith("ghosted-saved-")
    assert not root.exists()
