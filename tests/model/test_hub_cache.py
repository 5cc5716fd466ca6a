"""The Hub cache on a shared server: a download checked against free disk before it starts, the cache trimmed
least recently used first, and both wired into load_model for models that come from the Hub."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ghosted_core.errors import GhostedError
from ghosted_core.model import hub_cache, loading


def cached_repo(root: Path, repo_id: str, files: dict[str, bytes], accessed: float) -> Path:
    """A repository laid out as huggingface_hub caches it (blobs, a snapshot of links, refs/main)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        os.utime(blob, (accessed, accessed))
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def hub_root(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def test_the_cache_is_trimmed_least_recently_used_first_and_never_the_model_just_loaded(hub_root):
    now = time.time()
    for k, repo in enumerate(["org/oldest", "org/older", "org/recent", "org/just-loaded"]):
        cached_repo(hub_root, repo, {"model.safetensors": bytes([k]) * 300_000}, accessed=now - 1000 * (4 - k))
    os.utime(next((hub_root / "models--org--just-loaded" / "blobs").iterdir()), (now - 10**6, now - 10**6))
    freed = hub_cache.trim(cap_bytes=650_000, keep="org/just-loaded")
    left = sorted(p.name for p in hub_root.iterdir())
    assert left == ["models--org--just-loaded", "models--org--recent"] and freed == 600_000


def test_a_download_the_disk_cannot_hold_is_refused_before_it_starts_and_cached_files_do_not_count(hub_root,
                                                                                                  monkeypatch):
    import huggingface_hub

    snapshot = cached_repo(hub_root, "org/big", {"config.json": b"{}"}, accessed=time.time())
    siblings = [SimpleNamespace(rfilename="config.json", size=2), SimpleNamespace(rfilename="model.safetensors",
                                                                                  size=6 * 10**9),
                SimpleNamespace(rfilename="model.gguf", size=9 * 10**9)]  # not a file a load fetches

    class Api:
        def __init__(self, token=None):
            self.token = token

        def model_info(self, name, files_metadata=False, token=None):
            return SimpleNamespace(siblings=siblings, sha=snapshot.name)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    assert hub_cache.download_bytes("org/big", loading.HUB_MODEL_FILES, False) == 6 * 10**9
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=7 * 10**9, total=0, used=0))
    with pytest.raises(GhostedError, match=r"org/big needs 6.0 GB of downloads and this server has 7.0 GB free"):
        hub_cache.check_room("org/big", loading.HUB_MODEL_FILES, False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=9 * 10**9, total=0, used=0))
    assert hub_cache.check_room("org/big", loading.HUB_MODEL_FILES, False) == 6 * 10**9


def test_load_model_checks_room_then_trims_the_cache_for_a_model_from_the_hub(hub_root, tiny_model_folder,
                                                                             monkeypatch):
    import huggingface_hub

    now = time.time()
    cached_repo(hub_root, "org/stale", {"model.safetensors": b"s" * 400_000}, accessed=now - 10**5)
    calls = []

    def download(repo_id, allow_patterns=(), token=None, **kwargs):  # the Hub: the tiny model, into the cache
        calls.append(("download", tuple(allow_patterns)))
        files = {p.name: p.read_bytes() for p in Path(tiny_model_folder).iterdir()
                 if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in allow_patterns)}
        return str(cached_repo(hub_root, repo_id, files, accessed=time.time()))

    monkeypatch.setattr(loading, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(hub_cache, "check_room", lambda name, patterns, token: calls.append(("room", name)) or 0)
    loaded = loading.load_model("org/tiny", loading.LoadOptions(local_folders=False, hub_token=False,
                                                                hub_cache_bytes=1))
    assert loaded.num_layers > 0 and calls[0][0] == "download" and calls[1] == ("room", "org/tiny")
    assert calls[2][0] == "download" and not (hub_root / "models--org--stale").exists()  # trimmed after the load
    assert (hub_root / "models--org--tiny").is_dir()
