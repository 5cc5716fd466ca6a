"""Exports under faults: a SIGKILL mid-export leaves no folder that loads, a full disk one message and no partial file.

The kills are real (the CLI process sends itself SIGKILL at a chosen point of the export); the
full disk is real for the CLI (a file-size limit, RLIMIT_FSIZE, makes the weights write fail
with EFBIG as a full disk fails with ENOSPC) and simulated in-process for the zip.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest

from conftest import recovered_variants
from ghosted_core.cli import main
from ghosted_core.errors import GhostedError
from ghosted_core.export import checkpoint
from ghosted_core.export.folder import archive_export, check_export_folder, export_variant, load_recovered

# The CLI, made to SIGKILL itself at one point of the export: "weights" half-way through the weights
# file, "config" half-way through config.json, "rename" once the folder is in place but before its
# config.json has its name.
KILLED_CLI = """
import os, signal, sys
from pathlib import Path
import ghosted_core.export.checkpoint as checkpoint
import ghosted_core.export.folder as folder
where = sys.argv[1]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "weights":
    real_write = checkpoint.write_safetensors
    def write_safetensors(filename, tensors, metadata):
        real_write(filename, tensors, metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        die()
    checkpoint.write_safetensors = write_safetensors
elif where == "config":
    real_json = folder.write_json
    def write_json(path, values):
        if path.name == folder.CONFIG_PENDING:
            path.write_text('{"model_type": "lla')
            die()
        real_json(path, values)
    folder.write_json = write_json
elif where == "rename":
    real_rename = Path.rename
    def rename(self, target):
        result = real_rename(self, target)
        if self.name.startswith(".") and self.parent != Path(target).parent or self.name == "model":
            die()
        return result
    Path.rename = rename
from ghosted_core.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cli_args(model_folder, tmp_path) -> list[str]:
    return ["--model", str(model_folder), "--pruning_method", "manual", "--layers", "2-3", "--insert_type", "none",
            "--calibration_data", "ptb", "--train_size", "2", "--seqlen", "32", "--eval_ppl", "none", "--quiet",
            "--outdir", str(tmp_path / "out"), "--save_model", str(tmp_path / "saved")]


LOADS_PLAINLY = """
import sys
from transformers import AutoModelForCausalLM
for folder in sys.argv[1:]:
    try:
        AutoModelForCausalLM.from_pretrained(folder)
    except Exception as err:
        print("refused", type(err).__name__)
    else:
        print("loaded", folder)
"""


def folders_under(root):
    return [p for p in [root, *root.rglob("*")] if p.is_dir()]


@pytest.mark.parametrize("where", ["weights", "config", "rename"])
def test_a_sigkill_during_save_model_leaves_no_folder_that_loads(tiny_model_folder, tmp_path, where, capsys):
    done = subprocess.run([sys.executable, "-c", KILLED_CLI, where, *cli_args(tiny_model_folder, tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    saved = tmp_path / "saved"
    left = folders_under(saved)
    assert len(left) >= 2  # the kill left something behind: what matters is that none of it loads
    for folder in left:
        with pytest.raises(GhostedError, match="not a complete exported model|incomplete export|not an exported"):
            load_recovered(folder)
    plain = subprocess.run([sys.executable, "-c", LOADS_PLAINLY, *map(str, left)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout.splitlines()
    assert len(plain) == len(left) and all(line.startswith("refused") for line in plain), plain
    assert main(cli_args(tiny_model_folder, tmp_path)) == 2  # the next run is refused at once, and says why
    err = capsys.readouterr().err
    assert "--save_model" in err and "is not empty" in err and "interrupted export left behind" in err


def test_a_truncated_or_partly_copied_export_is_refused_with_what_is_missing(tiny_llama, tmp_path):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    folder = export_variant(variants["ghost"], None, tmp_path / "ghost").folder
    assert check_export_folder(folder)["model_type"] == "ghosted_llama"
    weights = folder / "model.safetensors"
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "model.safetensors").write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(GhostedError, match="incomplete export: model.safetensors is 1,000 of"):
        load_recovered(copy)
    (copy / "model.safetensors").unlink()
    with pytest.raises(GhostedError, match="model.safetensors is missing"):
        load_recovered(copy)
    (copy / "config.json").unlink()
    with pytest.raises(GhostedError, match="no config.json"):
        check_export_folder(copy)


def limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_full_disk_during_save_model_is_one_message_and_leaves_no_partial_files(tiny_model_folder, tmp_path):
    """Files of at most 1 MB: results.json fits, the 7 MB weights file does not."""
    done = subprocess.run([sys.executable, "-m", "ghosted_core", *cli_args(tiny_model_folder, tmp_path)],
                          capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size(2**20),
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # (the token cache cannot be written either: a warning says so, and the run goes on without it)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: no room to write the none export in ") and "nothing was left" in lines[0]
    assert list((tmp_path / "saved").iterdir()) == []  # no staged folder, no shard, no half file
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.json"]


def test_a_full_disk_during_the_zip_is_one_message_and_leaves_no_file(tiny_llama, tmp_path, monkeypatch):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))
    real_write = zipfile.ZipFile.write

    def write(self, filename, arcname=None, *args, **kwargs):
        if str(filename).endswith(".safetensors"):
            self.fp.write(b"\0" * 4096)  # part of the file made it to disk, then the disk was full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, filename, arcname, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "write", write)
    with pytest.raises(GhostedError, match="no room to write the zip tiny.zip in .*nothing was left half-written"):
        archive_export(variants["ghost"], None, tmp_path / "downloads" / "tiny.zip")
    assert list((tmp_path / "downloads").iterdir()) == []


def test_a_full_disk_while_writing_the_weights_is_one_message_and_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    _plan, variants = recovered_variants(tiny_llama, (2, 3))

    def full(filename, tensors, metadata):
        with open(filename, "wb") as half:
            half.write(b"\0" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_safetensors", full)
    with pytest.raises(GhostedError, match="no room to write the ghost export"):
        export_variant(variants["ghost"], None, tmp_path / "saved" / "ghost")
    assert list((tmp_path / "saved").iterdir()) == []
