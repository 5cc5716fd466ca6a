"""A run's distillation stage: the teacher's targets once, then every distilled variant from its fitted start.

After the fit, each `+kd` variant starts from the variant it names (fitted once, kept beside it),
trains what its target says on the teacher's cached top-K distribution over calibration windows
(never the evaluation text), and joins the run's variants for every later stage: perplexity,
drift, generation, tasks, export. The stage yields after the teacher pass and after every
validation of every student, so that a front end can draw the loss curves live.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from transformers import PreTrainedModel

from ghosted_core.data import corpora
from ghosted_core.distill.targets import CutSites, finalize, get_trainable, make_student
from ghosted_core.distill.teacher import TeacherCache, build_teacher
from ghosted_core.distill.train import DistillReport, distill_student
from ghosted_core.evaluation.perplexity import shared_prefix
from ghosted_core.export.fold import stock_blockers
from ghosted_core.plan import PruningPlan
from ghosted_core.run.options import RunOptions, VariantSpec
from ghosted_core.stopping import StopCheck

log = logging.getLogger(__name__)


def distilled_variants(options: RunOptions) -> list[VariantSpec]:
    return [v for v in options.variants if v.distill is not None]


def train_blocks(plan: PruningPlan, options: RunOptions) -> int | None:
    """Blocks from the earliest one any distilled variant of the run trains to the end (the memory plan's backward
    depth); None without distillation. Conservative: the block before the first cut, `lora_window` earlier for lora."""
    targets = {v.distill for v in distilled_variants(options)}
    if not targets or not plan.boundaries:
        return None
    sites = CutSites.of(plan)
    first = min((a for a in sites.before if a is not None), default=0)
    if "lora" in targets:
        first = 0 if options.distill.lora_window == 0 else max(0, first - options.distill.lora_window + 1)
    return sites.blocks - first


def validation_windows(options: RunOptions) -> int:
    """Validation windows of a distillation: as asked, or the run's held-out calibration windows (at least 1)."""
    return options.distill.val_sequences or max(1, options.heldout)


def teacher_cache(dense: PreTrainedModel, tokenizer, options: RunOptions, prefix_blocks: Sequence[int],
                  should_stop: StopCheck = None) -> TeacherCache:
    """The teacher's targets for the run's distillation windows: training windows from the calibration fit windows
    on, validation windows from its held-out ones (`corpora.distillation_windows`)."""
    d = options.distill
    train_ids, val_ids = corpora.distillation_windows(
        tokenizer, options.corpus(options.calibration, "calibration"), d.train_windows(options.seqlen),
        validation_windows(options), options.seqlen, options.seed, options.train_size or 0, options.heldout, options.bos)
    return build_teacher(dense, train_ids, val_ids, d.vocabulary_kept(int(dense.config.vocab_size)), prefix_blocks,
                         d.prefix_budget, d.cache_budget, d.batch_size, options.quiet, should_stop)


def _record(variant: PreTrainedModel, spec: VariantSpec, report: DistillReport) -> dict:
    record = dict(getattr(variant.config, "ghosted", None) or {})
    summary = {k: v for k, v in report.to_json().items() if k not in ("loss_curve", "val_curve")}
    return record | {"variant": spec.name, "distill": summary}


def distill_stage(dense: PreTrainedModel, tokenizer, plan: PruningPlan, options: RunOptions,
                  models: dict[str, PreTrainedModel], reports: dict[str, DistillReport], corpus_label: str,
                  should_stop: StopCheck = None) -> Iterator[str]:
    """Distill every `+kd` variant of `options`, adding each to `models` (its report to `reports`) once trained;
    yields a short note of what happened after each step worth showing (the teacher pass, each validation)."""
    wanted = distilled_variants(options)
    d = options.distill
    starts: dict[str, int] = {}
    students = {}
    for spec in wanted:  # build every student first: a target with nothing to train is refused before any work
        base = models[spec.base]
        report = DistillReport(
            spec.name, spec.base, spec.distill, get_trainable(spec.distill).description, False, 0, (),
            d.planned_steps(options.seqlen), d.batch_size, options.seqlen, d.lr or get_trainable(spec.distill).lr,
            d.min_lr_factor, d.warmup, d.weight_decay, d.vocabulary_kept(int(dense.config.vocab_size)),
            int(dense.config.vocab_size), d.loss, d.precision, "", corpus_label)
        student = make_student(base, dense, plan, spec.distill, d, {})
        report.parameters, report.trained = student.count, student.paths
        students[spec.name] = (student, report)
        if student.first_block <= shared_prefix(dense, student.model):
            starts[spec.name] = student.first_block
    cache = teacher_cache(dense, tokenizer, options, sorted(set(starts.values())), should_stop)
    yield f"teacher targets: {cache.windows} windows, top {cache.kept} in {cache.seconds:.1f} s"
    for name, (student, report) in students.items():
        spec = next(v for v in wanted if v.name == name)
        for _ in distill_student(student, dense, cache, d, report, should_stop, options.quiet):
            reports[name] = report
            yield name
        model = finalize(student, dense.dtype)
        report.stock = not stock_blockers(model)
        model.config.ghosted = _record(models[spec.base], spec, report)
        models[name] = model
        reports[name] = report
        yield name
    del cache
