"""The answer first: which variant (or criterion and operator) wins, by how much, and what it buys.

Read from a run's or a comparison's JSON snapshot (`RunResult.to_json`, `CompareResult.to_json`),
so the app's status panel and the CLI say the same thing. "Best" is the lowest held-out
perplexity, as the geometric mean over the run's evaluation corpora (each corpus counts alike,
whatever its scale); a ratio between two variants is the ratio of those means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ghosted_core.report.tables import blocks_text, corpus_tag, fmt, plural, recovered_share


def mean_ppl(ppl: Mapping[str, float], corpora: Sequence[str]) -> float | None:
    """Geometric mean of the perplexities over `corpora`; None unless every corpus has a finite value."""
    values = [ppl.get(c) for c in corpora]
    if not corpora or any(v is None or not math.isfinite(v) or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _values(ppl: Mapping[str, float], corpora: Sequence[str]) -> str:
    return ", ".join(fmt(ppl.get(c), 1) for c in corpora)


def _corpora_text(report: dict, corpora: Sequence[str]) -> str:
    return ", ".join(corpus_tag(report, c) for c in corpora)


def _buys(report: dict, removed: Sequence[int], best: float, dense: float | None, corpora: Sequence[str]) -> str:
    layers = report.get("num_layers")
    share = f" ({len(removed) / layers:.0%} of the decoder)" if layers else ""
    cost = f" at {best / dense:.2f}× the dense model's perplexity" if dense else ""
    mean = f" (geometric mean over {', '.join(corpora)})" if len(corpora) > 1 and dense else ""
    return f"**What it buys:** {len(removed)} of {plural(layers or 0, 'block')} removed{share}{cost}{mean}."


def best_variant(report: dict) -> str | None:
    """A single run's pruned variant with the lowest mean perplexity (None before perplexity)."""
    variants = report.get("variants", {})
    corpora = list(variants.get("dense", {}).get("ppl", {}))
    scored = {name: mean_ppl(e.get("ppl", {}), corpora) for name, e in variants.items() if name != "dense"}
    scored = {name: value for name, value in scored.items() if value is not None}
    return min(scored, key=lambda name: (scored[name], name != "none")) if scored else None


def run_headline(report: dict) -> list[str]:
    """A single run's answer in two lines: the best variant against plain pruning and dense, and what it buys."""
    variants = report.get("variants", {})
    dense = variants.get("dense", {}).get("ppl", {})
    corpora = list(dense)
    best = best_variant(report)
    removed = report.get("removed_layers", [])
    if best is None or not removed:
        return []
    ppl = variants[best]["ppl"]
    plain = variants.get("none", {}).get("ppl", {})
    tags = _corpora_text(report, corpora)
    if best == "none" and len(variants) > 2:
        head = (f"**No operator beats plain pruning** here: with blocks {blocks_text(removed)} removed and nothing "
                f"fitted, {tags} perplexity is {_values(ppl, corpora)} (dense {_values(dense, corpora)}).")
    else:
        against = f" against {_values(plain, corpora)} with nothing fitted (none)" if plain and best != "none" else ""
        shares = [recovered_share(ppl[c], plain.get(c), dense.get(c)) for c in corpora] if plain else []
        recovers = (f": it recovers {', '.join(f'{s:.0%}' for s in shares)} of what pruning lost"
                    if shares and all(s is not None for s in shares) and best != "none" else "")
        head = (f"**Best: {best}** · {tags} perplexity {_values(ppl, corpora)}{against} and "
                f"{_values(dense, corpora)} dense{recovers}.")
    return [head, _buys(report, removed, mean_ppl(ppl, corpora), mean_ppl(dense, corpora), corpora)]


def _cells(report: dict) -> list[dict]:
    """The comparison's table rows that have every corpus, with their mean perplexity under "mean"."""
    compare = report.get("compare", {})
    corpora = list(compare.get("dense", {}).get("ppl", {}))
    rows = []
    for row in compare.get("table", []):
        mean = mean_ppl(row.get("ppl", {}), corpora)
        if mean is not None:
            rows.append(row | {"mean": mean})
    return rows


def best_cell(report: dict) -> tuple[str, str] | None:
    """The (criterion, operator) with the lowest mean perplexity in a comparison (the first criterion on ties)."""
    cells = _cells(report)
    if not cells:
        return None
    best = min(cells, key=lambda row: row["mean"])
    return best["criterion"], best["operator"]


def compare_headline(report: dict) -> list[str]:
    """A comparison's answer: the winning criterion and operator, its margin over the best other criterion's blocks
    and over its own blocks unrecovered, and what it buys."""
    cells = _cells(report)
    if not cells:
        return []
    compare = report["compare"]
    dense = compare.get("dense", {}).get("ppl", {})
    corpora = list(dense)
    best = min(cells, key=lambda row: row["mean"])
    tags = _corpora_text(report, corpora)
    lines = [f"**Best: {best['criterion']} + {best['operator']}** (blocks {blocks_text(best['removed_layers'])}) · "
             f"{tags} perplexity {_values(best['ppl'], corpora)}, dense {_values(dense, corpora)}."]
    margins = []
    others = [row for row in cells if row["plan"] != best["plan"]]
    if others:
        runner = min(others, key=lambda row: row["mean"])
        margins.append(f"{runner['mean'] / best['mean']:.2f}× lower than the best on other blocks "
                       f"({runner['criterion']} + {runner['operator']}: {_values(runner['ppl'], corpora)})")
    plain = next((row for row in cells if row["plan"] == best["plan"] and row["operator"] == "none"), None)
    if plain is not None and best["operator"] != "none":
        margins.append(f"{plain['mean'] / best['mean']:.2f}× lower than the same blocks with nothing fitted "
                       f"(none: {_values(plain['ppl'], corpora)})")
    if margins:
        mean = f" (geometric mean over {', '.join(corpora)})" if len(corpora) > 1 else ""
        lines.append(f"**By how much:** {'; '.join(margins)}{mean}.")
    lines.append(_buys(report, best["removed_layers"], best["mean"], mean_ppl(dense, corpora), corpora))
    return lines


def headline(report: dict) -> list[str]:
    """The answer of a run or a comparison so far (empty before any perplexity, and for a sweep)."""
    if "compare" in report:
        return compare_headline(report)
    if "variants" in report:
        return run_headline(report)
    return []
