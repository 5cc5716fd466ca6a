"""What a run found: `RunResult` and its results.json layout (`run_json`, `fit_json`, shared with sweeps)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from ghosted_core.distill.train import DistillReport
from ghosted_core.export.gain import GainReport
from ghosted_core.evaluation.perplexity import BlockDrift
from ghosted_core.memory import MemoryPlan
from ghosted_core.recovery.assessment import FitReport
from ghosted_core.plan import PruningPlan
from ghosted_core.selection.similarity import SimilarityStats
from ghosted_core.evaluation.tasks import TaskResults, paired_comparisons
from ghosted_core.run.options import RunOptions

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a run found so far; `to_json` is the results.json layout."""

    options: RunOptions
    model_description: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    plan: PruningPlan | None = None
    similarity: SimilarityStats | None = None
    calibration_label: str = ""
    calibration_tokens: int = 0
    fits: dict[str, list[FitReport]] = field(default_factory=dict)
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)  # corpus → variant → ppl
    corpora: dict[str, dict] = field(default_factory=dict)  # corpus → {label, real}
    drift: dict[str, BlockDrift] = field(default_factory=dict)
    generations: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, TaskResults] = field(default_factory=dict)  # variant → zero-shot task scores
    distill: dict[str, DistillReport] = field(default_factory=dict)  # distilled variant → what its training did
    gain: GainReport | None = None  # each variant's size and speed against dense
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_plan: MemoryPlan | None = None
    bos: dict = field(default_factory=dict)  # the BOS rule and what it gave (corpora.BosRule.to_json)
    models: dict[str, PreTrainedModel] = field(default_factory=dict, repr=False)  # dense + variants (not serialized)
    tokenizer: object = field(default=None, repr=False)

    @property
    def variant_names(self) -> list[str]:
        return ["dense"] + [v.name for v in self.options.variants] if self.plan and self.plan.removed else ["dense"]

    def to_json(self) -> dict:
        opts = self.options
        variants: dict[str, dict] = {}
        for name in self.variant_names:
            entry: dict = {"ppl": {corpus: table[name] for corpus, table in self.perplexity.items() if name in table}}
            if name in self.fits:
                entry |= fit_json(self.fits[name])
            if name in self.drift:
                entry["drift"] = self.drift[name].to_json()
            if name in self.generations:
                entry["generation"] = self.generations[name]
            if name in self.tasks:
                entry["tasks"] = self.tasks[name].to_json()
            if name in self.distill:
                entry["distill"] = self.distill[name].to_json()
            if self.gain is not None and name in self.gain.sizes:
                entry["gain"] = self.gain.variant_json(name)
            variants[name] = entry
        plan = self.plan.to_json() if self.plan else {}
        return run_json(self) | {
            "removed_layers": plan.get("removed_layers", []),
            "boundaries": plan.get("boundaries", []),
            "scores": plan.get("scores", []),
            "score_label": plan.get("score_label", ""),
            "prompt": opts.prompt,
            "gain": self.gain.settings_json() if self.gain is not None else None,
            "variants": variants,
            "task_comparisons": task_comparisons_json(self.tasks),
        }


def task_comparisons_json(tasks: dict[str, TaskResults]) -> dict:
    """results.json's paired accuracy differences: every variant against plain pruning ("vs_none") and against
    the dense model ("vs_dense"), per task and for the mean, on the same examples (`evaluation.paired`)."""
    out: dict = {}
    for key, against in (("vs_none", "none"), ("vs_dense", "dense")):
        for name, table in paired_comparisons(tasks, against).items():
            out.setdefault(name, {})[key] = {task: d.to_json() for task, d in table.items()}
    return out


def run_json(result) -> dict:
    """What every results.json states about a run or a sweep: model, criterion, calibration, memory plan,
    corpora, timings and notes (`result`: a RunResult or a SweepResult)."""
    opts = result.options
    cal = opts.calibrate
    return {
        "model": opts.model,
        "model_description": result.model_description,
        "num_layers": result.num_layers,
        "hidden_size": result.hidden_size,
        "criterion": opts.criterion,
        "calibration": {
            "corpus": opts.calibration, "label": result.calibration_label, "sequences": opts.train_size,
            "heldout_sequences": opts.heldout, "seqlen": opts.seqlen, "tokens": result.calibration_tokens,
            "seed": opts.seed, "sink_rule": cal.sink_rule, "sink_ratio": cal.sink_ratio, "pipeline": cal.pipeline,
            "stats_device": cal.stats_device, "products": cal.products,
        },
        "memory_plan": result.memory_plan.to_json() if result.memory_plan else None,
        "bos": result.bos or {"rule": opts.bos},  # which token starts every window (the paper: one BOS per corpus)
        "evaluation": {"seqlen": opts.eval_seqlen or opts.seqlen, "max_tokens": opts.eval_max_tokens},
        "corpora": result.corpora,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "notes": result.notes,
    }


def fit_json(reports: Sequence[FitReport]) -> dict:
    """A variant's boundary errors, anti-symmetric shares and full fit reports, one per boundary (results.json)."""
    return {
        "boundary_error": [{"boundary": r.boundary, "fit": r.fit_error, "fit_ordinary": r.fit_error_ordinary,
                            "heldout": r.heldout_error, "heldout_ordinary": r.heldout_error_ordinary,
                            "heldout_worse_than_pruning": r.heldout_worse_than_pruning, "ridge_fallback": r.ridge_fallback}
                           for r in reports],
        "antisym_fraction": [r.antisym_fraction if math.isfinite(r.antisym_fraction) else None for r in reports],
        "fits": [r.to_json() for r in reports],
    }
