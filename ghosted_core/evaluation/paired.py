"""Paired comparisons of task accuracy: every variant answers the same examples, so compare them example by example.

Two variants' accuracies on the same n examples are far more correlated than two independent
samples: most examples are right (or wrong) for both. The standard error of their difference is
therefore taken over the per-example differences d_i = a_i − b_i (a_i, b_i ∈ {0, 1}):
SE = sd(d) / √n with the n − 1 sample deviation (lm-eval's own convention for `acc_stderr`), and the
95% interval is mean(d) ± 1.96·SE (normal approximation). McNemar's exact test uses only the
discordant examples: under no difference, the n01 + n10 examples that one variant gets right and
the other wrong split as Binomial(n01 + n10, ½); p = min(1, 2·P[X ≤ min(n01, n10)]).

Over several tasks (the paper's mean accuracy, an unweighted mean of per-task accuracies), the
difference of means is the mean of per-task differences, with SE = √(Σ SE_t²) / k (tasks are
independent samples) and a two-sided normal p-value; McNemar's test is per task only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

Z95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal


@dataclass(frozen=True)
class PairedDifference:
    """Accuracy of `a` minus accuracy of `b` on the same examples, with its uncertainty."""

    diff: float  # mean(a) − mean(b)
    stderr: float  # of the paired difference
    low: float  # 95% interval
    high: float
    p_value: float  # McNemar's exact p (a task), or the normal approximation's (a mean over tasks)
    test: str  # "mcnemar-exact" or "normal"
    n: int  # examples (per task; the sum over tasks for a mean)
    a_only: int | None = None  # examples a gets right and b wrong (None for a mean over tasks)
    b_only: int | None = None

    @property
    def significant(self) -> bool:
        """The 95% interval excludes 0."""
        return self.low > 0 or self.high < 0

    def verdict(self) -> str:
        return "significant" if self.significant else "not significant"

    def to_json(self) -> dict:
        return asdict(self) | {"significant": self.significant}


def stderr(correct: Sequence[float]) -> float:
    """Standard error of a mean of per-example scores: sd (n − 1) / √n, 0 for fewer than two examples."""
    x = np.asarray(correct, dtype=np.float64)
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (1.0 when there are none)."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """a − b over the same examples (0/1 per example, in the same order)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or not len(x):
        raise ValueError(f"paired scores need the same examples: {x.shape} against {y.shape}")
    d = x - y
    diff, se = float(d.mean()), stderr(d)
    a_only, b_only = int(((x > 0.5) & (y < 0.5)).sum()), int(((x < 0.5) & (y > 0.5)).sum())
    return PairedDifference(diff, se, diff - Z95 * se, diff + Z95 * se, mcnemar_exact(a_only, b_only),
                            "mcnemar-exact", len(d), a_only, b_only)


def mean_difference(per_task: Sequence[PairedDifference]) -> PairedDifference:
    """The difference of unweighted means over tasks, from each task's paired difference."""
    if not per_task:
        raise ValueError("no tasks to average")
    k = len(per_task)
    diff = sum(t.diff for t in per_task) / k
    se = math.sqrt(sum(t.stderr**2 for t in per_task)) / k
    p = math.erfc(abs(diff) / (se * math.sqrt(2))) if se > 0 else (1.0 if diff == 0 else 0.0)
    return PairedDifference(diff, se, diff - Z95 * se, diff + Z95 * se, p, "normal", sum(t.n for t in per_task))
