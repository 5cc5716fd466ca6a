"""Defaults of a run, server limits from the environment, and the widgets' choices."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ghosted_core.export.gain import speed_by_default
from ghosted_core.planning.advice import default_depth
from ghosted_core.model.embedded import DEFAULT_MODEL, EMBEDDED
from ghosted_core.planning.presets import gpu_seconds
from ghosted_core.run.options import DEFAULT_VARIANTS

ASSETS = Path(__file__).resolve().parents[1] / "assets"


NO_SAVE = "don't save"
SWEEP = "sweep"  # the mode that runs every depth of a range from one calibration pass
COMPARE = "compare criteria"  # the mode that scores several criteria at one depth and evaluates every plan
MODES = ("single depth", SWEEP, COMPARE)


@dataclass(frozen=True)
class Defaults:
    """What a newcomer gets on pressing Run: sized to finish within a minute on 2 CPU cores (see bench/app_speed.py)."""

    model: str = DEFAULT_MODEL
    criterion: str = "streamline"
    depth: int = default_depth(EMBEDDED[DEFAULT_MODEL].num_layers)  # blocks removed: a quarter of them (7 of 30)
    operators: tuple[str, ...] = DEFAULT_VARIANTS  # ghost_capped beside the best stock operator (magcomp_refit)
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
    export_format: str = "auto"  # stock where the variant folds, remote_code otherwise (gguf: stock plus its GGUF)
    gguf_type: tuple[str, ...] = ("f16",)  # GGUF types for the gguf format (any of GGUF_OUTTYPES)
    gguf_imatrix: bool = False  # k-quants with an importance matrix from the run's calibration text
    mode: str = "single depth"  # or SWEEP
    depths: str = "2:10:2"  # a sweep's depths, START:STOP:STEP with STOP included
    text_use: str = "evaluation"  # what "your text" is used for, when given
    # criteria compared by default: the quick ones (sleb, swap_kl and prunecomp cost many passes: add them at will)
    compare_criteria: tuple[str, ...] = ("streamline", "shortgpt", "kl", "weights")
    distill_on: bool = False  # distillation trains: minutes on a CPU (bench/distill.py)
    distill_steps: int = 12  # optimizer steps per distilled variant, 2 × seqlen tokens each
    distill_train: str = "operator"  # see DISTILL_TRAIN
    # each variant's size, and its speed against dense (~20 s for the default run here); $GHOSTED_SPEED=0: off
    speed_on: bool = field(default_factory=speed_by_default)


DEFAULTS = Defaults()
SEQLENS = (64, 128, 256, 512, 1024, 2048)
MAX_SAMPLES = 128  # calibration sequences (the paper's count)
EVAL_TOKENS = (256, 16384)  # perplexity tokens per corpus, lowest and highest
NEW_TOKENS = (4, 128)  # generated tokens per variant, lowest and highest
TASK_EXAMPLES = (5, 200)  # quick-task examples per task, lowest and highest
DISTILL_STEPS = (1, 200)  # optimizer steps per distilled variant, lowest and highest
# what distillation trains for each chosen operator (`ghosted_core.run.options.distilled` names the variants)
DISTILL_TRAIN = {
    "operator": "the operator's own weights (LinearPatch's KD; block s−1's MLP where it has none)",
    "stock": "block s−1's MLP before each cut: stays a stock model",
    "both": "both, side by side",
}
# A closed tab or a dropped client is noticed within one heartbeat (Gradio's default: 15 s); its run then stops
# at its next batch (studio.runs.client_gone), freeing its slot for the next user.
os.environ.setdefault("GRADIO_HEARTBEAT_INTERVAL", "2")
CACHE_SIZE = int(os.environ.get("GHOSTED_APP_CACHE_MODELS", "2"))  # models held in memory at once
RUN_CONCURRENCY = int(os.environ.get("GHOSTED_APP_CONCURRENCY", "1"))  # runs computing at once
QUEUE_SIZE = int(os.environ.get("GHOSTED_APP_QUEUE", "16"))  # runs waiting at most
RUN_BUDGET_ENV = "GHOSTED_APP_RUN_BUDGET"
HUB_CACHE_ENV = "GHOSTED_APP_HUB_CACHE_GB"


def hub_cache_bytes() -> int | None:
    """The most huggingface_hub's model cache may hold after a visitor's download (least recently used out first)
    and the check of free disk before one: the operator's GHOSTED_APP_HUB_CACHE_GB, else 20 GB on a Space (whose
    disk is shared by every visitor), else no cap."""
    value = os.environ.get(HUB_CACHE_ENV, "").strip()
    if value:
        return int(float(value) * 1e9)
    return int(20e9) if os.environ.get("SPACE_ID") else None


def run_budget_seconds() -> float:
    """The most a run may be estimated to take here (`planning.estimate.check_work_budget`), 0 for no limit: the
    operator's GHOSTED_APP_RUN_BUDGET (seconds), else 15 minutes on a Space without a GPU, else none."""
    value = os.environ.get(RUN_BUDGET_ENV, "").strip()
    if value:
        return max(0.0, float(value))
    import torch

    return 900.0 if os.environ.get("SPACE_ID") and not torch.cuda.is_available() else 0.0
STOP_WAIT_SECONDS = 30  # Stop waits this long for a run to reach its next batch before answering

CRITERION_HELP = {  # short dropdown labels; the registry's paper names are longer
    "streamline": "contiguous run (LLM-Streamline)",
    "shortgpt": "lowest block influence (ShortGPT)",
    "angular": "angular distance (PruneMe)",
    "manual": "the blocks you list",
    "none": "dense model only",
    "sleb": "greedy by calibration NLL (SLEB; n rounds)",
    "kl": "run with the least KL to the dense output",
    "swap_kl": "interchange probe (No Free Swap; many passes)",
    "swap_kl_repl": "replacement probe (No Free Swap; many passes)",
    "weights": "forward-free, from the weights (ours, after WRP's abstract)",
    "prunecomp": "iterative BI with magnitude compensation (Prune&Comp)",
}


def _spaces_gpu(duration: Callable[..., int]) -> Callable:
    """`spaces.GPU(duration=…)` on a Hugging Face Space, the duration computed per call from the run's memory and
    time plan (`ghosted_core.presets.gpu_seconds`); a no-op decorator elsewhere."""
    try:
        import spaces
    except ImportError:
        return lambda fn: fn
    return spaces.GPU(duration=duration)


def _run_seconds(options, *args, **kwargs) -> int:
    return gpu_seconds(options)


def _sweep_seconds(options, depths, *args, **kwargs) -> int:
    return gpu_seconds(options, tuple(depths))


def _compare_seconds(options, criteria, *args, **kwargs) -> int:
    """Rough: a single run's estimate per criterion (the scoring criteria cost more, the shared passes less)."""
    return min(300, gpu_seconds(options) * max(1, len(criteria)))


gpu_run = _spaces_gpu(_run_seconds)  # decorates studio.runner.run_job
gpu_sweep = _spaces_gpu(_sweep_seconds)  # decorates studio.runner.run_sweep_job
gpu_compare = _spaces_gpu(_compare_seconds)  # decorates studio.runner.run_compare_job
