"""The progress reporter: counts, estimates, throttling, the sink per run and per thread, and the CLI's line."""

from __future__ import annotations

import io
import threading
import time

import pytest

from ghosted_core import progress
from ghosted_core.progress import ProgressEvent, StderrSink, Tracker, duration, interleave, reported, reporting, track


class Clock:
    """A hand-moved clock."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_event_counts_and_estimates_the_time_left_from_the_pace_so_far():
    event = ProgressEvent("score swap_kl", 84, 252, 42.0, "variants")
    assert event.eta == pytest.approx(84.0)  # 0.5 s a variant, 168 left
    assert event.fraction == pytest.approx(1 / 3) and not event.finished
    assert event.text() == "score swap_kl: 84 of 252 variants (33%) · 42 s elapsed · about 1:24 left"
    assert ProgressEvent("calibrate", 0, 12, 3.0).eta is None  # no pace yet
    assert ProgressEvent("tasks", 3, None, 3.0).eta is None and "3 · 3 s elapsed" in ProgressEvent("tasks", 3, None, 3.0).text()
    done = ProgressEvent("calibrate", 12, 12, 30.0, "batches")
    assert done.finished and done.eta == 0.0 and "left" not in done.text()
    assert [duration(s) for s in (0.2, 59, 60, 125, 3729)] == ["1 s", "59 s", "1:00", "2:05", "1:02:09"]


def test_a_tracker_reports_its_first_and_last_step_and_at_most_one_event_per_interval_between():
    clock, events = Clock(), []
    with reporting(events.append):
        tracker = Tracker("perplexity ptb", 10, "batches", clock=clock)
        for _ in range(10):
            clock.now += 0.2  # 0.2 s a step: every third step is 0.5 s after the last event
            tracker.advance()
    assert [e.done for e in events] == [0, 3, 6, 9, 10]
    assert events[-1].elapsed == pytest.approx(2.0) and events[-1].finished
    assert events[3].eta == pytest.approx(0.2)  # 1.8 s for 9, one left


def test_quiet_or_no_sink_reports_nothing_and_track_counts_each_item():
    events = []
    with reporting(events.append):
        assert list(track(range(3), "calibrate", quiet=True)) == [0, 1, 2]
        assert list(track(iter("ab"), "generate")) == ["a", "b"]  # no len: an unknown total
    assert list(track(range(2), "nobody listens")) == [0, 1]
    assert [(e.done, e.total) for e in events] == [(0, None), (1, None), (2, None)][: len(events)]
    assert events[0].what == "generate"


def test_a_generator_reports_to_its_sink_whichever_thread_resumes_it():
    events = []

    def stages():
        for stage in ("one", "two"):
            list(track(range(2), stage))
            yield stage

    run = reported(stages(), events.append)
    first = next(run)
    second = []
    thread = threading.Thread(target=lambda: second.append(next(run)))
    thread.start()
    thread.join()
    assert (first, second) == ("one", ["two"])
    assert {e.what for e in events} == {"one", "two"} and events[-1].finished
    assert progress._SINK.get() is None  # nothing left installed between resumptions


def test_interleave_yields_progress_while_a_stage_runs_and_raises_its_errors():
    def start(_sink):
        yield "load model"
        for _ in track(range(4), "score swap_kl", unit="variants"):
            time.sleep(0.3)
        yield "score swap_kl"

    items = list(interleave(start, every=0.1, after=0.0))
    assert items[0] == "load model" and items[-1] == "score swap_kl"
    between = [i for i in items[1:-1] if isinstance(i, ProgressEvent)]
    assert between and all(e.what == "score swap_kl" for e in between) and len(between) == len(items) - 2
    assert between[-1].done >= 1 and between[-1].eta is not None

    def broken(_sink):
        yield "load model"
        raise ValueError("bug")

    slow = list(interleave(start, every=0.1, after=5.0))
    assert slow == ["load model", "score swap_kl"]  # a loop shorter than `after` adds no update

    with pytest.raises(ValueError, match="bug"):
        list(interleave(broken, every=0.1))


def test_closing_interleave_stops_the_worker_at_its_next_report():  # within MIN_INTERVAL
    steps = []

    def start(_sink):
        yield "load model"
        for k in track(range(1000), "calibrate"):
            steps.append(k)
            time.sleep(0.01)
        yield "calibrate"

    items = interleave(start, every=0.05)
    assert next(items) == "load model"
    items.close()
    time.sleep(2 * progress.MIN_INTERVAL)
    count = len(steps)
    time.sleep(0.3)
    assert len(steps) == count < 1000  # the worker stopped


def test_the_cli_line_says_count_and_estimate_every_interval_and_when_a_long_loop_ends():
    stream = io.StringIO()
    sink = StderrSink(stream, interval=10.0, min_seconds=2.0)
    for done, elapsed in [(0, 0.0), (10, 5.0), (30, 12.0), (50, 16.0), (60, 23.0), (252, 90.0)]:
        sink(ProgressEvent("score swap_kl", done, 252, elapsed, "variants"))
    lines = stream.getvalue().splitlines()
    assert lines == ["score swap_kl: 30 of 252 variants (12%) · 12 s elapsed · about 1:29 left",
                     "score swap_kl: 60 of 252 variants (24%) · 23 s elapsed · about 1:14 left",
                     "score swap_kl: 252 of 252 variants (100%) · 1:30 elapsed"]
    quick = io.StringIO()
    StderrSink(quick)(ProgressEvent("fit operators", 6, 6, 0.4, "fits"))
    assert quick.getvalue() == ""  # a loop shorter than min_seconds says nothing
