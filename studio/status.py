"""The status panel: where a run is, what the results on the page belong to, and what to watch out for.

Every state a run can end in says so in words: complete, stopped (at which stage, and which
stages the results on the page come from), refused (bad input: the page still shows the
previous run, and says which), or failed. Queueing time is shown apart from run time. The
library's advice (a deep cut, a cut through the last block, too little calibration for the
width, operators worse than plain pruning on held-out text, boundary error and perplexity
disagreeing) is listed under the head line.
"""

from __future__ import annotations

from collections.abc import Sequence

from ghosted_core.planning.advice import Advice, calibration_advice, cut_advice, disagreements
from ghosted_core.progress import ProgressEvent
from ghosted_core.report.summary import headline
from ghosted_core.report.tables import context_line, held_out_error, plural, worse_boundaries

NOTHING_SHOWN = {"context": "", "state": "", "stages": []}  # the page before any run


def shown_state(report: dict, state: str) -> dict:
    """What the results on the page now belong to, kept per browser session (gr.State)."""
    return {"context": context_line(report) if report.get("model") else "", "state": state,
            "stages": list(report.get("timings", {}))}


def _shown_note(shown: dict | None) -> str:
    """Which run the results on the page belong to, for a status that replaced that run's own."""
    if not shown or not shown.get("context"):
        return "Nothing has run yet on this page."
    return f"The results below are still those of your previous run ({shown['state']}): {shown['context']}"


def _queue_note(queued: float | None) -> str:
    return f" · waited {queued:.1f} s in the queue before it started" if queued and queued >= 1.0 else ""


def _stage_times(report: dict) -> list[str]:
    timings = report.get("timings", {})
    if not timings:
        return []
    return [f"Stage times ({sum(timings.values()):.1f} s in all): "
            + " · ".join(f"{stage} {seconds:.1f} s" for stage, seconds in timings.items())]


def advice_lines(advice: Sequence[Advice]) -> list[str]:
    """Advice as status lines; severe ones in bold."""
    return [f"⚠ **{a.message}**" if a.severe else f"⚠ {a.message}" for a in advice]


def report_advice(report: dict) -> list[Advice]:
    """The library's advice on what a run measured: the cut it made, its calibration, its fits."""
    variants = report.get("variants", {})
    layers, removed = report.get("num_layers"), report.get("removed_layers", [])
    advice = cut_advice(layers, len(removed), removed) if layers and removed else []
    cal, width = report.get("calibration", {}), report.get("hidden_size")
    operators = [name for name in variants if name != "dense"]
    if width and cal.get("tokens") and removed:
        advice += calibration_advice(cal["tokens"], width, operators)
    for name, entry in variants.items():
        worse = worse_boundaries(entry)
        if name != "none" and worse:
            advice.append(Advice(f"{name} is worse than plain pruning on held-out calibration text "
                                 f"(boundary error above 1 at blocks {', '.join(worse)})"))
    ppl = {corpus: {name: e["ppl"][corpus] for name, e in variants.items() if corpus in e.get("ppl", {})}
           for corpus in variants.get("dense", {}).get("ppl", {})}
    errors = {name: [held_out_error(e, "") for e in entry.get("boundary_error", [])] for name, entry in variants.items()}
    split = disagreements(ppl, {name: [e for e in errs if e is not None] for name, errs in errors.items()})
    if split:
        advice.append(Advice(
            f"boundary error and perplexity disagree for {', '.join(split)}: trust perplexity. It is measured on text "
            "the operators were not fitted on, through the whole model; boundary error is measured at the cut only, "
            "on calibration text, where a few attention-sink tokens can dominate it"))
    return advice


def diagnostics(report: dict | None) -> str:
    """The run's notes (each fit's candidates, scales, fallbacks) and stage times, folded away under one summary
    line: one click shows them, and they never push the answer out of view (results.json has them too)."""
    if not report:
        return ""
    notes = report.get("notes", [])
    lines = _stage_times(report) + [f"*Note:* {note}" for note in notes]
    if not lines:
        return ""
    summary = f"Diagnostics: {plural(len(notes), 'note')} on the fits and calibration, stage times"
    items = "\n".join(f"- {line}" for line in lines)
    return f"<details id='status-diagnostics'><summary>{summary}</summary>\n\n{items}\n\n</details>"


def _body(report: dict | None, advice: Sequence[Advice]) -> list[str]:
    """Under the head line: the answer (report.summary), the run's context, the advice, then the diagnostics."""
    lines = headline(report) if report else []
    if report and report.get("model"):
        lines.append(context_line(report))
    lines += advice_lines(advice)
    folded = diagnostics(report)
    return lines + ([folded] if folded else [])


def progress_line(event: ProgressEvent | None) -> str:
    """The loop a stage is in, with its count and estimate ("score swap_kl: 84 of 252 variants (33%) · …")."""
    return f"⏳ {event.text()}" if event is not None else ""


def running_status(next_stage: str, done: int, total: int, elapsed: float, report: dict | None,
                   advice: Sequence[Advice], queued: float | None = None, progress: ProgressEvent | None = None) -> str:
    """While a run computes: the stage in progress (with its loop's count and estimate when it reported one),
    the answer so far, and the stages done so far."""
    hint = " (first use of this model: converting its GGUF once, about a minute or two)" \
        if next_stage == "convert model" else ""
    head = f"**Running:** {next_stage}{hint} (stage {done + 1} of {total}) · {elapsed:.1f} s{_queue_note(queued)}"
    return "\n\n".join([head, *filter(None, [progress_line(progress)]), *_body(report, advice)])


def complete_status(elapsed: float, report: dict, advice: Sequence[Advice], queued: float | None = None) -> str:
    """After the last stage."""
    return "\n\n".join([f"**Run complete** in {elapsed:.1f} s{_queue_note(queued)}", *_body(report, advice)])


def stopped_status(where: str, elapsed: float, report: dict | None, stages: Sequence[str],
                   advice: Sequence[Advice] = ()) -> str:
    """After Stop: where the run stopped and which of its stages the results on the page come from."""
    finished = list((report or {}).get("timings", {}))
    missing = [s for s in dict.fromkeys(stages) if s not in finished]
    head = (f"**Run stopped** during {where} after {elapsed:.1f} s: you pressed Stop, and the server stopped at "
            f"its next batch.")
    belongs = (f"The results below belong to this stopped run: its finished stages ({', '.join(finished)}); "
               f"not computed: {', '.join(missing) or 'nothing'}." if finished
               else "It had finished no stage: the results below are empty.")
    return "\n\n".join([head, belongs, *_body(report, advice)])


def stopped_before_start(shown: dict | None) -> str:
    """Stop pressed while no run of this session was computing (one waiting in the queue is dropped)."""
    return "\n\n".join(["**Stopped:** no run of yours was computing; a run still waiting in the queue was dropped.",
                        _shown_note(shown)])


def refused_status(message: str, shown: dict | None) -> str:
    """Bad input, refused before any work: the page still shows the previous run, and says so."""
    return "\n\n".join([f"**Run refused:** {message}", _shown_note(shown)])


def failed_status(message: str, where: str, report: dict | None) -> str:
    """An error during a run: what failed, and which stages the results on the page come from."""
    finished = list((report or {}).get("timings", {}))
    belongs = (f"The results below belong to this failed run: its finished stages ({', '.join(finished)})."
               if finished else "It had finished no stage.")
    return "\n\n".join([f"**Run failed** during {where}: {message}", belongs])
