"""Advice on a run's settings and results: sensible depths, cuts and calibration sizes, and which number to trust.

Front ends show these before a run (from the settings alone) and after it (from what it
measured), so a newcomer learns why a result looks wrong before misreading it. Thresholds:
- depth: a quarter of the blocks is a sensible first cut (the papers remove 7 of 32, ~22%);
  beyond ~40%, or a cut through the last block (whose output feeds the final norm), the
  pruned model usually collapses, whatever the operator;
- calibration: a least-squares fit of a C×C map is well posed only with many more tokens
  than C (DESIGN.md: aim for ≥ 4·C); below 2·C the ridge decides the answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_DEPTH_SHARE = 0.25  # blocks removed by default, as a share of the model's blocks
DEEP_CUT_SHARE = 0.40  # cuts removing more than this share of the blocks are flagged
GOOD_TOKENS_PER_CHANNEL = 4  # calibration tokens per hidden channel for a well-posed least-squares fit
MIN_TOKENS_PER_CHANNEL = 2  # below this many per channel, the fit is mostly ridge
PLAIN_OPERATORS = frozenset({"none", "diag", "diag_pooled", "rotate", "rotate_pooled", "magcomp"})  # no C×C solve (identity, per-channel scales)


@dataclass(frozen=True)
class Advice:
    """One message for the user; `severe` ones predict a broken result, the others a weak one."""

    message: str
    severe: bool = False


def default_depth(num_layers: int) -> int:
    """Blocks to remove by default: a quarter of the model's blocks, at least one (30 → 7, 18 → 4)."""
    return max(1, min(num_layers - 1, int(num_layers * DEFAULT_DEPTH_SHARE)))


def cut_advice(num_layers: int, removed_count: int, removed: Collection[int] = ()) -> list[Advice]:
    """Flags for a cut of `removed_count` blocks (and, once known, which ones) out of `num_layers`."""
    advice = []
    if removed_count > DEEP_CUT_SHARE * num_layers:
        advice.append(Advice(
            f"removing {removed_count} of {num_layers} blocks ({removed_count / num_layers:.0%}) is more than "
            f"~{DEEP_CUT_SHARE:.0%} of the model: expect perplexity far above the dense model's, whatever the operator; "
            f"{default_depth(num_layers)} blocks is a sensible first cut", severe=True))
    if num_layers - 1 in removed:
        advice.append(Advice(
            f"the cut reaches the last block ({num_layers - 1}): what is left feeds the final norm and the LM head "
            "directly, and perplexity usually explodes (often by orders of magnitude); prefer a cut that ends "
            "before the last block (criterion streamline on a smaller depth, or manual blocks)", severe=True))
    return advice


def calibration_advice(tokens: int, width: int, operators: Sequence[str]) -> list[Advice]:
    """Flags for fitting `operators` on `tokens` calibration tokens at hidden width `width` (C)."""
    solved = [name for name in operators if name.split("+")[0] not in PLAIN_OPERATORS]
    if not solved or tokens >= GOOD_TOKENS_PER_CHANNEL * width:
        return []
    good = GOOD_TOKENS_PER_CHANNEL * width
    names = ", ".join(solved)
    if tokens < MIN_TOKENS_PER_CHANNEL * width:
        return [Advice(
            f"{tokens} calibration tokens is fewer than 2·C = {MIN_TOKENS_PER_CHANNEL * width} for this model's width "
            f"C = {width}: the least-squares fits ({names}) are mostly ridge and can come out worse than plain "
            f"pruning; use at least 4·C = {good} tokens (more sequences or longer ones)", severe=True)]
    return [Advice(
        f"{tokens} calibration tokens is fewer than 4·C = {good} for this model's width C = {width}: the "
        f"least-squares fits ({names}) may be noisy; more sequences or longer ones help")]


def worse_than_pruning(heldout_error: float | None) -> bool:
    """A relative held-out boundary error above 1: the operator moves the stream further from the dense one than plain pruning."""
    return heldout_error is not None and heldout_error > 1.0


def disagreements(perplexity: Mapping[str, Mapping[str, float]], boundary_error: Mapping[str, Sequence[float]]) -> list[str]:
    """Operators that boundary error and perplexity rank differently against plain pruning.

    `perplexity`: corpus → variant → perplexity (with "none"); `boundary_error`: variant →
    relative boundary errors (1 = plain pruning). An operator disagrees when its errors are
    all below 1 but its perplexity is above plain pruning's on some corpus, or the reverse.
    """
    found = []
    for name, errors in boundary_error.items():
        if name == "none" or not errors:
            continue
        ppl_says_better = [table[name] < table["none"] for table in perplexity.values() if name in table and "none" in table]
        if not ppl_says_better:
            continue
        error_says_better = all(e < 1.0 for e in errors)
        if error_says_better and not all(ppl_says_better) or not error_says_better and all(ppl_says_better):
            found.append(name)
    return found
