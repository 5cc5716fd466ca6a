"""Ghosted Layers Studio: the Gradio app's entry point. UI only; every number comes from `ghosted_core`.

The page is built in the `studio` package (layout, handlers, outputs, the run and the model
cache). Flow of a run: widget values → `RunOptions` (`studio.runner.build_options`) →
`studio.runner.run_job`, which loads the model through the process-wide cache and drains
`ghosted_core.run.pipeline.run_stages`, yielding a plain JSON snapshot after every stage →
`studio.outputs` renders it with `ghosted_core.report` (HTML, tables and plotly figures).

`python app.py` serves on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 0.0.0.0:7860).
"""

from __future__ import annotations

# First, before anything loads torch: the package sets OMP_WAIT_POLICY=PASSIVE.
import ghosted_core  # noqa: F401, I001

import logging
import os

from studio.layout import build_demo, launch_options

demo = build_demo()


def main() -> None:
    """Serve on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 0.0.0.0:7860)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "accelerate", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), **launch_options())


if __name__ == "__main__":
    main()
