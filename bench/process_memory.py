"""This process's memory as Linux reports it, for the bench scripts: resident size, a /proc/self/status field,
the peak reset, and a sampler for the peak of a block of code."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status in bytes (VmRSS: resident size; VmHWM: its peak; RssAnon: anonymous memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident size (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakSampler:
    """The highest value of `read` (a memory size) while the context is open, sampled in a thread every
    `interval` seconds and once more on exit; `extra` is that peak above the value on entry."""

    def __init__(self, read: Callable[[], int] = rss_bytes, interval: float = 0.02):
        self.read, self.interval = read, interval

    def __enter__(self) -> PeakSampler:
        self.base = self.peak = self.read()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def blas_kept_bytes() -> int | None:
    """Bytes Intel MKL's own allocator keeps now (its packing buffers, per thread: `mkl_serv_mem_stat`), the
    host allocator's residue that the memory plan declares (`memory_parts.allocator_residue_bytes`); None where
    torch's CPU BLAS is not MKL. Import torch first."""
    import ctypes
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        stat = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).mkl_serv_mem_stat
    except (OSError, AttributeError):
        return None
    stat.restype = ctypes.c_int64
    buffers = ctypes.c_int(0)
    return int(stat(ctypes.byref(buffers)))
