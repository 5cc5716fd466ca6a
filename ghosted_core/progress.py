"""Progress of long loops, reported by the stages and drawn by the front ends.

A stage wraps its loop in `track(items, "score swap_kl", total=252, unit="variants")` (or calls
`Tracker.advance` by hand). Each step hands a `ProgressEvent` (what, done of total, elapsed
seconds, an estimate of the time left) to the sink the front end installed for the run: the CLI
writes a line on stderr (`StderrSink`), the app shows it in its status panel. Without a sink a
tracker costs one context-variable read per step and reports nothing.

The sink is installed per run and per thread of execution, as a context variable:
`with reporting(sink): ...` around a call, or `reported(stages, sink)` around a generator of
stages, which sets it for each resumption (a front end may resume the generator from any
thread). `interleave` runs such a generator in a worker thread so that a caller blocked on a
long stage still receives its progress events, as items between the stage results.

Like `stopping.check_stop`, a sink runs between batches: a sink that raises (the app's, when its
client has gone) stops the run at that safe point.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO, TypeVar

T = TypeVar("T")

MIN_INTERVAL = 0.5  # seconds between two events of one tracker (its first and last always go out)


@dataclass(frozen=True)
class ProgressEvent:
    """How far one loop of a stage has come: `done` of `total` `unit`s after `elapsed` seconds."""

    what: str  # e.g. "score swap_kl", "calibrate", "perplexity ptb"
    done: int
    total: int | None  # None: unknown (no estimate)
    elapsed: float
    unit: str = ""

    @property
    def eta(self) -> float | None:
        """Seconds left at the mean pace so far; None before the first step or without a total."""
        if not self.total or self.done <= 0:
            return None
        return self.elapsed / self.done * max(self.total - self.done, 0)

    @property
    def fraction(self) -> float | None:
        return min(self.done / self.total, 1.0) if self.total else None

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def text(self) -> str:
        """'score swap_kl: 84 of 252 variants (33%) · 1:02 elapsed · about 2:04 left'."""
        unit = f" {self.unit}" if self.unit else ""
        count = (f"{self.done} of {self.total}{unit} ({self.fraction:.0%})" if self.total
                 else f"{self.done}{unit}")
        left = self.eta
        estimate = "" if left is None or self.finished else f" · about {duration(left)} left"
        return f"{self.what}: {count} · {duration(self.elapsed)} elapsed{estimate}"


Sink = Callable[[ProgressEvent], None]

PROGRESS = "progress"  # the stage name of a progress item among a run's (stage, result) items (`staged`)

_SINK: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("ghosted_progress_sink", default=None)


def duration(seconds: float) -> str:
    """'8 s', '2:04', '1:02:09'."""
    seconds = max(0, int(math.ceil(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Tracker:
    """One loop's progress: `advance(k)` after each step; events go to the sink at most every `MIN_INTERVAL`."""

    def __init__(self, what: str, total: int | None, unit: str = "", quiet: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.what, self.total, self.unit, self.done = what, total, unit, 0
        self.sink = None if quiet else _SINK.get()
        self.clock = clock
        self.start = clock()
        self.sent = -math.inf
        self._send(force=True)

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        self._send(force=self.total is not None and self.done >= self.total)

    def event(self) -> ProgressEvent:
        return ProgressEvent(self.what, self.done, self.total, self.clock() - self.start, self.unit)

    def _send(self, force: bool = False) -> None:
        if self.sink is None:
            return
        now = self.clock()
        if force or now - self.sent >= MIN_INTERVAL:
            self.sent = now
            self.sink(self.event())


def track(items: Iterable[T], what: str, total: int | None = None, unit: str = "", quiet: bool = False) -> Iterator[T]:
    """Yield `items`, reporting one step after each (the total from `len(items)` when not given)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    tracker = Tracker(what, total, unit, quiet)
    for item in items:
        yield item
        tracker.advance()


@contextlib.contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """Every tracker started inside reports to `sink` (None: to nobody)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def reported(stages: Iterator[T], sink: Sink | None) -> Iterator[T]:
    """`stages` (a run's generator), its trackers reporting to `sink` whichever thread resumes it."""
    try:
        while True:
            with reporting(sink):
                try:
                    item = next(stages)
                except StopIteration:
                    return
            yield item
    finally:
        if hasattr(stages, "close"):
            stages.close()


class _Closed(Exception):
    """The consumer of `interleave` stopped listening."""


def interleave(start: Callable[[Sink], Iterator[T]], every: float = 1.0,
               after: float = 2.0) -> Iterator[T | ProgressEvent]:
    """Run `start(sink)`'s generator in a worker thread; yield its items, and between them the newest
    `ProgressEvent` at most every `every` seconds once its loop has run `after` seconds, so that a long
    stage is not silent and a short one adds no update.

    Exceptions of the generator are raised here. When the caller closes this iterator, the worker
    stops at its next progress report or stage, whichever comes first.
    """
    items: queue.Queue = queue.Queue()
    latest: list[ProgressEvent | None] = [None]
    lock = threading.Lock()
    closed = threading.Event()
    done = object()

    def sink(event: ProgressEvent) -> None:
        if closed.is_set():
            raise _Closed()
        with lock:
            latest[0] = event

    def work() -> None:
        try:
            for item in reported(start(sink), sink):
                items.put(("item", item))
                if closed.is_set():
                    break
        except _Closed:
            pass
        except BaseException as err:  # noqa: BLE001 (handed to the consumer's thread and raised there)
            items.put(("error", err))
        items.put(("done", done))

    worker = threading.Thread(target=work, name="ghosted-run", daemon=True)
    worker.start()
    shown: ProgressEvent | None = None
    try:
        while True:
            try:
                kind, value = items.get(timeout=every)
            except queue.Empty:
                with lock:
                    event = latest[0]
                if event is not None and event != shown and event.elapsed >= after:
                    shown = event
                    yield event
                continue
            if kind == "done":
                return
            if kind == "error":
                raise value
            with lock:
                latest[0] = None  # a stage's result supersedes the progress inside it
            yield value
    finally:
        closed.set()


def staged(start: Callable[[Sink], Iterator[tuple[str, T]]], every: float = 1.0,
           after: float = 2.0) -> Iterator[tuple[str, T | ProgressEvent]]:
    """`interleave` for a run's (stage, result) generator: progress comes as (PROGRESS, event) items between them."""
    for item in interleave(start, every, after):
        yield (PROGRESS, item) if isinstance(item, ProgressEvent) else item


class StderrSink:
    """The CLI's rendering: one line per event on a terminal (rewritten in place), and on a log file
    a line at most every `interval` seconds per loop, and one when a loop that took long ends."""

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0, min_seconds: float = 2.0):
        self.stream = stream or sys.stderr
        self.interval, self.min_seconds = interval, min_seconds
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last: dict[str, float] = {}

    def __call__(self, event: ProgressEvent) -> None:
        if self.tty:
            end = "\n" if event.finished else ""
            self.stream.write(f"\r\033[K{event.text()}{end}")
            self.stream.flush()
            return
        previous = self.last.get(event.what)
        if event.done == 0 and not event.finished:
            self.last[event.what] = event.elapsed
            return
        due = previous is not None and event.elapsed - previous >= self.interval
        if due or (event.finished and event.elapsed >= self.min_seconds):
            self.last[event.what] = event.elapsed
            self.stream.write(event.text() + "\n")
            self.stream.flush()
