"""The disk a Hub download takes: checked against free space before it starts, and the cache kept under a cap.

A shared server downloads whatever model ids its visitors type, into huggingface_hub's cache,
which nothing else ever trims. `check_room` asks the Hub for the size of the files a load would
fetch (`HfApi.model_info(files_metadata=True)`) and refuses, before a byte moves, a download the
disk cannot hold (what is already cached does not count again). `trim` deletes whole cached
repositories, least recently used first, until the cache is under `cap_bytes`, never the one
just loaded. Both run only for models loaded from the Hub with a cap set (`LoadOptions.hub_cache_bytes`).
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from pathlib import Path

from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

FREE_MARGIN_BYTES = 2 * 2**30  # left free beside a download (logs, temporary files, the run's own outputs)


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def download_bytes(name: str, patterns: tuple[str, ...], token: str | bool | None) -> int:
    """Bytes of the files of Hub repo `name` that `patterns` select and the cache does not hold yet."""
    from huggingface_hub import HfApi

    info = HfApi(token=token).model_info(name, files_metadata=True, token=token)
    wanted = [s for s in info.siblings or [] if any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)]
    held = cache_root() / f"models--{name.replace('/', '--')}" / "snapshots" / str(info.sha or "")
    return sum(int(s.size or 0) for s in wanted if not (held / s.rfilename).exists())


def check_room(name: str, patterns: tuple[str, ...], token: str | bool | None) -> int:
    """Refuse a download of `name` that the cache's disk cannot hold beside FREE_MARGIN_BYTES; its bytes."""
    needed = download_bytes(name, patterns, token)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if needed + FREE_MARGIN_BYTES > free:
        raise GhostedError(f"{name} needs {_gb(needed)} of downloads and this server has {_gb(free)} free (keeping "
                           f"{_gb(FREE_MARGIN_BYTES)} spare); choose a smaller model")
    return needed


def trim(cap_bytes: int, keep: str) -> int:
    """Delete cached repositories, least recently used first, until the cache holds at most `cap_bytes`; never
    `keep` (the repo just loaded). Bytes freed."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache_root())
    total = info.size_on_disk
    freed = 0
    for repo in sorted(info.repos, key=lambda r: r.last_accessed):
        if total - freed <= cap_bytes:
            break
        if repo.repo_id == keep:
            continue
        info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
        freed += repo.size_on_disk
        log.info("Hub cache over %s: removed %s (%s, least recently used)", _gb(cap_bytes), repo.repo_id,
                 _gb(repo.size_on_disk))
    return freed
