"""Stopping a run at the next safe point, on the caller's word.

A front end (the app's Stop button) passes a `should_stop` callable, e.g. a
`threading.Event().is_set`; long loops poll it between batches or variants and raise
`RunStopped`, so the server stops computing within one batch instead of finishing the stage.
The library knows nothing of the front end: any callable returning True works.
"""

from __future__ import annotations

from collections.abc import Callable

StopCheck = Callable[[], bool] | None  # None: the run cannot be stopped early


class RunStopped(Exception):
    """The caller asked the run to stop; raised between batches or stages, never mid-batch.

    Not a `GhostedError`: nothing was wrong with the input. `where` names the stage it stopped in.
    """

    def __init__(self, where: str):
        super().__init__(f"stopped during {where}")
        self.where = where


def check_stop(should_stop: StopCheck, where: str) -> None:
    """Raise `RunStopped(where)` when the caller has asked to stop."""
    if should_stop is not None and should_stop():
        raise RunStopped(where)
