"""The command line's distillation flags: one `--distill_<field>` per `DistillOptions` field, and its summary table.

`--distill ghost_capped,none` adds distilled variants to the run (each beside the variant it starts
from); the flags set their budget and schedule. Holds no method logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ghosted_core.distill.options import HELP, LOSSES, PRECISIONS, DistillOptions
from ghosted_core.distill.targets import TRAINABLES
from ghosted_core.run.options import distilled


CHOICES = {"loss": LOSSES, "precision": PRECISIONS}  # the fields whose values are names


def add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distillation (after the fit; see docs/distill.md)")
    group.add_argument("--distill", default="", metavar="VARIANTS",
                       help="distill these variants after the fit: a comma list of names from --insert_type ('all': "
                            "every one), each BASE (its operator's weights, or block s-1's MLP where the operator has "
                            "none) or BASE+kd / BASE+kd_TARGET with TARGET one of "
                            f"{', '.join(t for t in TRAINABLES if t != 'operator')}")
    hints = typing.get_type_hints(DistillOptions)
    for field in dataclasses.fields(DistillOptions):
        kind = hints[field.name]
        value_type = next((t for t in typing.get_args(kind) if t is not type(None)), kind) if typing.get_args(kind) else kind
        group.add_argument(f"--distill_{field.name}", type=value_type, default=field.default, help=HELP[field.name],
                           choices=CHOICES.get(field.name))


def distill_options(args: argparse.Namespace) -> DistillOptions:
    return DistillOptions(**{f.name: getattr(args, f"distill_{f.name}") for f in dataclasses.fields(DistillOptions)})


def insert_types(args: argparse.Namespace) -> str:
    """--insert_type with the variants --distill asks for appended."""
    if not args.distill.strip():
        return args.insert_type
    fitted = [name.strip() for name in args.insert_type.split(",") if name.strip()]
    return ",".join([*fitted, *distilled(args.distill, fitted)])


def distill_lines(report: dict) -> list[str]:
    """What each distillation did: from where, what trained, budget, validation KL, time per step."""
    rows = [(name, entry["distill"]) for name, entry in report["variants"].items() if "distill" in entry]
    if not rows:
        return []
    lines = ["distillation (teacher: the dense model's top-K on the calibration text; validation: held-out "
             "calibration windows):"]
    for name, d in rows:
        per_step = "-" if d["seconds_per_step"] is None else f"{d['seconds_per_step']:.2f} s/step"
        lines.append(f"  {name}: from {d['base']}, trained {d['target']} ({d['parameters']:,} parameters), "
                     f"{d['steps']}/{d['steps_planned']} steps x {d['batch_size']} x {d['seqlen']} tokens "
                     f"(lr {d['schedule']['lr']:g}, top {d['top_k']}{' + tail' if d.get('loss_form') == 'topk_tail' else ''}), "
                     f"validation KL {d['start_val']:.4f} -> "
                     f"{d['best_val']:.4f} (best at step {d['best_step']}; {d['stopped']}), {per_step}, "
                     f"{'stock' if d['stock'] else 'remote code'}")
    return lines
