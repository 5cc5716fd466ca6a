"""Calibration windows for the LinearPatch reference (`linearpatch_reference.npz`), and how the file was made.

The windows are synthetic and seeded: channels of very different magnitudes, a massive first
token per window, and an X_post that is a non-symmetric map of X_pre plus noise, so that the
per-window and pooled ratios differ and the rotated basis matters.

The reference was computed once with the authors' own code, chenxinrui-tsinghua/LinearPatch at
commit d1274e8 (not part of this project): `layer_select.get_scale_params` run on a two-layer
stand-in model whose layer inputs are these windows (one window per batch, 128 windows, so its
fixed division by 128 is the mean), with `rotate=False` and `rotate=True`, its `.half()` casts
mapped to float64; then W = H diag(r) Hᵀ with H = `rotate_utils.hadamard_utils.get_hadamard_matrix`
as `block_scaling.generate_symmetric_matrix` builds it. Stored: both scale vectors and W applied
to two seeded probe vectors (which pin W given r).
"""

from __future__ import annotations

import numpy as np

WIDTHS = (576, 640, 896)
WINDOWS = 128
TOKENS = 24


def windows(width: int) -> tuple[np.ndarray, np.ndarray]:
    """(x_pre, x_post), each (WINDOWS, TOKENS, width) float64, seeded by the width."""
    rng = np.random.default_rng(width)
    magnitude = np.exp(rng.normal(0.0, 1.0, size=width))  # per-channel scale over ~e^±2
    x_pre = rng.standard_t(4, size=(WINDOWS, TOKENS, width)) * magnitude
    x_pre[:, 0] *= 50.0  # a massive first token, as attention sinks are
    drift = np.exp(rng.normal(0.0, 0.5, size=(WINDOWS, 1, width)))  # windows differ in their channel scales
    mixing = np.eye(width) + rng.normal(0.0, 0.5 / np.sqrt(width), size=(width, width))
    x_post = (x_pre * drift) @ mixing + 0.3 * rng.standard_normal(size=(WINDOWS, TOKENS, width)) * magnitude
    return x_pre, x_post


def probes(width: int) -> np.ndarray:
    """(2, width) vectors W is applied to in the reference."""
    return np.random.default_rng(width + 1).standard_normal(size=(2, width))
