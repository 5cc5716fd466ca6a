"""Which of Gradio's routes a stranger may use: one list of the routes the page and its API need, one of those refused.

Gradio serves more than this app uses, and some of it writes files from anyone, outside every quota:
`/gradio_api/deep_link` writes a session's state to the upload folder (never removed),
`/gradio_api/process_recording` a video to the temporary folder (never removed), `component_server`
parses up to 1,000 files per request. `Doorkeeper`, the ASGI middleware the app is launched with
(`layout.launch_options`), answers before Gradio sees the request:
- a route in REFUSED, with the reason the app does not need it (403);
- a path that matches no route in ALLOWED (404): a route a newer Gradio adds stays shut until it is
  classified here (tests/studio/test_strangers.py fails while a served route is in neither list);
- a request body over MAX_BODY_BYTES (413), or of unstated size (411): Gradio reads any body whole;
- a request naming an event this app does not have (`fn_index` 999 or −1, an unknown api name), or
  asking for the messages of an event or session the queue does not hold, with one line (404)
  instead of Gradio's 500, or its 404 raised inside a started stream, and a traceback in the log;
- a value that is NaN or ±Infinity, with one line naming the widget (422) instead of Gradio's multi-line 400.
Uploads are bounded by `studio.disk.UploadQuota`, the next middleware.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from starlette.routing import compile_path

from ghosted_core.data.user_text import MAX_BYTES

API = "/gradio_api"
# The largest body the page sends: its pasted text (at most MAX_BYTES of UTF-8), escaped in JSON (a quote or a
# newline takes two bytes), and the other widgets' values.
MAX_BODY_BYTES = 2 * MAX_BYTES + 2**20
UPLOAD = f"{API}/upload"  # bounded more tightly, with its own messages, by studio.disk.UploadQuota

# Routes the page, gradio_client and the plain HTTP API use (path templates as Gradio declares them).
ALLOWED: dict[str, str] = {
    "/": "the page", "/config": "the page's layout",
    "/svelte/{path:path}": "the page's scripts", "/static/{path:path}": "the page's scripts",
    "/assets/{path:path}": "the page's scripts", "/favicon.ico": "the page's icon", "/theme.css": "the page's theme",
    f"{API}/theme.css": "the page's theme", "/robots.txt": "crawlers", "/pwa_icon": "the page's icon",
    "/pwa_icon/{size}": "the page's icon", "/manifest.json": "the page's manifest",
    "/openapi.json": "the API's description", f"{API}/openapi.json": "the API's description",
    f"{API}/info": "the API's description (gradio_client)",
    f"{API}/startup-events": "the page starts", f"{API}/heartbeat/{{session_hash}}": "a session is open (unload)",
    f"{API}/queue/join": "an event joins the queue", f"{API}/queue/data": "an event's updates",
    f"{API}/queue/status": "the queue's length", f"{API}/cancel": "Stop",
    f"{API}/reset": "Stop (a no-op kept for old clients)",
    f"{API}/run/{{api_name}}": "unqueued events (the Run press's check, the upload's claim)",
    f"{API}/api/{{api_name}}": "unqueued events", f"{API}/call/{{api_name}}": "the plain HTTP API",
    f"{API}/call/{{api_name}}/{{event_id}}": "the plain HTTP API's answers",
    f"{API}/call/v2/{{api_name}}": "the plain HTTP API",
    f"{API}/call/v2/{{api_name}}/{{event_id}}": "the plain HTTP API's answers",
    f"{API}/upload": "Your text's upload (bounded by studio.disk.UploadQuota)",
    f"{API}/upload_progress": "an upload's progress",
    f"{API}/file={{path_or_url:path}}": "downloads of results and models",
    f"{API}/file/{{path:path}}": "downloads (the old spelling)",
    f"{API}/login_check": "the page asks whether it must log in", f"{API}/user": "the signed-in visitor (Hub push)",
    f"{API}/token": "the signed-in visitor's token (Hub push)", f"{API}/app_id": "the page's identity",
    "/login/huggingface": "Sign in with Hugging Face (a Space)", "/login/callback": "the same",
    "/logout": "signing out",
}

# Routes refused: what each would write or serve, and why the app does without it.
REFUSED: dict[str, str] = {
    f"{API}/deep_link": "writes the session's state to disk; the page has no deep links",
    f"{API}/process_recording": "writes a video to disk; the app records nothing",
    f"{API}/component_server": "parses up to 1,000 uploaded files; no component here has server functions",
    f"{API}/stream/{{event_id}}": "streamed inputs; the app streams none",
    f"{API}/stream/{{event_id}}/close": "the same",
    f"{API}/stream/{{session_hash}}/{{run}}/{{component_id}}/playlist.m3u8": "streamed media; the app has none",
    f"{API}/stream/{{session_hash}}/{{run}}/{{component_id}}/{{segment_id}}.{{ext}}": "the same",
    f"{API}/stream/{{session_hash}}/{{run}}/{{component_id}}/playlist-file": "the same",
    f"{API}/vibe-edit": "rewrites the app's source (vibe mode)", f"{API}/undo-vibe-edit": "the same",
    f"{API}/vibe-code": "the same", f"{API}/vibe-starter-queries": "the same",
    f"{API}/runs": "Gradio's run history; the app keeps its own",
    f"{API}/run-history/connect": "creates a Hub bucket for run history; not used",
    f"{API}/run-history/buckets": "the same", f"{API}/run-history/records": "the same",
    f"{API}/run-history/records/{{endpoint}}/{{record_id}}/assets/{{asset_id}}": "the same",
    f"{API}/proxy={{url_path:path}}": "fetches other servers' files (gr.load); not used",
    f"{API}/custom_component/{{id}}/{{environment}}/{{type}}/{{file_name}}": "custom components; none here",
    f"{API}/dev/reload": "reload mode (development)",
    "/monitoring": "Gradio's monitoring dashboard; off", "/monitoring/summary": "the same",
    "/monitoring/{key}": "the same",
    "/login": "password login; the app has none",
}

# Routes that name an event, and how Gradio finds it (a KeyError, a 500, for one it lacks): "index" by the body's
# fn_index, else the path's api name; "name" by the path's api name only; "public" by a public api name only.
EVENT_ROUTES: dict[str, str] = {
    f"{API}/queue/join": "index", f"{API}/run/{{api_name}}": "index", f"{API}/api/{{api_name}}": "index",
    f"{API}/call/{{api_name}}": "name", f"{API}/call/v2/{{api_name}}": "public",
}


# Routes that stream an event's or a session's messages: Gradio finds the session only once the stream has started.
STREAM_ROUTES = [f"{API}/queue/data", f"{API}/call/{{api_name}}/{{event_id}}",
                 f"{API}/call/v2/{{api_name}}/{{event_id}}"]


def _pattern(template: str) -> re.Pattern:
    return compile_path(template)[0]


_ALLOWED = [_pattern(t) for t in ALLOWED]
_REFUSED = {t: _pattern(t) for t in REFUSED}
_EVENTS = [(_pattern(t), how) for t, how in EVENT_ROUTES.items()]
_STREAMS = [_pattern(t) for t in STREAM_ROUTES]


def canonical(path: str) -> str:
    """`path` without a trailing slash (Gradio declares some routes both ways; the lists above name each once)."""
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def route_path(scope: dict) -> str:
    """The request's path inside the app (without the prefix it is mounted or proxied under), canonical."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return canonical((path[len(root):] or "/") if root and path.startswith(root) else path)


def route_refusal(path: str) -> tuple[int, str] | None:
    """(HTTP status, message) for a path this server does not answer; None for one of the routes it needs."""
    path = canonical(path)
    for template, pattern in _REFUSED.items():
        if pattern.match(path):
            return 403, f"{path[:100]} is turned off on this server: it {REFUSED[template]}"
    if any(pattern.match(path) for pattern in _ALLOWED):
        return None
    return 404, "not found"


def body_refusal(scope: dict) -> tuple[int, str] | None:
    """(HTTP status, message) for a request whose body is over MAX_BODY_BYTES, or has a body of unstated size."""
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length")
    if length is None:
        return (411, "a request body must state its size (Content-Length)") if b"transfer-encoding" in headers \
            else None
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        return 413, f"a request may carry at most {MAX_BODY_BYTES // 2**20} MB"
    return None


def event_route(path: str) -> tuple[str | None, str] | None:
    """(the api name in the path, how Gradio finds the event: EVENT_ROUTES) for a route that names an event; None
    for other routes."""
    for pattern, how in _EVENTS:
        found = pattern.match(path)
        if found:
            return found.groupdict().get("api_name"), how
    return None


_NON_FINITE = object()  # what a NaN, an Infinity or an overflowing number in a request body parses to here


def _number(text: str) -> object:
    value = float(text)
    return value if math.isfinite(value) else _NON_FINITE


def event_body(body: bytes) -> dict:
    """An event request's JSON body, parsed once, with every NaN, ±Infinity or float overflow as _NON_FINITE;
    {} for a body that is not a JSON object (Gradio answers it)."""
    try:
        data = json.loads(body, parse_constant=lambda _: _NON_FINITE, parse_float=_number)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def event_refusal(blocks, api_name: str | None, how: str, data: dict) -> tuple[int, str] | None:
    """(404, message) for a request naming an event this app does not have; None for a known one (or one Gradio
    refuses itself: a `fn_index` that is not a whole number, a missing one)."""
    fns, fn_index = getattr(blocks, "fns", {}), data.get("fn_index")
    if fn_index is not None and how == "index":
        index = _whole(fn_index)
        if index is None or index in fns:
            return None
        return 404, f"this app has no event {str(fn_index)[:20]!r} (fn_index)"
    if api_name is None:
        return None
    names = {fn.api_name for fn in fns.values() if how != "public" or fn.fn and fn.api_visibility == "public"}
    return None if api_name in names else (404, f"this app has no endpoint {api_name[:60]!r}")


def non_finite_refusal(blocks, api_name: str | None, data: dict) -> tuple[int, str] | None:
    """(422, message naming the widget) for an event's value that is NaN or ±Infinity (JSON's extensions, or a
    number too large for a float), which Gradio's own preprocessing answers with a multi-line 400; None otherwise.
    `data` is event_body's, for an event event_refusal found."""
    values = data.get("data")
    bad = next((k for k, v in enumerate(values) if v is _NON_FINITE), None) if isinstance(values, list) else None
    if bad is None:
        return None
    fns = getattr(blocks, "fns", {})
    index = _whole(data.get("fn_index"))
    fn = fns.get(index) if index is not None else next((f for f in fns.values() if f.api_name == api_name), None)
    inputs = getattr(fn, "inputs", None) or []
    label = getattr(inputs[bad], "label", None) if bad < len(inputs) else None
    return 422, f"'{label or f'input {bad}'}' must be a finite number (NaN and Infinity are not accepted)"


def stream_refusal(queue, path: str, query: str) -> tuple[int, str] | None:
    """(404, message) for a stream of messages the queue does not hold (an unknown event id, a session with
    nothing pending), found as Gradio finds it; None for any other request."""
    found = next((m for m in (pattern.match(path) for pattern in _STREAMS) if m), None)
    if found is None or queue is None:
        return None
    event_id = found.groupdict().get("event_id")
    if event_id is None:
        sessions = parse_qs(query).get("session_hash")
        if not sessions:
            return None  # Gradio answers the missing parameter
        session = sessions[0]
    else:
        event = queue.event_ids_to_events.get(event_id)
        session = event.session_hash if event is not None else next(
            (s for s, ids in list(queue.pending_event_ids_session.items()) if event_id in ids), event_id)
    if session in queue.pending_messages_per_session:
        return None
    return 404, "no such event or session on this server (or its messages were delivered already)"


def _whole(value: object) -> int | None:
    """`value` as pydantic reads an int field (an int, or digits in a string); None for what it refuses."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,30}\s*", value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


async def answer(send: Callable[[dict], Awaitable[None]], status: int, message: str) -> None:
    """Answer with `status` and {"detail": message}, as Gradio's own refusals are answered."""
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive) -> tuple[bytes, Callable]:
    """The request's whole body, and a `receive` that gives it again to the app (then the client's own messages)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return b"", receive  # the client left: the app sees the disconnect
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body, replayed = b"".join(chunks), False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


class Doorkeeper:
    """ASGI middleware: the routes above shut, bodies bounded, and requests for events this app does not have
    refused."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        refusal = route_refusal(path) or (body_refusal(scope) if path != UPLOAD else None)  # (uploads: disk.py)
        blocks = getattr(scope.get("app"), "get_blocks", lambda: None)() if refusal is None else None
        named = event_route(path) if blocks is not None and scope["method"] == "POST" else None
        if named is not None:
            body, receive = await read_body(receive)
            data = event_body(body)
            refusal = event_refusal(blocks, *named, data) or non_finite_refusal(blocks, named[0], data)
        elif blocks is not None and scope["method"] == "GET":
            refusal = stream_refusal(getattr(blocks, "_queue", None), path, scope.get("query_string", b"").decode())
        if refusal is not None:
            await answer(send, *refusal)
            return
        await self.app(scope, receive, send)
