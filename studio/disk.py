"""What strangers may store on the server's disk: uploads bounded per request, per address and in total.

Gradio's upload route (`/gradio_api/upload`) takes files from anyone, before any session or event,
and keeps them for an hour (`delete_cache`). Its `max_file_size` bounds each file, not how many
files one request or one address sends. `UploadQuota`, an ASGI middleware the app is launched
with (`layout.launch_options`), refuses before a byte is stored:
- a request larger than one file of the server's upload limit (the page uploads one file at a
  time), or without a Content-Length (411);
- an address's uploads beyond `uploads_per_address()` in the last hour (429);
- any upload once the uploads in Gradio's upload folder would hold more than `upload_disk_bytes()`
  (507); the folder also holds the copies served to sessions (results, model zips), which are
  bounded apart (one per output per session, `studio.session_files`) and not counted here.
Operators set them with GHOSTED_APP_UPLOADS_PER_ADDRESS and GHOSTED_APP_UPLOAD_DISK_MB (read at
each upload).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

from gradio.utils import get_upload_folder

from ghosted_core.data.user_text import MAX_BYTES
from studio.admission import client_host
from studio.doors import answer
from studio.session_files import SESSION_FILES

UPLOADS_ENV, UPLOAD_DISK_ENV = "GHOSTED_APP_UPLOADS_PER_ADDRESS", "GHOSTED_APP_UPLOAD_DISK_MB"


def uploads_per_address() -> int:
    """Uploads one address may make in an hour (GHOSTED_APP_UPLOADS_PER_ADDRESS, default 20)."""
    return int(os.environ.get(UPLOADS_ENV, "20"))


def upload_disk_bytes() -> int:
    """Bytes of uploads Gradio's upload folder may hold (GHOSTED_APP_UPLOAD_DISK_MB, default 512 MB)."""
    return int(float(os.environ.get(UPLOAD_DISK_ENV, "512")) * 2**20)

MULTIPART_SLACK = 64 * 2**10  # a multipart body's boundaries and headers around the one file
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

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/gradio_api/upload"):
            refusal = self.refusal(scope)
            if refusal is not None:
                await answer(send, *refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, str] | None:
        """(HTTP status, message) for an upload beyond a quota, None for one within them (then counted)."""
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            return 411, "an upload must state its size (Content-Length)"
        if int(length) > MAX_BYTES + MULTIPART_SLACK:
            return 413, f"one file of at most {MAX_BYTES // 2**20} MB per upload"
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
