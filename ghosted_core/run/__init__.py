"""A run: options in, stages streamed out, one results.json layout; and the depth sweep.

- `options`: `RunOptions`, variants, validation, and the memory plan of a run.
- `result`: `RunResult` and the results.json layout.
- `fitting`: fit every variant at every boundary, realize its modules, held-out errors.
- `distilling`: the distillation stage: the teacher's targets once, every `+kd` variant from its fitted start.
- `pipeline`: load → select → calibrate → fit → evaluate, as a stream of stages.
- `plans`: several plans from one calibration pass: shared statistics, dense states, per-plan fits and perplexity.
- `sweep`: every depth from one scoring and one calibration pass, streamed depth by depth.
- `compare`: several criteria at one depth: each one's blocks, every operator on every distinct plan.
"""
