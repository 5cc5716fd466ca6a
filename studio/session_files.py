"""Files handed to a browser session (results.json, the history CSV, a model zip), removed when the session ends.

A run writes its files in its own temporary folder, which goes when the run ends; Gradio serves
copies from its cache folder. `SessionFiles.serve` makes that copy itself (as Gradio would, under
the same content-hash name) and remembers which session it went to; `end` removes a session's
copies when Gradio reports that the session ended (`demo.unload`), except a copy another live
session was also given (identical content maps to one path). What no unload reaches (a
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


class SessionFiles:
    """Cached copies served to each session; thread-safe. Memory: a few paths per session whose files still exist."""

    def __init__(self) -> None:
        self._files: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def serve(self, session: str, path: str | None) -> str | None:
        """The cached copy of `path` for `session` to download (None stays None)."""
        if not path:
            return path
        cached = processing_utils.save_file_to_cache(path, get_upload_folder())
        with self._lock:
            self._files.setdefault(session, set()).add(cached)
            if len(self._files) > PRUNE_ABOVE:  # sessions no unload reaches (API calls): forget the aged-out ones
                self._files = {name: files for name, files in self._files.items()
                               if any(Path(f).exists() for f in files)}
        return cached

    def held(self, session: str) -> set[str]:
        with self._lock:
            return set(self._files.get(session, ()))

    def end(self, session: str) -> int:
        """Remove the copies served to `session` that no other session holds; how many were removed."""
        with self._lock:
            mine = self._files.pop(session, set())
            shared = set().union(*self._files.values()) if self._files else set()
        removed = 0
        for name in mine - shared:
            path = Path(name)
            path.unlink(missing_ok=True)
            removed += 1
            try:
                path.parent.rmdir()  # the content-hash folder Gradio made for it, once empty
            except OSError:
                pass
        if removed:
            log.info("session ended: removed %d of its files", removed)
        return removed


SESSION_FILES = SessionFiles()
FILE_OUTPUTS = ("results_file", "model_file", "history_file")  # the outputs that hand a file to the session


def serve_outputs(session: str, values: dict) -> dict:
    """`values` with every file output replaced by its cached copy for `session`."""
    return values | {name: SESSION_FILES.serve(session, values[name]) for name in FILE_OUTPUTS
                     if isinstance(values.get(name), str)}
