"""Ghosted Layers Studio core: prune decoder blocks and recover them without training."""

from ghosted_core.errors import GhostedError

__all__ = ["GhostedError"]
