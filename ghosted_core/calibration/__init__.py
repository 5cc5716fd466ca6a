"""Calibration: one streamed pass over calibration text → the statistics every boundary needs.

- `capture`: the only place forward hooks live (residual streams, MLP branches, early stop).
- `collect`: calibration options, sink detection, and the statistics pass (`collect_stats`).
- `pipelines`: the calibration pipeline registry: `full` (one forward per batch) and `blocks` (block by block).
"""
