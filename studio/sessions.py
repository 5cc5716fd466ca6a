"""What Gradio keeps per browser session, bounded: no copy kept for deep links, and a session count from memory.

Gradio makes a session's state on the first request that names a new session id, and keeps up to
10,000 of them by default. Each one started with a copy of every component's config (about 200 kB
for this page's ~120 components), and every input an event received, refused or not, was written
into that copy: Gradio keeps it only to serve `/gradio_api/deep_link`, which this app refuses
(`studio.doors`). `LeanSessionState` keeps no such copy, so a session costs its `gr.State` values and
the components an event updated, and a refused 4 MB value is gone when its request is.
`session_capacity` sets how many sessions Gradio keeps (the oldest forgotten first) from the memory
the operator gives them (GHOSTED_APP_SESSION_MEMORY_MB, default 256) over what one may hold
(SESSION_BYTES; tests/studio/test_strangers.py measures it). Install with `use_lean_sessions()`,
before the first request (`layout.build_demo` does).
"""

from __future__ import annotations

import os
from copy import copy

from gradio import state_holder

SESSION_MEMORY_ENV, SESSIONS_ENV = "GHOSTED_APP_SESSION_MEMORY_MB", "GHOSTED_APP_SESSIONS"
# What a session that has run nothing holds here (what a stranger's made-up session ids create by the thousand):
# the blocks' config it shares, its gr.State defaults, and the components an event updated. Measured at about 10 kB
# (tests/studio/test_strangers.py::test_new_sessions_cost_what_they_declare_and_keep_no_refused_input). A session
# that has run adds its history (at most studio.history.HISTORY_LIMIT runs' rows), at the pace of the run queue.
SESSION_BYTES = 64 * 2**10


class _Discarded(dict):
    """A dict that keeps nothing written to it: Gradio's per-session deep-link copy, here never read."""

    def __setitem__(self, key, value) -> None:
        return None


class LeanSessionState(state_holder.SessionState):
    """Gradio's session state without the deep-link copy of every component's config and of every input.

    Its attributes are Gradio's but that copy, made without building it (~30 ms a session); a test compares them
    with Gradio's own SessionState's, so a Gradio that adds one fails it."""

    def __init__(self, blocks) -> None:
        self.blocks_config = copy(blocks.default_config)
        self.state_data: dict[int, object] = {}
        self._state_ttl: dict[int, tuple] = {}
        self.is_closed = False
        self.STATE_TTL_WHEN_CLOSED = 1 if os.getenv("GRADIO_IS_E2E_TEST", None) else 3600

    @property
    def config_values(self) -> dict:
        return _Discarded()

    @config_values.setter
    def config_values(self, value: dict) -> None:
        return None

    def _update_value_in_config(self, key: int, value: object) -> None:
        return None

    def _update_config(self, key: int) -> None:
        return None


def use_lean_sessions() -> None:
    """Make every session Gradio creates from now on a LeanSessionState (deep links are refused anyway)."""
    state_holder.SessionState = LeanSessionState


def session_capacity() -> int:
    """Sessions Gradio keeps at once: GHOSTED_APP_SESSIONS, else the session memory over SESSION_BYTES (≥ 16)."""
    value = os.environ.get(SESSIONS_ENV, "").strip()
    if value.isdigit():
        return max(1, int(value))
    memory = float(os.environ.get(SESSION_MEMORY_ENV, "256")) * 2**20
    return max(16, int(memory // SESSION_BYTES))
