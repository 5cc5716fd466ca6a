"""The command line's plain-text summaries: a run's and a sweep's tables, with corpus labels, sizes and speeds."""

from __future__ import annotations

from ghosted_core.cli_distill import distill_lines
from ghosted_core.recovery.assessment import HELDOUT_FLAG
from ghosted_core.report.summary import run_headline
from ghosted_core.report.tables import comparison, gain_cells, paired_cell
from ghosted_core.run.result import RunResult, task_comparisons_json
from ghosted_core.run.sweep import SweepResult
from ghosted_core.selection.criteria import criterion_title


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:.3g}"


def _corpus_tag(report: dict, corpus: str) -> str:
    """'ptb (exact)', 'wiki (stand-in)' or 'your text': the short form for column headers."""
    info = report["corpora"].get(corpus, {})
    if info.get("user"):
        return corpus
    return f"{corpus} ({'exact' if info.get('real') else 'stand-in'})"


def _corpus_lines(report: dict, corpora: list[str]) -> list[str]:
    """The calibration corpus and every evaluation corpus with its full label and size."""
    lines = []
    if report["calibration"]["label"]:
        cal = report["calibration"]
        lines.append(f"calibration: {cal['label']}, {cal['sequences']} x {cal['seqlen']} tokens (seed {cal['seed']})")
    bos = report.get("bos") or {}
    if bos.get("applied") == "window":
        lines.append(f"windows: each starts with {bos['token']} (--bos {bos['rule']}), never scored")
    for name in corpora:
        info = report["corpora"][name]
        lines.append(f"  {name}: {info['label']}, {info.get('windows')} windows, {info.get('tokens')} tokens, "
                     f"{info.get('predicted_tokens')} predicted")
    return lines


def _block_runs(blocks: list[int]) -> str:
    """[3, 12, 13, 14] → '3,12-14'."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b - 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def sweep_summary(result: SweepResult) -> str:
    """Depth × operator: perplexity and damage recovered per corpus (labelled), held-out boundary error."""
    report = result.to_json()
    sweep = report["sweep"]
    stats = sweep["statistics"]
    corpora = list(result.dense)
    lines = [f"sweep: {report['model']} ({report['num_layers']} blocks) | criterion: {report['criterion']} | "
             f"depths: {', '.join(map(str, sweep['depths']))} | one calibration pass over "
             f"{stats['distinct_boundaries']} distinct boundaries (statistics {stats['bytes'] / 2**20:.1f} MiB)"]
    lines += _corpus_lines(report, corpora)
    tags = {c: _corpus_tag(report, c) for c in corpora}
    header = ["n", "removed", "variant", *(f"ppl {tags[c]}" for c in corpora), *(f"recovered {c}" for c in corpora),
              "boundary err (held-out, all / ordinary)", *GAIN_HEADER]
    first = sweep["results"][0] if sweep["results"] else {}
    rows = [["0", "-", "dense", *(_fmt(sweep["dense"]["ppl"][c], 2) for c in corpora), *("-" for _ in corpora), "-",
             *_gain_cells({"gain": first.get("dense_gain")})]]
    for entry in sweep["results"]:
        for name, variant in entry["variants"].items():
            err = "; ".join(f"{e['boundary']}: {_fmt(e['heldout'])} / {_fmt(e['heldout_ordinary'])}"
                            for e in variant["boundary_error"]) or "-"
            recovered = [variant["recovered"].get(c) for c in corpora]
            rows.append([str(entry["n"]), _block_runs(entry["removed_layers"]), name,
                         *(_fmt(variant["ppl"].get(c), 2) for c in corpora),
                         *("-" if r is None else f"{100 * r:.0f}%" for r in recovered), err, *_gain_cells(variant)])
    lines += _table(header, rows)
    lines += _gain_lines(first.get("gain"))
    lines.append("recovered = (ppl_none - ppl_op) / (ppl_none - ppl_dense): 100% is the dense model, 0% plain pruning")
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def summary(result: RunResult) -> str:
    """A plain-text table of perplexity and boundary error per variant, with corpus labels."""
    report = result.to_json()
    about = report.get("model_description")  # what the model is, honestly labelled (third-party packages say so)
    model = f"{report['model']} ({report['num_layers']} blocks)" + (f": {about}" if about else "")
    lines = [f"model: {model} | criterion: {criterion_title(report['criterion'])} | "
             f"removed: {report['removed_layers']} | boundaries: {report['boundaries']}"]
    lines += [line.replace("**", "") for line in run_headline(report)]  # the answer first
    corpora = list(result.perplexity)
    lines += _corpus_lines(report, corpora)
    header = ["variant", *(f"ppl {c}" for c in corpora), "boundary err (held-out, all / ordinary)", "antisym",
              *GAIN_HEADER]
    rows = []
    flagged = False
    for name, entry in report["variants"].items():
        errors = entry.get("boundary_error", [])
        flagged = flagged or any(e.get("heldout_worse_than_pruning") for e in errors)
        err = "; ".join(f"{e['boundary']}: {_fmt(e['heldout'])}{' !' if e.get('heldout_worse_than_pruning') else ''}"
                        f" / {_fmt(e['heldout_ordinary'])}" for e in errors) or "-"
        anti = ", ".join(_fmt(a, 2) for a in entry.get("antisym_fraction", [])) or "-"
        rows.append([name, *(_fmt(entry["ppl"].get(c), 2) for c in corpora), err, anti, *_gain_cells(entry)])
    lines += _table(header, rows)
    lines += _gain_lines(report.get("gain"))
    if flagged:
        lines.append(f"  ! = {HELDOUT_FLAG} (held-out boundary error above 1)")
    lines += distill_lines(report)
    if result.tasks:
        lines += _task_table(result)
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


GAIN_HEADER = ["size as saved (x dense)", "prefill / decode x dense"]


def _gain_cells(entry: dict) -> list[str]:
    """A variant's saved size and its speed against dense, as a terminal shows them ('-' where not measured)."""
    return gain_cells(entry, times="x", missing="-")


def _gain_lines(settings: dict | None) -> list[str]:
    """What the speed columns rest on: tokens, rounds, device, threads, load."""
    if not settings or not settings.get("measured"):
        return ["  size: weights as the export writes them; speed not measured"] if settings else []
    machine = settings.get("measured_on") or {}
    return [f"  size: weights as the export writes them (stock where it folds) | speed: transformers, batch 1, prefill "
            f"{settings['prefill_tokens']} tokens, decode {settings['decode_tokens']} tokens, median of "
            f"{settings['repeats']} rounds beside dense, {machine.get('device')} ({machine.get('cpu')}), "
            f"{machine.get('threads')} threads, load {machine.get('load_average')}"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]


def _task_table(result: RunResult) -> list[str]:
    """Zero-shot accuracy per variant and task, with where the data came from."""
    first = next(iter(result.tasks.values()))
    names = [s.task for s in first.scores]
    lines = [f"zero-shot acc ± standard error (lm-eval's acc and acc_stderr; {first.source} data, "
             f"{first.limit or 'all'} examples per task, seed {first.seed}):"]
    rows = [[variant, *(f"{r.score(t).acc:.3f} ± {r.score(t).acc_stderr:.3f}" for t in names),
             f"{_fmt(r.mean_acc)} ± {_fmt(r.mean_acc_stderr)}"] for variant, r in result.tasks.items()]
    lines += _table(["variant", *names, "mean"], rows)
    lines.append(f"  chance level (mean over tasks): {_fmt(first.mean_chance)}")
    lines += [f"  {u.task}: unavailable ({u.reason})" for u in first.unavailable]
    report = {"task_comparisons": task_comparisons_json(result.tasks)}
    for against in ("none", "dense"):
        paired = [[variant, *(paired_cell(comparison(report, variant, against, t)) for t in [*names, "mean"])]
                  for variant in result.tasks if comparison(report, variant, against, "mean")]
        if paired:
            lines.append(f"paired accuracy difference to {against}, points [95% CI], p (McNemar exact per task, "
                         "normal over the mean), on the same examples:")
            lines += _table(["variant", *names, "mean"], paired)
    return lines
