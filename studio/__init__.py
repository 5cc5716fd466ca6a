"""Ghosted Layers Studio's web UI, in small modules; `app.py` is the entry point.

- `settings`     defaults of a run, server limits from the environment, widget choices, ZeroGPU durations
- `cache`        the process-wide model cache shared by every user
- `runner`       widget values → a checked `RunRequest`; the runs (single depth, sweep), each one `@spaces.GPU` call
- `runs`         runs in progress per browser session: what Stop stops (and a client that went away)
- `guard`        what a stranger may ask: widget values held to the page's ranges, local folders as the operator allows
- `session_files` files handed to a session, removed when it ends
- `status`       the status panel: running, complete, stopped, refused, failed; the library's advice
- `user_input`   your own text, pasted or uploaded
- `presets_view` Hub presets in the model list, with their estimates
- `history`      the session's runs: table, CSV, settings to restore
- `speed`        what a default run takes on this machine
- `outputs`      the Run outputs' names, and a run's JSON snapshot rendered into them
- `handlers`     what the page's events call
- `saved`        the model each session saved last, kept as its export folder for the push
- `push`         the Hub push: sign-in on a Space (OAuth), a pasted token elsewhere, the upload
- `layout`       the page: widgets and their wiring

What a public server holds strangers to (docs/reliability.md's limits table):
- `access`       whose Hub token a model load may use
- `admission`    who may take a place in the run queue, checked and claimed atomically
- `addresses`    the client address the proxy vouches for (X-Forwarded-For read from the right)
- `doors`        which of Gradio's routes a stranger may use; bodies bounded; unknown events and non-finite values refused
- `disk`         uploads bounded per request, per address and in total
- `uploads`      each session's uploaded text, read once; an upload held until a session claims it
- `sessions`     what Gradio keeps per session (no deep-link copy), and how many sessions
- `serving`      the server's serving figure: what it may hold resident at once

The UI holds no method logic: every number comes from `ghosted_core`, and every table and
chart from `ghosted_core.report` (which the CLI's sweep page uses too).
"""

# First, before anything loads torch: the package sets OMP_WAIT_POLICY=PASSIVE. On 2 shared cores
# (load average ~4) a default run took 70-87 s with it and 302 s without it.
import ghosted_core  # noqa: F401
