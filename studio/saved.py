"""The model each browser session saved last, kept on disk as its export folder so that it can be pushed.

A run that saves a variant exports it (stock or remote-code folder, its model card, its GGUF when
asked) into a folder this registry hands out; the download is made from that folder, and Push to
the Hub uploads the same folder, with no zip round trip. One folder per session: a new save
replaces the session's previous one, and beyond `capacity` sessions the oldest folder is deleted.
Disk: capacity × one export (SmolLM2: ~0.5 GB in fp32, plus its GGUF).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 4  # sessions whose last saved model stays on disk


class SavedModels:
    """session → the folder holding its last saved model (a thread-safe, bounded LRU)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, root: Path | None = None):
        self.capacity = capacity
        self.root = root
        self._folders: OrderedDict[str, Path] = OrderedDict()
        self._owners: dict[str, str | None] = {}  # session → the Hub account that saved its model (None: unknown)
        self._lock = threading.Lock()

    def _root(self) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="ghosted-saved-"))
        return self.root

    def new_folder(self, session: str, owner: str | None = None) -> Path:
        """An empty folder for `session`'s next saved model, saved by Hub account `owner` (on a Space: the
        signed-in visitor; None when unknown); its previous one (and the oldest session's beyond the capacity)
        is deleted."""
        with self._lock:
            old = self._folders.pop(session, None)
            folder = Path(tempfile.mkdtemp(prefix="save-", dir=self._root()))
            self._folders[session] = folder
            self._owners[session] = owner
            evicted = [old] if old is not None else []
            while len(self._folders) > self.capacity:
                gone, path = self._folders.popitem(last=False)
                self._owners.pop(gone, None)
                evicted.append(path)
        for path in evicted:
            shutil.rmtree(path, ignore_errors=True)
        return folder

    def forget(self, session: str) -> None:
        """The session has ended (its tab closed): its saved model goes."""
        with self._lock:
            folder = self._folders.pop(session, None)
            self._owners.pop(session, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def owner(self, session: str) -> str | None:
        """The Hub account that saved `session`'s model (None: unknown, or nothing saved)."""
        with self._lock:
            return self._owners.get(session)

    def latest(self, session: str) -> Path | None:
        """The export folder `session` saved last (the one folder inside its save folder), None if none."""
        with self._lock:
            folder = self._folders.get(session)
            if folder is not None:
                self._folders.move_to_end(session)
        if folder is None or not folder.is_dir():
            return None
        exports = [p for p in folder.iterdir() if p.is_dir() and (p / "config.json").exists()]
        return exports[0] if len(exports) == 1 else None


SAVED = SavedModels()
