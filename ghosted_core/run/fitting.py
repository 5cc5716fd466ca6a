"""Fit every variant's operators at every boundary, realize them as modules, and measure held-out errors.

Independent fits read the dense model's statistics; `+seq` variants fit boundary k on the
activations of the model already pruned and recovered upstream of it (`fit_variant` keeps every
fit; `fit_variants` is the memory-lean path used by runs and sweeps).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

from ghosted_core.progress import Tracker
from ghosted_core.statistics import BoundaryStats
from ghosted_core.calibration.collect import HeldoutRows, collect_boundary_stats
from ghosted_core.recovery.heldout import measure_errors
from ghosted_core.architectures import architecture_of
from ghosted_core.model.loading import decoder_blocks, module_device, final_norm
from ghosted_core.recovery.assessment import BoundaryMap, Diagnostics, FitReport, assess
from ghosted_core.recovery.magcomp import cut_index
from ghosted_core.recovery.operators import Fit, choose_by_heldout, get_operator, needs_of
from ghosted_core.recovery.modules import branch_replacement, refit_replacement, residual_module
from ghosted_core.plan import PruningPlan
from ghosted_core.model.scaling import scale_before
from ghosted_core.model.surgery import build_variant, patch_site
from ghosted_core.run.options import RunOptions, VariantSpec

log = logging.getLogger(__name__)


Realized = tuple[dict[int, nn.Module], dict[int, dict[str, nn.Module]], dict[int, float]]


def _realize(dense: PreTrainedModel, fits: Sequence[Fit]) -> Realized:
    """Boundary modules (keyed by the dense index they feed), ReplaceMe and refit replacements (keyed by block)
    and upstream scales (magcomp; keyed by the boundary's first removed block)."""
    blocks = decoder_blocks(dense)
    arch = architecture_of(dense.config)
    patches: dict[int, nn.Module] = {}
    replacements: dict[int, dict[str, nn.Module]] = {}
    scales: dict[int, float] = {}
    for fit in fits:
        if fit.upstream_scale is not None:
            scales[fit.boundary.start] = scales.get(fit.boundary.start, 1.0) * fit.upstream_scale
        if fit.update is None:
            continue
        if fit.site == "inner":
            replacements[fit.boundary.start - 1] = refit_replacement(fit, blocks[fit.boundary.start - 1], arch)
        elif fit.upstream_scale is not None:
            continue  # a scalar map: carried by the scales above
        elif fit.site == "residual":
            site = patch_site(fit.boundary)
            target = blocks[site] if site < len(blocks) else final_norm(dense)
            patches[site] = residual_module(fit, module_device(target))
        else:
            replacements[fit.boundary.start - 1] = branch_replacement(fit, blocks[fit.boundary.start - 1], arch)
    return patches, replacements, scales


def assemble_variant(dense: PreTrainedModel, removed: Sequence[int], patches, replacements, scales: dict[int, float],
                     record: dict) -> PreTrainedModel:
    """`build_variant` plus the upstream scales: the stream entering each cut starting at dense block j is
    scaled by scales[j], carried by the weights before it (shared, not copied)."""
    model = build_variant(dense, removed, patches, replacements, record)
    for start, scale in sorted(scales.items()):
        model = scale_before(model, cut_index(start, removed), scale)
    return model


def _record(plan: PruningPlan, variant: VariantSpec) -> dict:
    return {"dense_layers": plan.num_layers, "removed_layers": list(plan.removed),
            "boundaries": [[b.start, b.end] for b in plan.boundaries], "operator": variant.operator,
            "sequential": variant.sequential}


def build_recovered(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, fits: Sequence[Fit]) -> PreTrainedModel:
    """The pruned model with a variant's fitted operators, sharing the dense weights."""
    patches, replacements, scales = _realize(dense, fits)
    return assemble_variant(dense, plan.removed, patches, replacements, scales, _record(plan, variant))


def _upstream(plan: PruningPlan, k: int) -> PruningPlan:
    """The plan that removes only the runs before boundary k (the sequential fit's source model)."""
    removed = tuple(i for b in plan.boundaries[:k] for i in b.blocks)
    return PruningPlan(plan.num_layers, removed, plan.criterion)


def _sequential_stats(dense: PreTrainedModel, plan: PruningPlan, k: int, view: PreTrainedModel, batches,
                      options: RunOptions, operator: str) -> tuple[BoundaryStats, int]:
    """Boundary k's statistics with x_pre from the upstream-recovered `view` (and where it reads them)."""
    boundary = plan.boundaries[k]
    source_start = boundary.start - len(_upstream(plan, k).removed)
    stats = collect_boundary_stats(view, source_start, dense, boundary, batches, options.calibrate, needs_of([operator]))
    return stats, source_start


def report_detail(options: RunOptions) -> Diagnostics:
    """The fit-report parts a run computes: as asked, plus calibration-token errors when nothing is held out
    (they then stand in for the held-out errors every view shows)."""
    detail = options.diagnostics
    return detail if options.heldout > 0 else dataclasses.replace(detail, fit_errors=True)


def _with_heldout(report: FitReport, errors) -> FitReport:
    return report if errors is None else dataclasses.replace(
        report, heldout_error=errors.relative, heldout_error_ordinary=errors.relative_ordinary,
        heldout_worse_than_pruning=errors.relative is not None and errors.relative > 1.0)


def choose_fit(dense: PreTrainedModel, fit: Fit, batches, options: RunOptions, source: PreTrainedModel | None = None,
               source_start: int | None = None, kept: HeldoutRows | None = None) -> Fit:
    """A fit that carries candidates (replaceme_keepsink: one per number of sink directions) becomes the
    candidate with the lowest held-out boundary error. Time: one held-out pass up to the boundary for
    all candidates (none with `kept` rows; one per candidate for a sequential fit); memory: the
    candidates' C×C updates."""
    if not fit.candidates:
        return fit
    if source is None:
        errors = measure_errors(dense, list(fit.candidates), batches, options.calibrate, kept=kept)
    else:
        errors = [measure_errors(dense, [c], batches, options.calibrate, source, source_start)[0] for c in fit.candidates]
    return choose_by_heldout(fit, errors)


def fit_variant(dense: PreTrainedModel, plan: PruningPlan, variant: VariantSpec, stats: Sequence[BoundaryStats],
                batches, options: RunOptions) -> tuple[list[Fit], list[FitReport]]:
    """Fit a variant's operator at every boundary, independently or sequentially, with held-out errors.

    Keeps every float64 fit (C×C per boundary); `fit_variants` is the memory-lean path for many variants.
    """
    spec = get_operator(variant.operator)
    fits: list[Fit] = []
    reports: list[FitReport] = []
    held: list = []
    for k, boundary_stats in enumerate(stats):
        source, source_start = None, None
        if variant.sequential and k > 0:
            source = build_recovered(dense, _upstream(plan, k), variant, fits)
            boundary_stats, source_start = _sequential_stats(dense, plan, k, source, batches, options, variant.operator)
        fit = choose_fit(dense, spec.fit(boundary_stats, options.fit), batches, options, source, source_start)
        fits.append(fit)
        reports.append(assess(fit, boundary_stats, detail=report_detail(options)))
        if source is not None:
            held.append(measure_errors(dense, [fit], batches, options.calibrate, source, source_start)[0])
    independent = [k for k in range(len(fits)) if not (variant.sequential and k > 0)]
    for k, errors in zip(independent, measure_errors(dense, [fits[k] for k in independent], batches, options.calibrate)):
        reports[k] = _with_heldout(reports[k], errors)
    for k, errors in zip([k for k in range(len(fits)) if k not in independent], held):
        reports[k] = _with_heldout(reports[k], errors)
    return fits, reports


@dataclass
class VariantBuild:
    """A variant being fitted: its boundary modules so far, what applies each fit, its reports."""

    spec: VariantSpec
    patches: dict[int, nn.Module] = field(default_factory=dict)
    replacements: dict[int, dict[str, nn.Module]] = field(default_factory=dict)
    scales: dict[int, float] = field(default_factory=dict)
    maps: list[BoundaryMap] = field(default_factory=list)
    reports: list[FitReport] = field(default_factory=list)

    def add(self, dense: PreTrainedModel, fit: Fit, stats: BoundaryStats, detail: Diagnostics = Diagnostics()) -> None:
        """Realize, assess (the parts `detail` asks for) and compact one fit; the float64 update is not kept."""
        patches, replacements, scales = _realize(dense, [fit])
        self.patches.update(patches)
        self.replacements.update(replacements)
        self.scales.update(scales)
        self.reports.append(assess(fit, stats, detail=detail))
        self.maps.append(BoundaryMap.of(fit))


def fit_variants(dense: PreTrainedModel, plan: PruningPlan, variants: Sequence[VariantSpec],
                 stats: list[BoundaryStats | None], batches, options: RunOptions,
                 kept: HeldoutRows | None = None) -> tuple[dict[str, list[FitReport]], dict[str, PreTrainedModel]]:
    """Fit every variant at every boundary, build the variants, then measure held-out errors in one pass
    (no pass with the `kept` rows of the calibration pass, for the independent fits).

    Memory: boundary by boundary, every fit that reads a boundary's statistics is made, realized
    as its module and compacted (`BoundaryMap`), then that entry of `stats` is set to None (the
    caller's list: statistics are freed as soon as the fits exist). Boundary 0's statistics wait
    for the sequential variants. Time: one C×C solve per least-squares fit and one held-out pass
    for all independent fits, plus two forwards per batch per later boundary of a sequential variant.
    """
    builds = {v.name: VariantBuild(v) for v in variants}
    sequential = [v for v in variants if v.sequential]
    progress = Tracker("fit operators", len(stats) * len(variants), "fits", options.quiet)
    for k in range(len(stats)):
        for variant in variants:
            if not variant.sequential or k == 0:
                fit = choose_fit(dense, get_operator(variant.operator).fit(stats[k], options.fit), batches, options,
                                 kept=kept)
                builds[variant.name].add(dense, fit, stats[k], report_detail(options))
                del fit
            progress.advance()
        if k > 0 or not sequential:
            stats[k] = None
    if stats:
        stats[0] = None
    independent = [(b, k) for b in builds.values() for k in range(len(b.maps))]
    for variant in sequential:
        build = builds[variant.name]
        for k in range(1, len(plan.boundaries)):
            upstream = _upstream(plan, k)
            view = assemble_variant(dense, upstream.removed, build.patches, build.replacements, build.scales,
                                    _record(upstream, variant))
            boundary_stats, source_start = _sequential_stats(dense, plan, k, view, batches, options, variant.operator)
            fit = get_operator(variant.operator).fit(boundary_stats, options.fit)
            fit = choose_fit(dense, fit, batches, options, view, source_start)
            build.add(dense, fit, boundary_stats, report_detail(options))
            del boundary_stats
            errors = measure_errors(dense, [build.maps[k]], batches, options.calibrate, view, source_start)[0]
            build.reports[k] = _with_heldout(build.reports[k], errors)
    measured = measure_errors(dense, [b.maps[k] for b, k in independent], batches, options.calibrate, kept=kept)
    for (build, k), errors in zip(independent, measured):
        build.reports[k] = _with_heldout(build.reports[k], errors)
    reports = {name: b.reports for name, b in builds.items()}
    models = {name: assemble_variant(dense, plan.removed, b.patches, b.replacements, b.scales, _record(plan, b.spec))
              for name, b in builds.items()}
    return reports, models
