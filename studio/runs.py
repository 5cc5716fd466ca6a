"""Runs in progress, per browser session: what Stop stops, and where each run is.

A run registers itself when it starts computing and leaves when it ends; Stop sets the stop
event of its session's runs, which the library polls between batches (`should_stop`), and
waits a moment for them to end so that it can say where they stopped. A client that goes
away (a closed tab, a dropped connection) stops its run the same way (`client_gone`), so its
slot is free within one batch instead of at the end of the stage. Only small records live
here: what a run computes stays in the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


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


def client_gone(request) -> Callable[[], bool]:
    """A check that turns True once the client behind `request` (a gr.Request) has disconnected.

    Gradio notices a closed event stream within one heartbeat (GRADIO_HEARTBEAT_INTERVAL, which
    studio.settings sets to 2 s) and marks the session's jobs dead, but only stops a generator at its
    next yield, after the stage in progress. Polled as part of `should_stop`, this stops the run at
    its next batch instead. Without a queue to look at (a direct call) it never turns True.
    """
    session = getattr(request, "session_hash", None)
    try:
        queue = request.request.app.get_blocks()._queue
    except AttributeError:
        return lambda: False

    def gone() -> bool:
        jobs = [job for jobs in list(queue.active_jobs) if jobs for job in jobs if job.session_hash == session]
        if jobs and not any(job.alive for job in jobs):
            log.info("the client of session %s disconnected: stopping its run at the next batch", session)
            return True
        return False

    return gone
