"""A run: options in, stages streamed out, one results.json layout; and the depth sweep.

- `options`: `RunOptions`, variants, validation, and the memory plan of a run.
- `result`: `RunResult` and the results.json layout.
- `fitting`: fit every variant at every boundary, realize its modules, held-out errors.
- `pipeline`: load → select → calibrate → fit → evaluate, as a stream of stages.
- `sweep`: every depth from one scoring and one calibration pass, streamed depth by depth.
"""
