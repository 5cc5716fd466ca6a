"""Ghosted Layers Studio's web UI, in small modules; `app.py` is the entry point.

- `settings`  defaults of a run, server limits from the environment, widget choices
- `cache`     the process-wide model cache shared by every user
- `runner`    widget values → `RunOptions`; the run itself (the one `@spaces.GPU` unit)
- `tables`    text, HTML and tables from a run's JSON snapshot
- `charts`    plotly figures from a run's JSON snapshot
- `callbacks` what the page's events call: run, stop, model change
- `layout`    the page: widgets and their wiring

The UI holds no method logic: every number comes from `ghosted_core`.
"""

# First, before anything loads torch: the package sets OMP_WAIT_POLICY=PASSIVE. On 2 shared cores
# (load average ~4) a default run took 70-87 s with it and 302 s without it.
import ghosted_core  # noqa: F401
