"""Output folders and files: checked before a run starts, written so that a crash or a full disk leaves nothing half-done.

- `check_writable_folder` creates an output folder and writes a probe file in it, so a run whose
  `--outdir` cannot be written is refused at once, not after minutes of work.
- `check_new_folder` refuses an export target that already holds files (an earlier export, or
  what an interrupted one left behind).
- `staged_file` writes under a hidden temporary name beside the target and renames it into place
  only once complete; on any failure the temporary file is removed. A full disk (or a file-size
  limit) becomes one `GhostedError` that says so.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # disk full, quota reached, file-size limit


def is_no_room(err: BaseException) -> bool:
    """True for the OSErrors of a full disk, a full quota or a file-size limit."""
    return isinstance(err, OSError) and err.errno in NO_ROOM


def no_room_error(err: OSError, what: str, where: str | Path) -> GhostedError:
    """The one message for a write that ran out of room; nothing partial is left (the callers clean up)."""
    return GhostedError(f"no room to write {what} in {where}: {err.strerror or 'the disk is full'}; nothing was "
                        "left half-written. Free some space or choose another folder, and run again")


def check_writable_folder(folder: str | Path, flag: str) -> Path:
    """Create `folder` (and its parents) and write a probe file in it; GhostedError naming `flag` when that fails."""
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise GhostedError(f"{flag} {folder} cannot be created or written ({err.strerror or type(err).__name__}); "
                           "choose a folder you can write to") from None
    return folder


def check_new_folder(folder: str | Path, flag: str) -> Path:
    """`folder` must not exist or be empty, and its parent must be writable: an export never mixes with older files."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise GhostedError(f"{flag} {folder} is a file; name a new or empty folder")
    if folder.is_dir():
        entries = sorted(p.name for p in folder.iterdir())
        if entries:
            interrupted = [name for name in entries if name.startswith(".")]
            why = (f"; {', '.join(interrupted[:2])} is what an interrupted export left behind" if interrupted else "")
            raise GhostedError(f"{flag} {folder} is not empty (it holds {', '.join(entries[:3])}"
                               f"{', …' if len(entries) > 3 else ''}){why}; name a new or empty folder, or remove it")
    check_writable_folder(folder.parent if not folder.exists() else folder, f"{flag} (its parent folder)")
    return folder


@contextmanager
def staged_file(path: str | Path, what: str) -> Iterator[Path]:
    """Yield a hidden temporary path beside `path`; once the block succeeds it is renamed to `path`.

    On any failure the temporary file is removed and `path` is left as it was; a full disk
    becomes a `GhostedError` (see `no_room_error`). `what` names the file in that message.
    """
    path = Path(path)
    staged = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.partial"  # created by the caller, with its usual mode
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield staged
        os.replace(staged, path)
    except OSError as err:
        staged.unlink(missing_ok=True)
        if is_no_room(err):
            raise no_room_error(err, what, path.parent) from None
        raise
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, what: str | None = None) -> Path:
    """Write `text` to `path` atomically (see `staged_file`)."""
    path = Path(path)
    with staged_file(path, what or path.name) as staged:
        staged.write_text(text, encoding="utf-8")
    return path
