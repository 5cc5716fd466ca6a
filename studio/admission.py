"""Who may take a place in the run queue: each visitor a fair share, and no request that would be refused.

A public server has one queue (GHOSTED_APP_QUEUE places) and few workers. Without limits one
stranger fills every place from made-up session ids, or with requests the run refuses only when
it reaches the front. Here:
- Per session and per client address, at most RUNS_PER_SESSION and RUNS_PER_ADDRESS runs queued or
  running at once (counted in Gradio's own queue, so nothing leaks when a client drops).
- Every check that needs no weights runs before a request takes a place: the same checks as the
  run itself (`handlers.prepare_run`), in Gradio's event `validator`, which Gradio calls before it
  queues the event (`Queue.push`), and in the page's own Run press, which shows the refusal in
  the status panel.
- A run whose planned time exceeds the operator's budget (`studio.settings.run_budget_seconds`) is
  refused up front with the estimate and the setting to lower (`planning.estimate.check_work_budget`).

The client address is the socket's, or on a Space the first X-Forwarded-For entry that its proxy
sets (GHOSTED_APP_TRUST_FORWARDED=1 trusts that header elsewhere, e.g. behind one's own proxy).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable

import gradio as gr

from ghosted_core.errors import GhostedError
from studio.handlers import on_run, prepare_run, rerun_values
from studio.outputs import INPUT_NAMES, page_message
from studio.status import refused_status

log = logging.getLogger(__name__)

RUNS_PER_SESSION = int(os.environ.get("GHOSTED_APP_RUNS_PER_SESSION", "1"))
RUNS_PER_ADDRESS = int(os.environ.get("GHOSTED_APP_RUNS_PER_ADDRESS", "4"))
RUN_QUEUE = "run"  # the concurrency id of every event that runs the pipeline (Run, rerun on your text)
RUN_INPUT_COUNT = len(INPUT_NAMES) + 3  # a run event's inputs: the widgets, then submitted, shown and history


def trust_forwarded() -> bool:
    """Whether X-Forwarded-For names the client: on a Space (its proxy sets it), or where the operator says."""
    value = os.environ.get("GHOSTED_APP_TRUST_FORWARDED", "").strip().lower()
    return value in ("1", "true", "yes", "on") or (value == "" and bool(os.environ.get("SPACE_ID")))


def client_host(forwarded_for: str, socket_host: str) -> str:
    """The client's address from the X-Forwarded-For header (when trusted) and the socket's peer."""
    forwarded = forwarded_for.split(",")[0].strip() if trust_forwarded() else ""
    return forwarded or socket_host or ""


def client_address(request: gr.Request | None) -> str:
    """The client's address as this server can tell it ('' when unknown)."""
    if request is None:
        return ""
    client = getattr(request, "client", None)
    return client_host(request.headers.get("x-forwarded-for") or "", getattr(client, "host", "") or "")


def _events(queue) -> list:
    """The run events queued or running now, from Gradio's queue."""
    events = []
    for event_queue in getattr(queue, "event_queue_per_concurrency_id", {}).values():
        events += [e for e in event_queue.queue if e.concurrency_id == RUN_QUEUE]
    for batch in getattr(queue, "active_jobs", []) or []:
        events += [e for e in batch or [] if e.concurrency_id == RUN_QUEUE]  # a finished batch leaves
    return events


def session_runs(queue, session: str) -> int:
    """Runs of `session` queued or running now."""
    return sum(e.session_hash == session for e in _events(queue))


def _queue_of(request: gr.Request) -> object | None:
    app = getattr(getattr(request, "request", None), "app", None)
    blocks = app.get_blocks() if app is not None and hasattr(app, "get_blocks") else None
    return getattr(blocks, "_queue", None)


def held_by(request: gr.Request | None) -> tuple[int, int]:
    """(runs of this session, runs of this client address) queued or running now."""
    queue = _queue_of(request) if request is not None else None
    if queue is None:
        return 0, 0
    session, address = request.session_hash, client_address(request)
    events = _events(queue)
    mine = sum(e.session_hash == session for e in events)
    same_address = sum(bool(address) and client_address(_as_request(e)) == address for e in events)
    return mine, same_address


def _as_request(event) -> gr.Request:
    return gr.Request(request=event.request, session_hash=event.session_hash)


def check_share(request: gr.Request | None) -> None:
    """Refuse a run beyond this session's or this address's share of the queue (GhostedError, with what to do)."""
    mine, same_address = held_by(request)
    if mine >= RUNS_PER_SESSION:
        raise GhostedError(f"you already have {mine} run{'s' * (mine > 1)} waiting or running on this server (at "
                           f"most {RUNS_PER_SESSION} per visitor): wait for it to finish, or press Stop")
    if same_address >= RUNS_PER_ADDRESS:
        raise GhostedError(f"{same_address} runs from your address are waiting or running on this server (at most "
                           f"{RUNS_PER_ADDRESS}): try again when one has finished")


def admit(values: dict, request: gr.Request | None) -> None:
    """Whether a run may take a place in the queue: this visitor's share of it, then every check of the run that
    needs no weights (`handlers.prepare_run`). GhostedError when not."""
    check_share(request)
    prepare_run(values, request.session_hash if request else "")


def _admission(prepare: Callable[[dict], dict]) -> tuple[Callable, Callable]:
    """(the Run press's first step, the run event's validator) for runs whose arguments `prepare` makes from
    on_run's; both take on_run's parameters, so Gradio passes them the Run inputs and the request by name."""

    def submit(*args, **kwargs) -> tuple[float | None, str]:
        """Run pressed: a refusal shows in the status (the validator then refuses the run event with the same
        message); else note the time (queueing counts apart from running) and say the run waits."""
        values = inspect.signature(on_run).bind(*args, **kwargs).arguments
        try:
            admit(prepare(values), values.get("request"))
        except Exception as err:  # GhostedError, or a bug the validator logs and refuses in words
            message = page_message(err) if isinstance(err, GhostedError) else "the server could not check this request"
            return None, refused_status(message, values.get("shown"))
        return time.time(), "**Queued:** waiting for the server to start your run…"

    def validator(*args, **kwargs) -> list[dict]:
        """Called by Gradio before the event takes a place in the queue (`Queue.push`): a request the run would
        refuse, or one beyond the visitor's share, never holds a place. Answered as Gradio answers a validator,
        one verdict per input: HTTP 422 with the message on the first (gradio_client raises ValidationError
        with it; the page has shown it in the status already)."""
        values = inspect.signature(on_run).bind(*args, **kwargs).arguments
        message = ""
        try:
            admit(prepare(values), values.get("request"))
        except GhostedError as err:
            message = page_message(err)
        except Exception:  # a bug of ours: logged, and the request refused with a plain message
            log.exception("checking a run request failed")
            message = "the server could not check this request (an internal error, logged)"
        return [gr.validate(not message, message)] + [gr.validate(True, "")] * (RUN_INPUT_COUNT - 1)

    for fn in (submit, validator):
        fn.__signature__ = inspect.signature(on_run)
        fn.__annotations__ = dict(on_run.__annotations__) | {"return": None}
    return submit, validator


on_submit, check_run = _admission(lambda values: values)
on_submit_rerun, check_rerun = _admission(rerun_values)
