"""Out of memory: recognised, what the failed stage held freed, and turned into a `GhostedError` naming the way out.

A run that asks for more memory than the machine has raises deep inside torch (CUDA's
`OutOfMemoryError`, the CPU allocator's "not enough memory" RuntimeError, or Python's
`MemoryError`). `guard_stages` wraps a run's stage generator: such an error becomes one
message that says which settings shrink the run, after the traceback's frames (which hold the
stage's tensors) are cleared and the allocator's cache is emptied, so the next run starts with
that memory back. Flag names are the CLI's; the app maps them to its widget labels.
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from collections.abc import Iterator
from typing import TypeVar

from ghosted_core.errors import GhostedError
from ghosted_core.progress import PROGRESS

log = logging.getLogger(__name__)

T = TypeVar("T")

ALLOCATOR_MESSAGES = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")
WAY_OUT = ("fewer or shorter calibration sequences (--train_size, --seqlen), a smaller --batch_size, fewer operators "
           "(--insert_type), fewer perplexity tokens (--eval_max_tokens), or a smaller model; a model larger than the "
           "GPU fits with --calibration_pipeline blocks or --device map")


def is_out_of_memory(err: BaseException) -> bool:
    """True for an allocation failure from Python or torch (CPU or GPU)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and any(text in str(err).lower() for text in ALLOCATOR_MESSAGES)


def free_memory(err: BaseException | None = None) -> None:
    """Drop what a failed stage held: its traceback's frames, unreachable objects, the GPU allocator's cache."""
    if err is not None and err.__traceback__ is not None:
        traceback.clear_frames(err.__traceback__)
        err.__traceback__ = None
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory_error(where: str) -> GhostedError:
    return GhostedError(f"out of memory {where}: what the run held is freed; try {WAY_OUT}")


def guard_stages(stages: Iterator[tuple[str, T]], first: str) -> Iterator[tuple[str, T]]:
    """Yield from a run's (stage, result) generator; an out-of-memory error becomes `out_of_memory_error`.

    `first`: the name of the first stage (the one computing before anything was yielded).
    """
    where = f"during {first}"
    failed = None
    try:
        for stage, result in stages:
            where = where if stage == PROGRESS else f"after {stage}"
            yield stage, result
    except BaseException as err:  # noqa: BLE001 (re-raised unless it is an allocation failure)
        if not is_out_of_memory(err):
            raise
        log.warning("out of memory %s: %s", where, str(err).splitlines()[0] if str(err) else type(err).__name__)
        free_memory(err)
        failed = out_of_memory_error(where)
    if failed is not None:  # raised outside the except block, so the error does not keep the old one alive
        stages.close()
        raise failed
