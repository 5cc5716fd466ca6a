"""Unpacking an export's zip (the app's download) safely, whoever made the archive.

`folder.zip_export` stores files uncompressed under one folder named after the zip. An archive
handed back to the server (the app's upload button) may be anything: a zip bomb, members named
`../../etc/passwd` or `/abs`, thousands of entries, or entries that overlap in the file so a small
archive unpacks to gigabytes. `unpack_export` refuses all of these before writing a byte: only
uncompressed members, relative names inside one top folder, and member sizes that add up to no
more than the archive itself (which a zip of uncompressed, non-overlapping files always does).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path, PurePosixPath

from ghosted_core.errors import GhostedError

MAX_MEMBERS = 1000  # an export holds a dozen files, a sharded one a few hundred


def _refuse(path: Path, why: str) -> GhostedError:
    return GhostedError(f"{path.name} is not a model zip this app wrote ({why}); save the model again and upload that")


def check_archive(path: str | Path) -> str:
    """The top folder name of an export zip; GhostedError for anything `unpack_export` would not unpack."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise _refuse(path, f"not a readable zip: {err}") from None
    if not members or len(members) > MAX_MEMBERS:
        raise _refuse(path, f"{len(members)} entries")
    tops = set()
    for member in members:
        name = PurePosixPath(member.filename)
        if name.is_absolute() or ".." in name.parts or "\\" in member.filename or len(name.parts) < 2 - member.is_dir():
            raise _refuse(path, f"an entry named {member.filename[:80]!r}")
        if member.compress_type != zipfile.ZIP_STORED:
            raise _refuse(path, "compressed entries")
        tops.add(name.parts[0])
    if len(tops) != 1:
        raise _refuse(path, "more than one top folder")
    if sum(m.file_size for m in members) > path.stat().st_size:  # entries overlap: a zip bomb
        raise _refuse(path, "its entries add up to more than the archive holds")
    return tops.pop()


def unpack_export(path: str | Path, folder: str | Path) -> Path:
    """Unpack an export zip into `folder` after `check_archive`; the unpacked model folder.

    Memory: one copy buffer; disk: at most the archive's own size.
    """
    top = check_archive(path)
    folder = Path(folder)
    with zipfile.ZipFile(path) as archive:
        for member in archive.infolist():
            target = folder.joinpath(*PurePosixPath(member.filename).parts)
            if member.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
    return folder / top
