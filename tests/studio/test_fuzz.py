"""Hostile input through every public endpoint: each value answered with a message or a result, never a bug.

The endpoints and their parameters come from the app itself (`Client.view_api`), so a new endpoint
is fuzzed for free. Each parameter gets every hostile value of its kind (wrong types, NaN,
out-of-range numbers, huge and control-character strings, empty and oversized lists, paths and
file:// URLs, malformed uploads) while the others keep a valid value; the call goes through
Gradio's plain HTTP API. An audit hook records every file the process opens meanwhile: nothing
outside the temporary and cache folders is written, and no hostile path is read. Afterwards the
server still serves a normal run.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import pytest

from ghosted_core.data.assets import cache_dir

OPENED: list[tuple[str, str, int]] = []
RECORDING = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if event == "open" and RECORDING.is_set() and isinstance(args[0], (str, bytes)):
        path = args[0].decode(errors="replace") if isinstance(args[0], bytes) else args[0]
        OPENED.append((path, str(args[1] or ""), int(args[2] or 0)))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only while RECORDING is set

NAN, INF = float("nan"), float("inf")
NUMBERS = [NAN, INF, -INF, -1, 0, 10**30, 1e308, 0.5, "7", None, [], True]
BOOLEANS = ["yes", 2, None, [], NAN]
ARRAYS = [[], [""], ["no-such-name"], ["none"] * 500, "none", [1, 2], None, [["none"]], {"a": 1}]
# When a value only matters once another widget says so: the other widget's value to send with it.
COMPANIONS = {"manual_blocks": {"criterion": "manual"}, "depths": {"mode": "sweep"}, "your_text": {"text_use": "both"},
              "your_file": {"text_use": "both"}, "task_names": {"tasks_on": True}}


def hostile_strings(outside: Path) -> list:
    return ["", " \t\n", "A" * 6_000_000, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ \u202e\u200b", "\x00\x1b[31m\r\x07", "<script>alert(1)</script>"
            "<img src=x onerror=alert(2)>", "../../etc/passwd", "/etc/passwd", f"file://{outside / 'secret.txt'}",
            str(outside / "model"), "some-org/../../etc", "nan", None, 7, ["a"]]


def hostile_files(server, outside: Path, tmp: Path) -> list:
    """Uploads a stranger could send (each uploaded through the server first), and FileData naming paths never uploaded."""
    files = {"binary.txt": bytes(range(256)) * 50, "latin1.txt": "Ça coûte très cher, déjà vu. ".encode("latin-1") * 80,
             "numbers.jsonl": b'{"text": 5}\n{"text": ["a"]}\n', "broken.jsonl": b'{"text": "unclosed\n',
             "empty.txt": b"", "model.exe": b"MZ\x90\x00" * 100, "<img src=x onerror=alert(3)>.txt": b"a few words" * 9}
    with zipfile.ZipFile(tmp / "archive.zip", "w", compression=zipfile.ZIP_DEFLATED) as zipped:
        zipped.writestr("m/zeros", b"\0" * 20_000_000)  # a zip bomb, where text or a model zip is expected
    files["archive.txt"] = (tmp / "archive.zip").read_bytes()
    files["bomb.zip"] = files["archive.txt"]
    uploads = []
    for name, content in files.items():
        path = tmp / name
        path.write_bytes(content)
        uploads.append(server.upload(path))
    meta = {"_type": "gradio.FileData"}
    never_uploaded = [{"path": p, "meta": meta} for p in ("/etc/passwd", str(outside / "secret.txt"),
                                                          "../../etc/passwd", f"file://{outside / 'secret.txt'}")]
    return [*uploads, *never_uploaded, {"url": "http://169.254.169.254/latest/meta-data", "meta": meta}, "abc", 5]


def refusal(kind: str, answer: object) -> str | None:
    """The message of a refused call: the run's gr.Error, or the refusal before the request takes a place in the
    queue (the run events' validator: HTTP 422; Gradio's own checks of the values: HTTP 400); None when
    the answer is neither."""
    if kind == "error" and isinstance(answer, dict):
        return answer.get("error")
    if kind in ("http 400", "http 422"):  # Gradio's own refusal of a value; the validator's verdict per input
        try:
            detail = json.loads(answer).get("detail")
        except (ValueError, AttributeError):
            return None
        if isinstance(detail, list):
            detail = " ".join(v.get("message", "") for v in detail if isinstance(v, dict) and v.get("is_valid") is False)
        return str(detail or "") or None
    return None


def kind_of(parameter: dict) -> str:
    if parameter["component"] == "File":
        return "file"
    kind = parameter.get("type", {}).get("type")
    return {"number": "number", "integer": "number", "boolean": "boolean", "array": "array"}.get(kind, "string")


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """Files a stranger must never reach: a secret and a model folder outside the one the server opens."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret.txt").write_text("the secret nobody may read")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    return folder


def test_every_endpoint_answers_every_hostile_value_and_the_server_keeps_serving(tiny_server, outside, tmp_path,
                                                                                 caplog):
    from gradio_client import Client

    api = Client(tiny_server.url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert {"/run", "/stop", "/model_info", "/check", "/push"} <= set(api)
    values = {"string": hostile_strings(outside), "number": NUMBERS, "boolean": BOOLEANS, "array": ARRAYS,
              "file": hostile_files(tiny_server, outside, tmp_path)}
    base = tiny_server.run_kwargs(criterion="none", eval_corpora=[], operators=["none"])  # accepted runs are short
    problems, calls = [], 0
    OPENED.clear()
    RECORDING.set()
    try:
        with caplog.at_level(logging.ERROR):
            for endpoint, spec in api.items():
                parameters = spec["parameters"]
                valid = {p["parameter_name"]: base.get(p["parameter_name"], p.get("parameter_default"))
                         for p in parameters}
                for parameter in parameters:
                    name = parameter["parameter_name"]
                    for value in values[kind_of(parameter)]:
                        sent = valid | COMPANIONS.get(name, {}) | {name: value}
                        kind, answer = tiny_server.call(endpoint.strip("/"), [sent[p["parameter_name"]] for p in parameters])
                        calls += 1
                        message = refusal(kind, answer)
                        if kind == "complete":
                            continue
                        if not message or "internal error" in message or "Traceback" in message \
                                or "has no attribute" in message:
                            problems.append(f"{endpoint} {name}={str(value)[:60]!r}: {kind} {str(answer)[:300]}")
            for endpoint in api:  # and with the wrong number of values (Gradio drops extra ones)
                kind, answer = tiny_server.call(endpoint.strip("/"), ["x"] * 40)
                if kind != "complete" and not refusal(kind, answer):
                    problems.append(f"{endpoint} with 40 values: {kind} {str(answer)[:200]}")
    finally:
        RECORDING.clear()
    assert calls > 300 and not problems, "\n".join(problems)
    bugs = [r.getMessage() for r in caplog.records if r.name.startswith(("studio", "ghosted_core"))]
    assert not bugs, bugs  # no "run failed" bug report in the server log

    assert any(path.endswith("results.json") for path, _, _ in OPENED)  # the hook saw the runs' own files
    allowed = [Path(tempfile.gettempdir()).resolve(), cache_dir().resolve(), Path("/dev/null")]
    forbidden = [Path("/etc").resolve(), outside.resolve()]
    read_wrongly, written_wrongly = [], []
    for path, mode, flags in OPENED:
        where = Path(path).resolve() if Path(path).is_absolute() else Path(path).absolute().resolve()
        if any(where == f or f in where.parents for f in forbidden):
            read_wrongly.append(path)
        if any(c in mode for c in "wax+") or flags & 0o3 or flags & 0o100:  # O_WRONLY, O_RDWR, O_CREAT
            if not any(where == a or a in where.parents for a in allowed):
                written_wrongly.append(path)
    assert not read_wrongly and not written_wrongly, (read_wrongly[:5], written_wrongly[:5])

    normal = {p["parameter_name"]: tiny_server.run_kwargs().get(p["parameter_name"], p.get("parameter_default"))
              for p in api["/run"]["parameters"]}
    kind, answer = tiny_server.call("run", list(normal.values()))
    assert kind == "complete" and "Run complete" in answer[0], answer
