"""The model each browser session saved last, kept on disk as its export folder so that it can be pushed.

A run that saves a variant exports it (stock or remote-code folder, its model card, its GGUF when
asked) into a folder this registry hands out; the download is made from that folder, and Push to
the Hub uploads the same folder, with no zip round trip. One folder per session: a new save
replaces the session's previous one (folder and served download).

Two bounds: at most `capacity` sessions keep a saved model, and all saved models together (each
export folder plus the download served from it) take at most `saved_cap_bytes()`
(GHOSTED_APP_SAVED_MB). A save that would pass the cap evicts the least recently used sessions'
saved models first; a save the cap cannot hold even alone is refused, with the run's other results
kept. A save being written is never evicted to make room for another.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ghosted_core.export.gguf import GGUF_FORMAT
from studio.disk import folder_bytes
from studio.session_files import SESSION_FILES

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4  # sessions whose last saved model stays on disk
SAVED_ENV = "GHOSTED_APP_SAVED_MB"
# SmolLM2 (the page's default) saves a ~0.5 GB fp32 export and serves a ~0.5 GB zip of it: 2 GB holds two
# sessions' saves, and keeps a Space's disk (50 GB) for the model cache and uploads.
DEFAULT_SAVED_MB = 2048


def saved_cap_bytes() -> int:
    """Bytes all sessions' saved models (export folders and their served downloads) may take together
    (GHOSTED_APP_SAVED_MB, read each time)."""
    return int(float(os.environ.get(SAVED_ENV, str(DEFAULT_SAVED_MB))) * 2**20)


def save_estimate(weight_bytes: int, export_format: str) -> int:
    """Bytes a save will take, known before it is written: its folder and its download each hold the weights.
    A GGUF save: its stock folder only (its GGUF files' sizes are measured once written)."""
    return weight_bytes if export_format == GGUF_FORMAT else 2 * weight_bytes


def too_big(need: int, cap: int) -> str:
    """The refusal of a save the cap cannot hold even with every other saved model evicted."""
    return (f"this save takes about {need / 2**20:,.0f} MB (its folder and its download) and this server keeps "
            f"at most {cap / 2**20:,.0f} MB of saved models ({SAVED_ENV}); retrying will not help: save a smaller "
            f"variant (more blocks removed, or a smaller GGUF type), or run the app with a larger {SAVED_ENV}. "
            "The run's other results are kept.")


def busy(cap: int) -> str:
    """The refusal of a save that fits the cap but not beside other sessions' saves still being written."""
    return (f"other visitors' saves in progress fill this server's {cap / 2**20:,.0f} MB for saved models; "
            "try again in a few minutes, once they have finished. The run's other results are kept.")


@dataclass
class _Saved:
    folder: Path
    owner: str | None  # the Hub account that saved it (None: unknown)
    bytes: int = 0  # reserved (an estimate) while it is written, then measured
    writing: bool = True  # its save is in progress: never evicted to make room


class SavedModels:
    """session → the folder holding its last saved model (a thread-safe LRU, bounded in sessions and in bytes)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, root: Path | None = None):
        self.capacity = capacity
        self.root = root
        self._saved: OrderedDict[str, _Saved] = OrderedDict()
        self._lock = threading.Lock()

    def _root(self) -> Path:
        if self.root is None:  # made on the first save; gone with the server, whose sessions can no longer reach it
            self.root = Path(tempfile.mkdtemp(prefix="ghosted-saved-"))
            atexit.register(shutil.rmtree, self.root, ignore_errors=True)
        return self.root

    def new_folder(self, session: str, owner: str | None = None) -> Path:
        """An empty folder for `session`'s next saved model, saved by Hub account `owner` (on a Space: the
        signed-in visitor; None when unknown); its previous one (and the oldest session's beyond the capacity)
        is deleted."""
        with self._lock:
            gone = [(session, old) for old in [self._saved.pop(session, None)] if old is not None]
            self._saved[session] = _Saved(Path(tempfile.mkdtemp(prefix="save-", dir=self._root())), owner)
            while len(self._saved) > self.capacity:
                gone.append(self._saved.popitem(last=False))
            folder = self._saved[session].folder
        _delete(gone)
        return folder

    def reserve(self, session: str, need: int) -> None:
        """`session`'s save is about to write about `need` bytes: evict the oldest others' saved models to make
        room for it now rather than after it is written."""
        with self._lock:
            entry = self._saved.get(session)
            if entry is None or not entry.writing:
                return
            entry.bytes = need
            cap = saved_cap_bytes()
            gone = self._make_room(session, cap) if self._floor(session) <= cap else []  # else refused once written
        _delete(gone)

    def admit(self, session: str, download: str | Path | None) -> str | None:
        """`session`'s save is written: its folder and `download` (the file served from it) are measured and
        kept within the cap, the oldest others' saved models evicted first. None when kept; otherwise the
        reason it was refused (its folder is deleted: the download must not be served)."""
        with self._lock:
            entry = self._saved.get(session)
            folder = None if entry is None else entry.folder
        if folder is None:
            return None
        measured = folder_bytes(folder) + (Path(download).stat().st_size if download and Path(download).is_file() else 0)
        cap = saved_cap_bytes()
        with self._lock:
            if self._saved.get(session) is not entry:  # ended or replaced meanwhile
                return None
            entry.bytes, entry.writing = measured, False
            refusal = None
            if self._floor(session) <= cap:
                gone = self._make_room(session, cap)
            else:  # evicting every other finished save would not make room: none is evicted
                refusal = too_big(measured, cap) if measured > cap else busy(cap)
                gone = [(session, self._saved.pop(session))]
        _delete(gone)
        return refusal

    def release(self, session: str, folder: str | Path) -> None:
        """The run that was to save into `folder` has ended: a save never admitted (failed, stopped, refused)
        leaves nothing to push and holds no room."""
        with self._lock:
            entry = self._saved.get(session)
            if entry is None or not entry.writing or entry.folder != Path(folder):
                return
            gone = [(session, self._saved.pop(session))]
        _delete(gone)

    def stored_bytes(self) -> int:
        """Bytes the saved models take, as counted against the cap (reservations of saves in progress included)."""
        with self._lock:
            return self._total()

    def _total(self) -> int:
        return sum(entry.bytes for entry in self._saved.values())

    def _floor(self, session: str) -> int:
        """Under the lock: the bytes no eviction for `session` frees (its own save and the saves being written)."""
        return sum(entry.bytes for other, entry in self._saved.items() if other == session or entry.writing)

    def _make_room(self, session: str, cap: int) -> list[tuple[str, _Saved]]:
        """Under the lock: pop the least recently used finished saves of other sessions until the total fits."""
        gone = []
        for other in list(self._saved):
            if self._total() <= cap:
                break
            if other != session and not self._saved[other].writing:
                gone.append((other, self._saved.pop(other)))
        return gone

    def forget(self, session: str) -> None:
        """The session has ended (its tab closed): its saved model goes."""
        with self._lock:
            entry = self._saved.pop(session, None)
        if entry is not None:
            shutil.rmtree(entry.folder, ignore_errors=True)

    def owner(self, session: str) -> str | None:
        """The Hub account that saved `session`'s model (None: unknown, or nothing saved)."""
        with self._lock:
            entry = self._saved.get(session)
            return None if entry is None else entry.owner

    def latest(self, session: str) -> Path | None:
        """The export folder `session` saved last (the one folder inside its save folder), None if none."""
        with self._lock:
            entry = self._saved.get(session)
            if entry is not None:
                self._saved.move_to_end(session)
        if entry is None or not entry.folder.is_dir():
            return None
        exports = [p for p in entry.folder.iterdir() if p.is_dir() and (p / "config.json").exists()]
        return exports[0] if len(exports) == 1 else None


def _delete(gone: list[tuple[str, _Saved]]) -> None:
    """Delete evicted or replaced saved models: each folder, and the download served to its session."""
    for session, entry in gone:
        shutil.rmtree(entry.folder, ignore_errors=True)
        SESSION_FILES.drop(session, "model_file")
    if gone:
        log.info("removed %d saved models", len(gone))


SAVED = SavedModels()
