"""What a stranger sends to the public Space beside the page (issue 37), over plain HTTP against the served app (the
tiny model): the routes Gradio opens that write files, events that do not exist, out-of-range values, and
simultaneous requests that race the run queue's limits."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from gradio.utils import get_upload_folder

from studio import doors


def served_routes(app) -> list[tuple[str, frozenset[str]]]:
    """(path template, methods) of every route `app` serves, FastAPI's included routers opened."""
    from fastapi.routing import _IncludedRouter  # how FastAPI ≥ 0.16x keeps `include_router`'s routes

    def walk(routes):
        for route in routes:
            if isinstance(route, _IncludedRouter):
                yield from walk(route.effective_candidates())
                yield from walk(route.effective_low_priority_routes())
            else:
                yield route

    return [(route.path, frozenset(getattr(route, "methods", None) or ())) for route in walk(app.routes)]


def concrete(template: str) -> str:
    """A path that the route `template` matches (each parameter filled with a made-up value)."""
    return re.sub(r"\{[^}]+\}", "x1", template)


def files_under(folder: Path) -> set[str]:
    return {os.path.join(root, name) for root, _dirs, names in os.walk(folder) for name in names}


def test_every_route_gradio_serves_is_allowed_or_refused(tiny_server, monkeypatch):
    import fastapi
    from gradio import oauth as gradio_oauth

    # the routes Gradio adds on a Space with OAuth (Sign in with Hugging Face), as mocked off a Space
    oauth = fastapi.FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    monkeypatch.setattr(gradio_oauth, "_get_mocked_oauth_info", lambda: {})  # (the mock reads a local Hub login)
    gradio_oauth._add_mocked_oauth_routes(oauth)
    routes = served_routes(tiny_server.demo.server_app) + served_routes(oauth)
    assert len(routes) > 80 and "/gradio_api/queue/join" in {path for path, _ in routes}  # the walk found them
    unclassified = sorted({doors.canonical(path) for path, _ in routes} - set(doors.ALLOWED) - set(doors.REFUSED))
    assert not unclassified, f"classify these routes in studio/doors.py (ALLOWED or REFUSED): {unclassified}"
    assert not set(doors.ALLOWED) & set(doors.REFUSED)
    for path, _methods in routes:  # each template is answered as its list says
        refusal = doors.route_refusal(concrete(path))
        assert (refusal is None) == (doors.canonical(path) in doors.ALLOWED), (path, refusal)
    assert doors.route_refusal("/gradio_api/deep_link/")[0] == 403  # a trailing slash is the same route
    assert doors.route_path({"path": "/gradio_api/upload/"}) == doors.UPLOAD  # (so the upload quota sees it too)


def test_routes_that_write_files_the_app_does_not_need_are_refused_and_write_nothing(tiny_server, tmp_path):
    url = tiny_server.url.rstrip("/")
    session = f"stranger-{uuid.uuid4().hex}"
    kind, _ = tiny_server.call("model_info", ["smollm2-135m"], session=session)  # the session has state now
    assert kind == "complete"
    uploads, temporary = Path(get_upload_folder()), Path(tempfile.gettempdir())
    before = files_under(uploads) | files_under(temporary)

    link = httpx.get(f"{url}/gradio_api/deep_link", params={"session_hash": session}, timeout=30)
    assert link.status_code == 403 and "turned off on this server" in link.json()["detail"], link.text
    video = httpx.post(f"{url}/gradio_api/process_recording", files={"video": ("v.mp4", b"\0" * 2**20, "video/mp4")},
                       timeout=30)
    assert video.status_code == 403 and "records nothing" in video.json()["detail"], video.text
    parts = httpx.post(f"{url}/gradio_api/component_server", timeout=30,
                       files=[("files", (f"f{k}.txt", b"x" * 1000)) for k in range(50)])
    assert parts.status_code == 403, parts.text
    for template in doors.REFUSED:  # every refused route, by every method a stranger might try
        for method in ("GET", "POST"):
            answer = httpx.request(method, f"{url}{concrete(template)}", timeout=30)
            assert answer.status_code == 403 and len(answer.text) < 300, (template, method, answer.text)
    new = (files_under(uploads) | files_under(temporary)) - before
    assert not [f for f in new if "deep_links" in f or f.endswith(".mp4")], sorted(new)[:5]

    unknown = httpx.post(f"{url}/gradio_api/some-route-a-newer-gradio-adds", json={}, timeout=30)
    assert unknown.status_code == 404
    for path in ("/", "/config", "/gradio_api/info", "/theme.css", "/manifest.json"):  # the page still loads
        assert httpx.get(f"{url}{path}", timeout=60).status_code == 200, path


# ---------------------------------------------------------------- values and events that do not exist (point 8)


@pytest.fixture
def server_log():
    """Every warning or error the server logs while the test runs (Gradio's, uvicorn's, the app's)."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "gradio", "studio")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def run_values(server, **changes) -> list:
    """A /run request's values in its API order: the tiny server's short run with `changes`, else the page's
    defaults."""
    from gradio_client import Client

    parameters = Client(server.url, verbose=False).view_api(return_format="dict", print_info=False)[
        "named_endpoints"]["/run"]["parameters"]
    values = {p["parameter_name"]: p.get("parameter_default") for p in parameters} | server.run_kwargs(**changes)
    return [values[p["parameter_name"]] for p in parameters]


def one_line(answer: httpx.Response) -> str:
    """The refusal's message; the test fails unless it is one short line."""
    detail = answer.json()["detail"]
    if isinstance(detail, list):  # the validator's verdict per input
        detail = " ".join(v["message"] for v in detail if v.get("is_valid") is False)
    assert "\n" not in detail and len(detail) < 300 and "Traceback" not in detail, detail
    return detail


def test_a_seed_of_thousands_of_digits_gets_the_ordinary_refusal(tiny_server, server_log):
    url = f"{tiny_server.url}gradio_api/call/run"
    for seed in (10**4000, -(10**4000), 2**32, 10**30, 1e300, float("nan"), float("inf"), float("-inf")):
        body = {"data": run_values(tiny_server, seed=seed), "session_hash": f"digits-{uuid.uuid4().hex}"}
        answer = httpx.post(url, content=json.dumps(body, allow_nan=True), timeout=60,  # NaN, Infinity: JS's own
                            headers={"content-type": "application/json"})
        assert answer.status_code == 422, (seed, answer.text[:300])
        message = one_line(answer)
        expected = "must be a whole number from 0 to 4294967295" if isinstance(seed, int) or math.isfinite(seed) \
            else "must be a finite number"
        assert message.startswith(f"'Seed' {expected}"), message
        assert "internal error" not in message
    assert len(tiny_server.demo._queue) == 0
    assert not [r.getMessage() for r in server_log if r.levelno >= 40 or r.exc_info], server_log[:3]


def test_an_event_that_does_not_exist_gets_a_one_line_refusal(tiny_server, server_log):
    url = f"{tiny_server.url}gradio_api"
    session = f"indexer-{uuid.uuid4().hex}"
    for fn_index in (999, -1, "999", 10**30):
        for route in ("queue/join", "run/predict"):
            answer = httpx.post(f"{url}/{route}", timeout=30,
                                json={"data": [], "fn_index": fn_index, "session_hash": session})
            assert answer.status_code == 404 and "has no event" in one_line(answer), (route, fn_index, answer.text)
    for route in ("call/no_such_endpoint", "call/v2/no_such_endpoint", "run/no_such_endpoint", "api/no_such"):
        answer = httpx.post(f"{url}/{route}", json={"data": []}, timeout=30)
        assert answer.status_code == 404 and "has no endpoint" in one_line(answer), (route, answer.text)
    for route in ("call/run/no-such-event", "call/v2/run/no-such-event", f"queue/data?session_hash={session}-gone"):
        answer = httpx.get(f"{url}/{route}", timeout=30)  # (Gradio: a 404 raised inside a started stream)
        assert answer.status_code == 404 and "no such event or session" in one_line(answer), (route, answer.text)
    assert not [r.getMessage() for r in server_log if r.levelno >= 40 or r.exc_info], server_log[:3]
    kind, answer = tiny_server.call("model_info", ["smollm2-135m"], session=session)  # a real event still runs
    assert kind == "complete", answer


# ---------------------------------------------------------------- simultaneous requests against the queue (point 1)


@pytest.fixture
def held_runs(tiny_server, monkeypatch):
    """Every admitted run holds its place (running, or waiting behind the one running) until the test lets them go;
    then they finish at once, and the queue is empty again for the next test."""
    import threading

    from studio import admission, handlers

    gate = threading.Event()

    def held(*args, **kwargs):
        gate.wait(120)
        return iter(())

    monkeypatch.setattr(handlers, "run_job", held)
    monkeypatch.setenv("GHOSTED_APP_TRUST_FORWARDED", "1")  # as behind a Space's proxy: each address its own
    yield gate
    gate.set()
    queue = tiny_server.demo._queue
    deadline = time.time() + 120
    while (len(queue) or admission._events(queue)) and time.time() < deadline:
        time.sleep(0.2)


def burst(server, bodies: list[dict], headers: list[dict]) -> list[httpx.Response]:
    """POST every body to /run at the same instant (threads behind a barrier), each with its headers."""
    import threading

    barrier, answers = threading.Barrier(len(bodies)), [None] * len(bodies)

    def send(k: int) -> None:
        with httpx.Client(timeout=120) as client:
            barrier.wait()
            answers[k] = client.post(f"{server.url}gradio_api/call/run", json=bodies[k], headers=headers[k])

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_simultaneous_runs_get_no_more_than_their_share_and_an_honest_visitor_still_gets_in(tiny_server, held_runs):
    from studio import admission, layout

    data = run_values(tiny_server)
    tag = uuid.uuid4().hex[:8]
    stranger = {"x-forwarded-for": f"203.0.113.{uuid.uuid4().int % 250}"}
    answers = burst(tiny_server, [{"data": data, "session_hash": f"burst-{tag}-{k}"} for k in range(40)],
                    [stranger] * 40)  # one address, each request its own session
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) == admission.RUNS_PER_ADDRESS, codes
    assert all("from your address" in a.text for a in answers if a.status_code != 200)
    assert len(tiny_server.demo._queue) <= layout.QUEUE_SIZE

    session = f"eager-{tag}"
    answers = burst(tiny_server, [{"data": data, "session_hash": session}] * 16,
                    [{"x-forwarded-for": "198.51.100.20"}] * 16)  # one session
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) == admission.RUNS_PER_SESSION, codes
    assert all("already have 1 run waiting or running" in a.text for a in answers if a.status_code != 200)

    honest = httpx.post(f"{tiny_server.url}gradio_api/call/run", json={"data": data, "session_hash": f"honest-{tag}"},
                        headers={"x-forwarded-for": "192.0.2.77"}, timeout=60)
    assert honest.status_code == 200, honest.text  # another visitor still gets a place
    held = admission._events(tiny_server.demo._queue)
    assert len(held) == admission.RUNS_PER_ADDRESS + admission.RUNS_PER_SESSION + 1
    assert len(admission.CLAIMS[tiny_server.demo._queue]) == 0  # each claim let go once its request queued or not


def test_simultaneous_runs_from_many_addresses_never_overfill_the_queue(tiny_server, held_runs):
    from studio import layout

    data = run_values(tiny_server)
    tag = uuid.uuid4().hex[:8]
    count = layout.QUEUE_SIZE + 12
    answers = burst(tiny_server, [{"data": data, "session_hash": f"crowd-{tag}-{k}"} for k in range(count)],
                    [{"x-forwarded-for": f"198.18.{k}.1"} for k in range(count)])
    codes = sorted(a.status_code for a in answers)
    assert set(codes) <= {200, 503} and codes.count(200) <= layout.QUEUE_SIZE + layout.RUN_CONCURRENCY, codes
    assert len(tiny_server.demo._queue) <= layout.QUEUE_SIZE
    assert all("queue is full" in a.text for a in answers if a.status_code == 503)


# ---------------------------------------------------------------- limits held apart from HTTP


def test_uploaded_text_held_in_memory_stays_within_its_budget(tmp_path):
    from studio.uploads import UPLOAD_MEMORY_BYTES, SessionUploads

    assert UPLOAD_MEMORY_BYTES == 64 * 2**20
    uploads = SessionUploads(budget=2 * 40_000)  # room for two of the texts below
    for k in range(3):
        (tmp_path / f"t{k}.txt").write_text(f"{k} words of a visitor's own text. " * 1200)  # about 40 kB each
        uploads.read(f"session-{k}", str(tmp_path / f"t{k}.txt"))
    assert [uploads.held(f"session-{k}") for k in range(3)] == [None, str(tmp_path / "t1.txt"),
                                                                 str(tmp_path / "t2.txt")]  # the oldest went first
    assert "0 words" in uploads.read("session-0", str(tmp_path / "t0.txt")).text  # read again from its file


def test_a_run_is_reached_through_the_queue_only(tiny_server):
    from studio import admission

    before = len(admission._events(tiny_server.demo._queue))
    direct = httpx.post(f"{tiny_server.url}gradio_api/run/run", timeout=120,
                        json={"data": run_values(tiny_server), "session_hash": f"direct-{uuid.uuid4().hex}"})
    assert direct.status_code == 404 and "join the queue" in direct.text, direct.text[:300]  # no run outside the queue
    assert len(admission._events(tiny_server.demo._queue)) == before


# ---------------------------------------------------------------- uploads (point 4)


def test_an_upload_of_many_small_files_is_refused_before_anything_is_stored(tiny_server):
    from studio import disk

    tag = uuid.uuid4().hex[:8]
    url = f"{tiny_server.url}gradio_api/upload"
    many = httpx.post(url, timeout=60, files=[("files", (f"small{k}-{tag}.txt", f"{k} {tag}".encode()))
                                              for k in range(200)])  # 200 files in 2 kB: under every size limit
    assert many.status_code == 413 and "one file per upload (200 files" in one_line(many), many.text[:300]
    fields = httpx.post(url, timeout=60, data={f"field{k}": "x" for k in range(disk.MAX_PARTS + 1)},
                        files={"files": (f"one-{tag}.txt", b"one")})
    assert fields.status_code == 413, fields.text[:300]
    stored = [name for _root, _dirs, names in os.walk(get_upload_folder()) for name in names]
    assert not [name for name in stored if tag in name]
    one = httpx.post(url, timeout=60, files={"files": (f"one-{tag}.txt", b"one file, as the page sends")})
    assert one.status_code == 200 and len(one.json()) == 1  # what the page sends still works


def test_the_address_counted_is_the_one_the_proxy_vouches_for(tiny_server, monkeypatch):
    """A stranger writes a new address into X-Forwarded-For on every request; the proxy appends (or writes) the
    address it received the request from, and that one is counted, so made-up addresses buy no more uploads."""
    from studio import addresses, disk

    monkeypatch.setenv("GHOSTED_APP_TRUST_FORWARDED", "1")  # as behind a Space's proxy
    monkeypatch.setenv(disk.UPLOADS_ENV, "3")
    tag = uuid.uuid4().hex[:8]
    real = f"198.51.100.{uuid.uuid4().int % 250}"
    codes = [httpx.post(f"{tiny_server.url}gradio_api/upload", timeout=60,
                        files={"files": (f"spoof{k}-{tag}.txt", f"{k} {tag}".encode())},
                        headers={"x-forwarded-for": f"203.0.113.{k}, {real}, 10.1.2.3"}).status_code
             for k in range(8)]  # (10.1.2.3: an internal hop of the proxy's own)
    assert codes == [200] * 3 + [429] * 5, codes

    assert addresses.vouched_address(f"1.2.3.4, {real}") == real
    assert addresses.vouched_address(f"{real}, 10.0.0.9, 192.168.1.1") == real  # internal hops are skipped
    assert addresses.vouched_address("not-an-address, [2001:db8::1]:443, 8.8.8.8:80") == "8.8.8.8"
    assert addresses.vouched_address(f"1.2.3.4, {real}, 5.6.7.8", hops=2) == real  # the operator's hop count
    assert addresses.vouched_address("garbage, , ;") == ""  # then the socket's peer counts
    assert addresses.vouched_address(", ".join(["9.9.9.9"] * 100_000) + f", {real}") == real  # only the tail read


def test_request_bodies_are_bounded(tiny_server):
    from studio import doors

    url = f"{tiny_server.url}gradio_api/call/check"
    huge = httpx.post(url, content=b"{" + b" " * (doors.MAX_BODY_BYTES + 1) + b"}", timeout=60,
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "at most" in one_line(huge)

    def chunks():
        yield b'{"data": ['
        yield b'"x"]}'

    chunked = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert chunked.status_code == 411, chunked.text[:300]
    kind, _ = tiny_server.call("model_info", ["smollm2-135m"], session=f"small-{uuid.uuid4().hex}")
    assert kind == "complete"  # an ordinary request still passes


# ---------------------------------------------------------------- uploads shared between sessions (point 5)


def test_a_page_visitor_leaving_never_removes_an_api_clients_upload_of_the_same_bytes(tiny_server, tmp_path):
    from ghosted_core.data import corpora
    from studio.uploads import SESSION_UPLOADS

    text = tmp_path / f"shared-{uuid.uuid4().hex[:8]}.txt"
    text.write_text(corpora.load_corpus("books", "evaluation").text[:40_000] + text.name)
    alice, bob = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("alice", "bob"))
    mine = tiny_server.upload(text)  # Alice, on the page: the upload, then its upload event claims it
    upload_event = next(k for k, fn in tiny_server.demo.fns.items() if getattr(fn.fn, "__name__", "") == "on_upload")
    claimed = httpx.post(f"{tiny_server.url}gradio_api/run/predict", timeout=60,
                         json={"data": [mine], "fn_index": upload_event, "session_hash": alice})
    assert claimed.status_code == 200, claimed.text[:300]
    assert alice in SESSION_UPLOADS.claimed(mine["path"])
    theirs = tiny_server.upload(text)  # Bob, through the API: no upload event
    assert theirs["path"] == mine["path"]  # the premise: the same bytes are one file
    SESSION_UPLOADS.end(alice)  # Alice closes her tab (the page's unload) before Bob runs
    assert Path(theirs["path"]).is_file()
    kind, answer = tiny_server.call("run", run_values(tiny_server, your_file=theirs, text_use="both"), session=bob)
    assert kind == "complete" and "Run complete" in answer[0], answer
    SESSION_UPLOADS.end(bob)  # the last claim goes, and no upload of it is left unclaimed: the file goes
    assert not Path(theirs["path"]).exists()


# ---------------------------------------------------------------- memory per session (point 6)


def test_new_sessions_cost_what_they_declare_and_keep_no_refused_input(tiny_server):
    import gc
    import tracemalloc

    from studio import sessions

    holder = tiny_server.demo.state_holder
    assert holder.capacity == sessions.session_capacity() == 256 * 2**20 // sessions.SESSION_BYTES
    tag = uuid.uuid4().hex[:8]
    big = "1-2," * (2**20 // 4)  # a 1 MB value for the manual blocks box, refused by the check
    count = 12
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(count):
            kind, _ = tiny_server.call("check", ["smollm2-135m", "manual", 2, big, ["none"], 2, 64, "single depth",
                                                 "2:6:2"], session=f"new-{tag}-{k}")
            assert kind in ("complete", "error")
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    mine = [s for s in list(holder.session_data) if s.startswith(f"new-{tag}")]
    assert len(mine) == count
    # each session within its declaration, beside the last request's body that Gradio still holds (parsed, and
    # read whole by starlette and the doorkeeper); on Gradio's own sessions each one kept the 1 MB value, and more
    assert grown <= count * sessions.SESSION_BYTES + 4 * len(big), grown / count
    assert all(not holder.session_data[s].config_values for s in mine)


def test_lean_sessions_have_every_attribute_of_gradios_own(tiny_server):
    from studio.sessions import LeanSessionState

    gradios = LeanSessionState.__mro__[1]  # Gradio's own SessionState
    lean, theirs = LeanSessionState(tiny_server.demo), gradios(tiny_server.demo)
    assert set(vars(theirs)) - {"config_values"} == set(vars(lean))
    assert lean.blocks_config.blocks.keys() == theirs.blocks_config.blocks.keys()


def test_the_serving_figure_adds_each_part_from_its_limit():
    from ghosted_core.model.loading import peek_config
    from ghosted_core.run.options import memory_plan
    from studio import serving, settings
    from studio.handlers import prepare_run
    from studio.sessions import SESSION_BYTES, session_capacity
    from studio.uploads import UPLOAD_MEMORY_BYTES

    d = settings.DEFAULTS
    page = dict(model=d.model, criterion=d.criterion, depth=d.depth, manual_blocks="19-25", operators=list(d.operators),
                calibration=d.calibration, samples=d.samples, seqlen=d.seqlen, seed=d.seed,
                eval_corpora=list(d.eval_corpora), eval_tokens=d.eval_tokens, prompt="The city", new_tokens=d.new_tokens,
                tasks_on=False, task_names=list(d.tasks), task_examples=d.task_examples)
    larger = page | {"samples": 32, "seqlen": 512}
    figure = serving.serving_plan([page, larger])
    plans = [memory_plan(prepare_run(v, "").options, peek_config(d.model)) for v in (page, larger)]
    assert plans[1].host_bytes > plans[0].host_bytes  # the larger run sets the runs' part
    assert figure["runs computing"] == settings.RUN_CONCURRENCY * (plans[1].host_bytes - plans[1].weights_bytes)
    assert figure["models held"] == plans[0].weights_bytes  # one model, counted once
    assert figure["sessions"] == session_capacity() * SESSION_BYTES and figure["uploaded text"] == UPLOAD_MEMORY_BYTES
    assert figure["total"] == sum(b for part, b in figure.items() if part != "total")
