"""What the server may hold resident at once, from the memory plans of the runs it accepts: its serving figure.

Parts, each bounded by a limit the server enforces (docs/reliability.md):
- the process: Python, torch, transformers, Gradio, the page and the corpora it has read
  (PROCESS_BYTES, measured by bench/load_flood.py as the server's resident size once it
  answers, before any run);
- the models held: the GHOSTED_APP_CACHE_MODELS largest models of the runs, at their weights' bytes;
- the runs computing: GHOSTED_APP_CONCURRENCY of them, each at the largest run's memory plan above
  its weights (`MemoryPlan.host_bytes − weights_bytes`: calibration, fits, variants, evaluation);
- the sessions Gradio keeps (`studio.sessions`: capacity × SESSION_BYTES);
- the uploaded text held in memory (`studio.uploads.UPLOAD_MEMORY_BYTES`).
The admission refuses what a run's own plan cannot fit; this figure says what the whole server
needs, so that an operator sizes the machine (or the limits) for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from studio.sessions import SESSION_BYTES, session_capacity
from studio.settings import CACHE_SIZE, RUN_CONCURRENCY
from studio.uploads import UPLOAD_MEMORY_BYTES

PROCESS_BYTES = 1024 * 2**20  # the server before any run; bench/load_flood.py measures it (about 0.6–0.8 GiB)


def run_plan(values: dict):
    """The memory plan of one Run press's values (on_run's arguments by name), as the run itself makes it."""
    from ghosted_core.model.loading import peek_config
    from ghosted_core.run.options import memory_plan
    from studio.handlers import prepare_run

    options = prepare_run(values, session="").options
    return memory_plan(options, peek_config(options.model))


def serving_plan(runs: Sequence[dict]) -> dict[str, int]:
    """Bytes by part (and "total") of the server accepting `runs` (each a Run press's values)."""
    plans = [run_plan(values) for values in runs]
    weights = {plan.model: plan.weights_bytes for plan in plans}
    parts = {
        "process": PROCESS_BYTES,
        "models held": sum(sorted(weights.values())[-CACHE_SIZE:]),
        "runs computing": RUN_CONCURRENCY * max((p.host_bytes - p.weights_bytes for p in plans), default=0),
        "sessions": session_capacity() * SESSION_BYTES,
        "uploaded text": UPLOAD_MEMORY_BYTES,
    }
    return parts | {"total": sum(parts.values())}
