"""Each session's uploaded text, read once and held in memory, so that no refusal costs the visitor their upload.

Gradio stores an upload under a name made from its content, so two visitors who upload the same
file share one path. Every upload Gradio stores is reported here by the upload route's middleware
(`studio.disk.UploadQuota`, `uploaded`): until a session claims it, it is held for whoever sent
it. A session claims its upload when it uploads (the page's upload event) or first reads it (an
API client, which sends no upload event), taking over one such hold; it reads it into memory once,
and every later run of the session, after a refusal, a typo fixed or another depth, uses the text
in memory: nothing is read twice and nothing is lost. The file is removed when the last session
that claimed it ends (`end`, from the page's unload) and no upload of it is still unclaimed, so one
visitor's run or exit never removes another's upload, whether the other came by the page or the
API. The text stays in this process only, within `UPLOAD_MEMORY_BYTES` over all sessions, least
recently used first. An upload no session ever reads, or whose session sends no unload, goes with
Gradio's `delete_cache` (an hour).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

from ghosted_core.data import user_text
from ghosted_core.data.user_text import UserText
from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

UPLOAD_MEMORY_BYTES = 64 * 2**20  # the uploads held in memory over all sessions (each at most user_text.MAX_BYTES)
UNCLAIMED_SECONDS = 3600  # an upload no session claimed is held this long (then Gradio's delete_cache removes it)
UNCLAIMED_PATHS = 10_000  # paths with unclaimed uploads remembered at most (oldest forgotten first)


class SessionUploads:
    """Per session: the last upload's path and what reading it gave (its text, or why it was refused); thread-safe.

    Memory: at most UPLOAD_MEMORY_BYTES of text, plus one path per claim and per recent unclaimed upload."""

    def __init__(self, budget: int = UPLOAD_MEMORY_BYTES) -> None:
        self._read: OrderedDict[str, tuple[str, UserText | GhostedError, int]] = OrderedDict()
        self._claims: dict[str, set[str]] = {}
        self._unclaimed: OrderedDict[str, deque[float]] = OrderedDict()  # path → times of uploads no session took
        self._budget = budget
        self._lock = threading.Lock()

    def uploaded(self, paths: list[str]) -> None:
        """The upload route stored `paths` for a client not known yet: each is held until a session claims it."""
        now = time.time()
        with self._lock:
            for path in map(str, paths):
                self._unclaimed.setdefault(path, deque()).append(now)
                self._unclaimed.move_to_end(path)
            while len(self._unclaimed) > UNCLAIMED_PATHS:
                self._unclaimed.popitem(last=False)

    def claim(self, session: str, path: str | None) -> None:
        """The page's upload event: `session` holds `path` until it ends (whatever other sessions do with it)."""
        if path:
            with self._lock:
                self._take(session, str(path))

    def _take(self, session: str, path: str) -> None:
        """`session` claims `path`, taking over one unclaimed upload of it (a session's first claim only)."""
        sessions = self._claims.setdefault(path, set())
        if session in sessions:
            return
        sessions.add(session)
        pending = self._unclaimed.get(path)
        if pending:
            pending.popleft()
            if not pending:
                del self._unclaimed[path]

    def read(self, session: str, path: str) -> UserText:
        """The text of the session's upload at `path`: from memory when this session read it before, else from
        the file, which the session then claims. GhostedError as the first read gave it."""
        path = str(path)
        with self._lock:
            held = self._read.get(session)
            if held is not None and held[0] == path:
                self._read.move_to_end(session)
                return _result(held[1])
        file = Path(path)
        if not file.is_file():
            raise GhostedError(f"{file.name}: the uploaded file is gone (uploads are removed when the sessions that "
                               "used them end, or after an hour); upload it again")
        try:
            outcome: UserText | GhostedError = user_text.from_file(file)
        except GhostedError as err:
            outcome = err
        size = len(outcome.text) if isinstance(outcome, UserText) else 0
        with self._lock:
            self._read[session] = (path, outcome, size)
            self._read.move_to_end(session)
            while sum(entry[2] for entry in self._read.values()) > self._budget and len(self._read) > 1:
                self._read.popitem(last=False)
            self._take(session, path)
        return _result(outcome)

    def held(self, session: str) -> str | None:
        """The path of the upload whose text `session` holds in memory, if any."""
        with self._lock:
            entry = self._read.get(session)
        return entry[0] if entry else None

    def claimed(self, path: str) -> set[str]:
        with self._lock:
            return set(self._claims.get(str(path), ()))

    def end(self, session: str) -> None:
        """The session ended: forget its text; remove the files no other session claims."""
        with self._lock:
            self._read.pop(session, None)
            mine = [path for path, sessions in self._claims.items() if session in sessions]
        for path in mine:
            self._release(session, path)

    def _release(self, session: str, path: str) -> None:
        with self._lock:
            sessions = self._claims.get(path, set())
            sessions.discard(session)
            if sessions:
                return
            self._claims.pop(path, None)
            pending = self._unclaimed.get(path)
            while pending and time.time() - pending[0] > UNCLAIMED_SECONDS:
                pending.popleft()
            if pending:  # someone else uploaded the same content and has not used it yet
                return
            self._unclaimed.pop(path, None)
        Path(path).unlink(missing_ok=True)


def _result(outcome: UserText | GhostedError) -> UserText:
    if isinstance(outcome, GhostedError):
        raise GhostedError(str(outcome))
    return outcome


SESSION_UPLOADS = SessionUploads()
