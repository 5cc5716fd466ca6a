"""Unpacking a model zip handed back to the server: an export's own zip unpacks; bombs and escaping names never do."""

from __future__ import annotations

import re
import struct
import zipfile
import zlib

import pytest

from conftest import recovered_variants
from ghosted_core.errors import GhostedError
from ghosted_core.export.archive import MAX_MEMBERS, check_archive, unpack_export
from ghosted_core.export.folder import archive_export, check_export_folder


def overlapping_bomb(path, copies: int = 400, size: int = 100_000) -> None:
    """One stored 100 kB file that `copies` central-directory entries all point at: 100 kB on disk, 40 MB unpacked."""
    data = b"\0" * size
    crc = zlib.crc32(data)
    name = b"m/0"
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, size, size, len(name), 0) + name + data
    central = b""
    for k in range(copies):
        entry = f"m/{k}".encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc, size, size, len(entry),
                               0, 0, 0, 0, 0, 0) + entry
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, copies, copies, len(central), len(local), 0)
    path.write_bytes(local + central + end)


def test_an_export_zip_unpacks_to_a_complete_folder(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    archive = archive_export(variants["none"], None, tmp_path / "tiny-none.zip").archive
    folder = unpack_export(archive, tmp_path / "out")
    assert folder == tmp_path / "out" / "tiny-none" and check_export_folder(folder)["num_hidden_layers"] == 4


def test_zip_bombs_and_escaping_names_are_refused_before_anything_is_written(tmp_path):
    overlapping_bomb(tmp_path / "overlap.zip")
    with zipfile.ZipFile(tmp_path / "overlap.zip") as bomb:  # 400 entries declare 40 MB over 100 kB of data
        assert sum(m.file_size for m in bomb.infolist()) == 400 * 100_000 and bomb.read("m/0") == b"\0" * 100_000
    with zipfile.ZipFile(tmp_path / "deflate.zip", "w", compression=zipfile.ZIP_DEFLATED) as zipped:
        zipped.writestr("m/zeros", b"\0" * 20_000_000)  # 20 MB of zeros in ~20 kB
    with zipfile.ZipFile(tmp_path / "escape.zip", "w") as zipped:
        zipped.writestr("m/config.json", "{}")
        zipped.writestr("../../outside.txt", "written outside")
    with zipfile.ZipFile(tmp_path / "absolute.zip", "w") as zipped:
        zipped.writestr(zipfile.ZipInfo("/tmp/absolute.txt"), "absolute")
    with zipfile.ZipFile(tmp_path / "many.zip", "w") as zipped:
        for k in range(MAX_MEMBERS + 1):
            zipped.writestr(f"m/{k}", "")
    with zipfile.ZipFile(tmp_path / "two.zip", "w") as zipped:
        zipped.writestr("a/config.json", "{}")
        zipped.writestr("b/config.json", "{}")
    (tmp_path / "text.zip").write_text("not a zip at all")
    reasons = {"overlap": "its entries add up to more than the archive", "deflate": "compressed entries",
               "escape": "an entry named '../../outside.txt'", "absolute": "an entry named '/tmp/absolute.txt'",
               "many": f"{MAX_MEMBERS + 1} entries", "two": "more than one top folder", "text": "not a readable zip"}
    for name, reason in reasons.items():
        with pytest.raises(GhostedError, match=re.escape(f"not a model zip this app wrote ({reason}")):
            unpack_export(tmp_path / f"{name}.zip", tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists(), name
    assert not (tmp_path.parent / "outside.txt").exists()
    with pytest.raises(GhostedError):
        check_archive(tmp_path / "missing.zip")
