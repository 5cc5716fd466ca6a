"""Ghosted Layers Studio core: prune decoder blocks and recover them without training."""

import os

# Before torch loads (when this package is imported first): idle OpenMP threads sleep instead of
# spinning. On a small machine whose cores are shared, spinning workers of two processes starve
# each other; measured here, a 576×576 svdvals took 6.5 s instead of 0.06 s next to another job.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ghosted_core.errors import GhostedError  # noqa: E402

__all__ = ["GhostedError"]
