"""Who may take a place in the run queue: each visitor a fair share, and no request that would be refused.

A public server has one queue (GHOSTED_APP_QUEUE places) and few workers. Without limits one
stranger fills every place from made-up session ids, or with requests the run refuses only when
it reaches the front. Here:
- Per session and per client address, at most RUNS_PER_SESSION and RUNS_PER_ADDRESS runs queued or
  running at once, and at most the queue's size waiting in all. Checked and claimed atomically
  (`guard_queue`): a request's check and its claim happen under one lock, before Gradio's `Queue.push`
  runs the validator and queues it; the claim counts until the push returns, after which the event is
  counted in Gradio's own queue and active jobs, which let it go on completion, cancel or disconnect
  (so nothing leaks when a client drops). Simultaneous requests therefore cannot all pass one check.
- Every check that needs no weights runs before a request takes a place: the same checks as the
  run itself (`handlers.prepare_run`), in Gradio's event `validator`, which Gradio calls before it
  queues the event (`Queue.push`), and in the page's own Run press, which shows the refusal (and the
  visitor's share) in the status panel.
- A run whose planned time exceeds the operator's budget (`studio.settings.run_budget_seconds`) is
  refused up front with the estimate and the setting to lower (`planning.estimate.check_work_budget`).

The client address is the one the proxy vouches for (`studio.addresses`: X-Forwarded-For read from the
right, on a Space or where the operator trusts it), else the socket's.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import gradio as gr
from gradio import route_utils
from gradio.queueing import process_validation_response

from ghosted_core.errors import GhostedError
from studio.addresses import client_host
from studio.handlers import on_run, prepare_run, rerun_values
from studio.outputs import INPUT_NAMES, page_message
from studio.status import refused_status

log = logging.getLogger(__name__)

RUNS_PER_SESSION = int(os.environ.get("GHOSTED_APP_RUNS_PER_SESSION", "1"))
RUNS_PER_ADDRESS = int(os.environ.get("GHOSTED_APP_RUNS_PER_ADDRESS", "4"))
RUN_QUEUE = "run"  # the concurrency id of every event that runs the pipeline (Run, rerun on your text)
RUN_INPUT_COUNT = len(INPUT_NAMES) + 3  # a run event's inputs: the widgets, then submitted, shown and history


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


def address_of(request) -> str:
    """The client address of a Starlette request (an event's), as `client_address` tells it."""
    client = getattr(request, "client", None)
    headers = getattr(request, "headers", None) or {}
    return client_host(headers.get("x-forwarded-for") or "", getattr(client, "host", "") or "")


def _queue_of(request: gr.Request) -> object | None:
    app = getattr(getattr(request, "request", None), "app", None)
    blocks = app.get_blocks() if app is not None and hasattr(app, "get_blocks") else None
    return getattr(blocks, "_queue", None)


def held_by(request: gr.Request | None) -> tuple[int, int]:
    """(runs of this session, runs of this client address) queued or running now."""
    queue = _queue_of(request) if request is not None else None
    if queue is None:
        return 0, 0
    return _held(queue, request.session_hash, client_address(request))


def _held(queue, session: str | None, address: str) -> tuple[int, int]:
    events = _events(queue)
    mine = sum(session is not None and e.session_hash == session for e in events)
    same_address = sum(bool(address) and address_of(e.request) == address for e in events)
    return mine, same_address


def share_refusal(mine: int, same_address: int) -> str:
    """Why one more run is beyond this session's or this address's share of the queue ('' when it is not)."""
    if mine >= RUNS_PER_SESSION:
        return (f"you already have {mine} run{'s' * (mine > 1)} waiting or running on this server (at most "
                f"{RUNS_PER_SESSION} per visitor): wait for it to finish, or press Stop")
    if same_address >= RUNS_PER_ADDRESS:
        return (f"{same_address} runs from your address are waiting or running on this server (at most "
                f"{RUNS_PER_ADDRESS}): try again when one has finished")
    return ""


def check_share(request: gr.Request | None) -> None:
    """Refuse a run beyond this session's or this address's share of the queue (GhostedError, with what to do). The
    page's Run press shows it; the queue itself holds the share atomically (`guard_queue`)."""
    message = share_refusal(*held_by(request))
    if message:
        raise GhostedError(message)


class Claims:
    """Places claimed in the queue by requests between their check and Gradio's `Queue.push` returning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str | None, str, bool]] = {}  # token → (session, address, whether a run)
        self._tokens = itertools.count()

    def claim(self, queue, session: str | None, address: str, run: bool) -> tuple[int | None, str, str]:
        """(token, '', '') when a place is free, and it is taken; else (None, Gradio's push state, the refusal)."""
        with self._lock:
            pending = list(self._pending.values())
            size = getattr(queue, "max_size", None)
            if size is not None and len(queue) + len(pending) >= size:
                return None, "queue_full", (f"the server's queue is full ({size} waiting): try again in a few "
                                            f"minutes")
            if run:
                mine, same_address = _held(queue, session, address)
                mine += sum(r and session is not None and s == session for s, _, r in pending)
                same_address += sum(r and bool(address) and a == address for _, a, r in pending)
                message = share_refusal(mine, same_address)
                if message:
                    return None, "validator_error", message
            token = next(self._tokens)
            self._pending[token] = (session, address, run)
            return token, "", ""

    def release(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    def __len__(self) -> int:
        return len(self._pending)


CLAIMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Gradio's queue → the claims on its places


def guard_queue(queue) -> None:
    """Make a place in `queue` (Gradio's) a claim checked under one lock: its `push` claims first (the queue's size,
    and for a run this session's and this address's share), then Gradio validates and queues; the claim is let go
    when the push returns, queued (then Gradio's queue counts it) or refused."""
    push, claims = queue.push, CLAIMS.setdefault(queue, Claims())

    async def admitted_push(body, request, username):
        try:
            fn = route_utils.get_fn(queue.blocks, None, body) if body.fn_index is not None else None
        except (KeyError, TypeError):
            fn = None  # Gradio answers (studio.doors refuses an unknown event before it gets here)
        if fn is None:
            return await push(body, request, username)
        token, state, message = claims.claim(queue, body.session_hash, address_of(request),
                                             fn.concurrency_id == RUN_QUEUE)
        if token is None:
            if state == "validator_error":  # answered as the run's validator answers (HTTP 422, per input)
                verdicts = [gr.validate(False, message)] + [gr.validate(True, "")] * (len(fn.inputs) - 1)
                return False, process_validation_response(verdicts, fn)[1], state
            return False, message, state
        try:
            return await push(body, request, username)
        finally:
            claims.release(token)

    queue.push = admitted_push


def admit(values: dict, request: gr.Request | None) -> None:
    """Whether a run may take a place in the queue, as the page's Run press tells it: this visitor's share of it,
    then every check of the run that needs no weights (`handlers.prepare_run`). GhostedError when not."""
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
        refuse never holds a place (one beyond the visitor's share was refused before it, by `guard_queue`).
        Answered as Gradio answers a validator, one verdict per input: HTTP 422 with the message on the first
        (gradio_client raises ValidationError with it; the page has shown it in the status already)."""
        values = inspect.signature(on_run).bind(*args, **kwargs).arguments
        message = ""
        try:  # the share was claimed atomically before (guard_queue)
            request = values.get("request")
            prepare_run(prepare(values), request.session_hash if request else "")
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
