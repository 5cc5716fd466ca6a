"""Before a run: what it will cost, which Hub models can run here, and advice on the settings.

- `estimate`: memory and time estimates on the current device; the ZeroGPU duration.
- `presets`: curated Hub models with their config numbers; can this one run here, and why not.
- `advice`: sensible depths, flagged cuts and calibration sizes, which number to trust.
"""
