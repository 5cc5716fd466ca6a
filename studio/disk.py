"""What strangers may store on the server's disk: uploads bounded per request, per address and in total.

Gradio's upload route (`/gradio_api/upload`) takes files from anyone, before any session or event,
and keeps them for an hour (`delete_cache`). Its `max_file_size` bounds each file, not how many
files one request or one address sends. `UploadQuota`, an ASGI middleware the app is launched
with (`layout.launch_options`), reads the request's body itself (at most one file's worth, and at
most READING_AT_ONCE bodies at a time) and refuses before a byte is stored:
- a request larger than one file of the server's upload limit, or without a Content-Length (411);
- a request of more than one file or more than MAX_PARTS parts (413): the page uploads one file at
  a time;
- an address's uploads beyond `uploads_per_address()` in the last hour (429);
- any upload once the uploads in Gradio's upload folder would hold more than `upload_disk_bytes()`
  (507); the folder also holds the copies served to sessions (results, model zips), which are
  bounded apart (one per output per session, `studio.session_files`) and not counted here.
Operators set them with GHOSTED_APP_UPLOADS_PER_ADDRESS and GHOSTED_APP_UPLOAD_DISK_MB (read at
each upload). The address is the one the proxy vouches for (`studio.addresses`). Each upload
Gradio stores is reported to `studio.uploads.SESSION_UPLOADS`, which keeps the file for whoever
uploaded it until a session claims it (API clients never send the page's upload event).
"""

from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
from pathlib import Path

from gradio.utils import get_upload_folder

from ghosted_core.data.user_text import MAX_BYTES
from studio.addresses import client_host
from studio.doors import UPLOAD, answer, read_body, route_path
from studio.session_files import SESSION_FILES
from studio.uploads import SESSION_UPLOADS

UPLOADS_ENV, UPLOAD_DISK_ENV = "GHOSTED_APP_UPLOADS_PER_ADDRESS", "GHOSTED_APP_UPLOAD_DISK_MB"


def uploads_per_address() -> int:
    """Uploads one address may make in an hour (GHOSTED_APP_UPLOADS_PER_ADDRESS, default 20)."""
    return int(os.environ.get(UPLOADS_ENV, "20"))


def upload_disk_bytes() -> int:
    """Bytes of uploads Gradio's upload folder may hold (GHOSTED_APP_UPLOAD_DISK_MB, default 512 MB)."""
    return int(float(os.environ.get(UPLOAD_DISK_ENV, "512")) * 2**20)

MULTIPART_SLACK = 64 * 2**10  # a multipart body's boundaries and headers around the one file
MAX_FILES, MAX_PARTS = 1, 4  # files, and parts of any kind, in one upload request
READING_AT_ONCE = 8  # upload bodies held in memory at once (each at most MAX_BYTES + MULTIPART_SLACK)
WINDOW_SECONDS = 3600  # what an address's upload count covers (Gradio keeps uploads this long)
SCAN_SECONDS = 2.0  # the upload folder's size is measured at most this often


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (files removed while counting are skipped)."""
    total = 0
    for root, _dirs, names in os.walk(folder):  # os.walk skips a folder removed while it walks
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


class UploadQuota:
    """ASGI middleware: Gradio's upload route within the quotas above; every other request passes untouched."""

    def __init__(self, app) -> None:
        self.app = app
        self._recent: dict[str, collections.deque] = {}
        self._lock = threading.Lock()
        self._stored, self._measured = 0, 0.0
        self._reading = 0  # bodies being read now

    async def __call__(self, scope, receive, send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and route_path(scope) == UPLOAD):
            await self.app(scope, receive, send)
            return
        refusal = self.size_refusal(scope)
        if refusal is None and not self._start_reading():
            refusal = 503, "too many uploads at once on this server; try again in a moment"
        if refusal is not None:
            await answer(send, *refusal)
            return
        try:  # the body stays in memory until Gradio has stored it
            body, receive = await read_body(receive)
            refusal = parts_refusal(body, _headers(scope).get("content-type", "")) or self.refusal(scope)
            if refusal is not None:
                await answer(send, *refusal)
                return
            await self.app(scope, receive, _reporting_stored(send))
        finally:
            self._stop_reading()

    def _start_reading(self) -> bool:
        with self._lock:
            if self._reading >= READING_AT_ONCE:
                return False
            self._reading += 1
            return True

    def _stop_reading(self) -> None:
        with self._lock:
            self._reading -= 1

    @staticmethod
    def size_refusal(scope) -> tuple[int, str] | None:
        """(HTTP status, message) for an upload whose stated size is missing or over one file's."""
        length = _headers(scope).get("content-length")
        if length is None or not length.isdigit():
            return 411, "an upload must state its size (Content-Length)"
        if int(length) > MAX_BYTES + MULTIPART_SLACK:
            return 413, f"one file of at most {MAX_BYTES // 2**20} MB per upload"
        return None

    def refusal(self, scope) -> tuple[int, str] | None:
        """(HTTP status, message) for an upload (of a size `size_refusal` let through) beyond a quota, None for one
        within them (then counted)."""
        headers = _headers(scope)
        length = headers["content-length"]
        address = self.address(scope, headers)
        now = time.time()
        with self._lock:
            if now - self._measured > SCAN_SECONDS:  # uploads only: the copies served to sessions have their own bound
                stored = folder_bytes(Path(get_upload_folder())) - SESSION_FILES.served_bytes()
                self._stored, self._measured = max(0, stored), now
            if self._stored + int(length) > upload_disk_bytes():
                return 507, ("this server's upload space is full; try again later (uploads are removed when their "
                             "sessions end, or after an hour)")
            recent = self._recent.setdefault(address, collections.deque())
            while recent and now - recent[0] > WINDOW_SECONDS:
                recent.popleft()
            if len(recent) >= uploads_per_address():
                return 429, f"at most {uploads_per_address()} uploads an hour from one address; try again later"
            recent.append(now)
            self._stored += int(length)
            if len(self._recent) > 10_000:  # addresses seen over a long time: forget the idle ones
                self._recent = {a: q for a, q in self._recent.items() if q and now - q[-1] < WINDOW_SECONDS}
        return None

    @staticmethod
    def address(scope, headers: dict[str, str]) -> str:
        return client_host(headers.get("x-forwarded-for", ""), (scope.get("client") or ("", 0))[0])


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def multipart_parts(body: bytes, content_type: str) -> tuple[int, int]:
    """(parts, of which files) in a multipart/form-data body, counted by its boundary (0, 0 for another kind of
    body: Gradio refuses it)."""
    found = re.search(r'boundary="?([^";,\s]+)"?', content_type)
    if "multipart/form-data" not in content_type.lower() or not found:
        return 0, 0
    parts = files = 0
    for part in body.split(b"--" + found.group(1).encode("latin-1"))[1:]:
        if part.startswith(b"--"):  # the closing delimiter
            break
        parts += 1
        files += b"filename=" in part.split(b"\r\n\r\n", 1)[0].lower()
    return parts, files


def parts_refusal(body: bytes, content_type: str) -> tuple[int, str] | None:
    """(413, message) for an upload request of more files or parts than the page ever sends."""
    parts, files = multipart_parts(body, content_type)
    if files > MAX_FILES or parts > MAX_PARTS:
        return 413, f"one file per upload ({files} files in {parts} parts sent)"
    return None


def _reporting_stored(send):
    """`send`, which also reports the paths of a successful upload's answer to SESSION_UPLOADS."""
    status, chunks = 0, []

    async def reporting(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and status == 200:
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                try:
                    paths = json.loads(b"".join(chunks))
                except ValueError:
                    paths = []
                SESSION_UPLOADS.uploaded([p for p in paths if isinstance(p, str)] if isinstance(paths, list) else [])
        await send(message)

    return reporting
