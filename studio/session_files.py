"""Files handed to a browser session (results.json, the history CSV, a model zip), removed when the session ends.

A run writes its files in its own temporary folder, which goes when the run ends; Gradio serves
copies from its cache folder. `SessionFiles.serve` makes that copy itself (as Gradio would, under
the same content-hash name) and remembers which session it went to; `end` removes a session's
copies when Gradio reports that the session ended (`demo.unload`), except a copy another live
session was also given (identical content maps to one path); `drop` removes a session's model zip
once `studio.saved` evicts its saved model (the cap on saved bytes). What no unload reaches (a
session of a crashed browser, an upload never used) goes with Gradio's `delete_cache`, which
removes the app's cached files older than an hour (`DELETE_CACHE`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gradio import processing_utils
from gradio.utils import get_upload_folder

log = logging.getLogger(__name__)

DELETE_CACHE = (600, 3600)  # gr.Blocks(delete_cache=…): every 10 min, remove the app's cached files older than 1 h


PRUNE_ABOVE = 1000  # sessions remembered before those whose files delete_cache removed are forgotten
KEPT_UPDATES = 3  # copies of a streamed output (results.json, the history CSV) kept per session
KEPT_COPIES = {"model_file": 1}  # a model zip: only the newest (it is hundreds of MB)


class SessionFiles:
    """Cached copies served to each session; thread-safe. Memory: a few paths per session whose files still exist."""

    def __init__(self) -> None:
        self._files: dict[str, set[str]] = {}
        self._latest: dict[tuple[str, str], list[str]] = {}  # (session, output) → its newest copies, oldest first
        self._lock = threading.Lock()

    def serve(self, session: str, path: str | None, output: str = "") -> str | None:
        """The cached copy of `path` for `session` to download (None stays None). With `output` named, the copies
        it supersedes in that output are removed at once, unless another session holds them: the previous run's
        model zip when a new one is served (a zip comes with a run's last update only), and a streamed
        results.json or history CSV once KEPT_UPDATES newer ones have been served (an API client that downloads
        every update's files lags a little behind the stream)."""
        if not path:
            return path
        cached = processing_utils.save_file_to_cache(path, get_upload_folder())
        stale: list[str] = []
        with self._lock:
            self._files.setdefault(session, set()).add(cached)
            if output:
                recent = self._latest.setdefault((session, output), [])
                if cached not in recent:
                    recent.append(cached)
                while len(recent) > KEPT_COPIES.get(output, KEPT_UPDATES):
                    old = recent.pop(0)
                    self._files[session].discard(old)
                    if not any(old in files for files in self._files.values()):
                        stale.append(old)
            if len(self._files) > PRUNE_ABOVE:  # sessions no unload reaches (API calls): forget the aged-out ones
                self._files = {name: files for name, files in self._files.items()
                               if any(Path(f).exists() for f in files)}
                self._latest = {key: f for key, f in self._latest.items() if key[0] in self._files}
        for old in stale:
            _remove(Path(old))
        return cached

    def served_bytes(self) -> int:
        """Bytes of every copy served to a live session (they share Gradio's cache folder with the uploads)."""
        with self._lock:
            files = set().union(*self._files.values()) if self._files else set()
        total = 0
        for name in files:
            try:
                total += Path(name).stat().st_size
            except OSError:
                continue
        return total

    def held(self, session: str) -> set[str]:
        with self._lock:
            return set(self._files.get(session, ()))

    def drop(self, session: str, output: str) -> int:
        """Remove the copies served to `session` in `output` that no other session holds (its saved model was
        evicted or replaced: `studio.saved`); how many were removed."""
        with self._lock:
            mine = set(self._latest.pop((session, output), ()))
            if session in self._files:
                self._files[session] -= mine
            shared = set().union(*self._files.values()) if self._files else set()
        for name in mine - shared:
            _remove(Path(name))
        return len(mine - shared)

    def end(self, session: str) -> int:
        """Remove the copies served to `session` that no other session holds; how many were removed."""
        with self._lock:
            mine = self._files.pop(session, set())
            self._latest = {key: f for key, f in self._latest.items() if key[0] != session}
            shared = set().union(*self._files.values()) if self._files else set()
        removed = 0
        for name in mine - shared:
            _remove(Path(name))
            removed += 1
        if removed:
            log.info("session ended: removed %d of its files", removed)
        return removed


def _remove(path: Path) -> None:
    """Remove a served copy and the content-hash folder Gradio made for it, once empty."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass


SESSION_FILES = SessionFiles()
FILE_OUTPUTS = ("results_file", "model_file", "history_file")  # the outputs that hand a file to the session


def serve_outputs(session: str, values: dict) -> dict:
    """`values` with every file output replaced by its cached copy for `session`."""
    return values | {name: SESSION_FILES.serve(session, values[name], name) for name in FILE_OUTPUTS
                     if isinstance(values.get(name), str)}
