"""Defaults of a run, server limits from the environment, and the widgets' choices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ghosted_core.advice import default_depth
from ghosted_core.models import DEFAULT_MODEL, EMBEDDED
from ghosted_core.operators import OPERATORS
from ghosted_core.pipeline import SEQUENTIAL_SUFFIX

ASSETS = Path(__file__).resolve().parents[1] / "assets"


NO_SAVE = "don't save"


@dataclass(frozen=True)
class Defaults:
    """What a newcomer gets on pressing Run: sized to finish within a minute on 2 CPU cores (see bench/app_speed.py)."""

    model: str = DEFAULT_MODEL
    criterion: str = "streamline"
    depth: int = default_depth(EMBEDDED[DEFAULT_MODEL].num_layers)  # blocks removed: a quarter of them (7 of 30)
    operators: tuple[str, ...] = ("none", "diag", "rotate", "ghost", "ghost_capped", "replaceme")
    calibration: str = "mix"  # broad stand-in for C4
    samples: int = 12  # calibration sequences (the paper: 128); 3072 tokens, over 5× the width of SmolLM2
    seqlen: int = 256  # calibration and perplexity window length (the paper: 2048)
    seed: int = 0
    eval_corpora: tuple[str, ...] = ("ptb", "wiki")  # ptb is exact and not in the calibration mix
    eval_tokens: int = 1024  # perplexity tokens per corpus
    drift_windows: int = 1  # windows of the first evaluation corpus for per-block drift
    new_tokens: int = 16  # a CPU decode step of SmolLM2 takes ~80 ms, for each of 7 variants
    tasks: tuple[str, ...] = ("arc_easy", "copa", "piqa")
    task_examples: int = 20
    save_variant: str = NO_SAVE  # a variant to download as a recovered model (zip); off by default (~0.4 GB)


DEFAULTS = Defaults()
SEQLENS = (64, 128, 256, 512, 1024, 2048)
CACHE_SIZE = int(os.environ.get("GHOSTED_APP_CACHE_MODELS", "2"))  # models held in memory at once
RUN_CONCURRENCY = int(os.environ.get("GHOSTED_APP_CONCURRENCY", "1"))  # runs computing at once
QUEUE_SIZE = int(os.environ.get("GHOSTED_APP_QUEUE", "16"))  # runs waiting at most
GPU_SECONDS = int(os.environ.get("GHOSTED_APP_GPU_SECONDS", "120"))  # ZeroGPU time asked per run
STOP_WAIT_SECONDS = 30  # Stop waits this long for a run to reach its next batch before answering

OPERATOR_CHOICES = list(OPERATORS) + [f"{name}{SEQUENTIAL_SUFFIX}" for name in OPERATORS if name != "none"]
CRITERION_HELP = {  # short dropdown labels; the registry's paper names are longer
    "streamline": "contiguous run (LLM-Streamline)",
    "shortgpt": "lowest block influence (ShortGPT)",
    "angular": "angular distance (PruneMe)",
    "manual": "the blocks you list",
    "none": "dense model only",
}


def _spaces_gpu():
    """`spaces.GPU(duration=…)` on a Hugging Face Space, a no-op decorator elsewhere."""
    try:
        import spaces
    except ImportError:
        return lambda fn: fn
    return spaces.GPU(duration=GPU_SECONDS)


gpu = _spaces_gpu()

