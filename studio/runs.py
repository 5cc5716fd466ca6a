"""Runs in progress, per browser session: what Stop stops, and where each run is.

A run registers itself when it starts computing and leaves when it ends; Stop sets the stop
event of its session's runs, which the library polls between batches (`should_stop`), and
waits a moment for them to end so that it can say where they stopped. Only small records
live here: what a run computes stays in the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class ActiveRun:
    """One run computing for a session."""

    session: str
    stages: list[str]  # planned stage names, in order
    stop: threading.Event = field(default_factory=threading.Event)  # set by Stop; polled by the library
    ended: threading.Event = field(default_factory=threading.Event)  # set once the run stops computing
    started: float = field(default_factory=time.perf_counter)
    done: int = 0  # stages finished
    report: dict | None = None  # the snapshot yielded last (what the page shows of this run)
    stopped_at: str | None = None  # the stage the library stopped in, once it has
    settings: dict = field(default_factory=dict)  # the widget values it was started with (for the session history)

    @property
    def current(self) -> str:
        """The stage computing now (the last one once all are done)."""
        return self.stages[min(self.done, len(self.stages) - 1)]

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class RunRegistry:
    """Active runs by session id; thread-safe."""

    def __init__(self) -> None:
        self._runs: dict[str, list[ActiveRun]] = {}
        self._lock = threading.Lock()

    def start(self, session: str, stages: list[str]) -> ActiveRun:
        run = ActiveRun(session, stages)
        with self._lock:
            self._runs.setdefault(session, []).append(run)
        return run

    def end(self, run: ActiveRun) -> None:
        """The run has stopped computing (finished, failed or stopped); safe to call twice."""
        run.ended.set()
        with self._lock:
            runs = self._runs.get(run.session, [])
            if run in runs:
                runs.remove(run)
            if not runs:
                self._runs.pop(run.session, None)

    def stop(self, session: str) -> list[ActiveRun]:
        """Ask every run of `session` to stop at its next safe point; the runs asked."""
        with self._lock:
            runs = list(self._runs.get(session, []))
        for run in runs:
            run.stop.set()
        return runs

    def active(self) -> int:
        with self._lock:
            return sum(len(runs) for runs in self._runs.values())


RUNS = RunRegistry()
