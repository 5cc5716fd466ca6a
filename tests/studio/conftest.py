"""One app server for the tests that need no real model: the tiny random Llama, served in-process on a free port.

The Model box opens local folders inside the tiny model's folder only (GHOSTED_APP_LOCAL_MODELS set
to that folder), so a test can tell a folder the server opens from one it must never read.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

import httpx
import pytest

from studio import layout
from studio.guard import LOCAL_MODELS_ENV


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TinyServer:
    url: str  # ends with "/"
    demo: object
    model: str  # the tiny model's folder, the only local folder the server opens

    def run_kwargs(self, **changes) -> dict:
        """The /run endpoint's keyword arguments for a run of a second or so on the tiny model."""
        return dict(model=self.model, criterion="streamline", depth=2, operators=["none", "ghost"],
                    calibration="ptb", samples=2, seqlen=64, eval_corpora=["ptb"], eval_tokens=256, prompt="",
                    new_tokens=4) | changes

    def call(self, api: str, data: list, timeout: float = 300) -> tuple[str, object]:
        """One call through Gradio's plain HTTP API: ("complete", outputs) or ("error", message), or
        ("http <status>", body) when the request itself is refused. NaN and infinities go as JSON's extensions."""
        body = json.dumps({"data": data}, allow_nan=True)
        posted = httpx.post(f"{self.url}gradio_api/call/{api}", content=body, timeout=timeout,
                            headers={"content-type": "application/json"})
        if posted.status_code != 200:
            return f"http {posted.status_code}", posted.text
        event = posted.json()["event_id"]
        kind, payload = "none", None
        with httpx.stream("GET", f"{self.url}gradio_api/call/{api}/{event}", timeout=timeout) as stream:
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ").strip()
                elif line.startswith("data: ") and kind in ("complete", "error"):
                    payload = json.loads(line.removeprefix("data: "))
                    break
        return kind, payload

    def upload(self, path) -> dict:
        """Upload a file as a browser does; the FileData an endpoint takes."""
        with open(path, "rb") as handle:
            answer = httpx.post(f"{self.url}gradio_api/upload", files={"files": (path.name, handle)}, timeout=120)
        answer.raise_for_status()
        return {"path": answer.json()[0], "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


@pytest.fixture(scope="session")
def tiny_server(tiny_model_folder):
    before = os.environ.get(LOCAL_MODELS_ENV)
    os.environ[LOCAL_MODELS_ENV] = str(tiny_model_folder)
    demo = layout.build_demo()
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **layout.launch_options())
    try:
        yield TinyServer(f"http://127.0.0.1:{port}/", demo, str(tiny_model_folder))
    finally:
        demo.close()
        if before is None:
            os.environ.pop(LOCAL_MODELS_ENV, None)
        else:
            os.environ[LOCAL_MODELS_ENV] = before
