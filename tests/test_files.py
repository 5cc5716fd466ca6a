"""Output folders checked before a run, and files written whole or not at all (a failure or a full disk leaves nothing)."""

from __future__ import annotations

import errno

import pytest

from ghosted_core.errors import GhostedError
from ghosted_core.files import check_new_folder, check_writable_folder, staged_file, write_text


def test_a_folder_under_a_file_cannot_be_an_output_folder_and_a_writable_one_is_created(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(GhostedError, match="--outdir .* cannot be created or written"):
        check_writable_folder(tmp_path / "a-file" / "out", "--outdir")
    made = check_writable_folder(tmp_path / "new" / "deeper", "--outdir")
    assert made.is_dir() and list(made.iterdir()) == []  # the probe file is gone


def test_an_export_target_must_be_new_or_empty_and_an_interrupted_export_is_named(tmp_path):
    assert check_new_folder(tmp_path / "fresh", "--save_model") == tmp_path / "fresh"
    (tmp_path / "empty").mkdir()
    check_new_folder(tmp_path / "empty", "--save_model")
    (tmp_path / "used" / ".ghost-k2j4").mkdir(parents=True)
    with pytest.raises(GhostedError, match="not empty .*interrupted export left behind"):
        check_new_folder(tmp_path / "used", "--save_model")


def test_a_failing_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = write_text(tmp_path / "results.json", "old")
    with pytest.raises(RuntimeError):
        with staged_file(target, "results.json") as staged:
            staged.write_text("half of the new")
            raise RuntimeError("killed midway")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    write_text(target, "new")
    assert target.read_text() == "new" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_is_one_message_and_leaves_nothing(tmp_path, code):
    with pytest.raises(GhostedError, match="no room to write results.json .*nothing was left half-written"):
        with staged_file(tmp_path / "results.json", "results.json") as staged:
            staged.write_bytes(b"x" * 100)
            raise OSError(code, "No space left on device")
    assert list(tmp_path.iterdir()) == []
