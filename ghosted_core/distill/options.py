"""What a distillation is asked to do (`DistillOptions`), and how a distilled variant is named.

A distilled variant is named after the variant it starts from and what trains:
`ghost_capped+kd` trains the operator's own weights (the boundary map), `none+kd_mlp` trains a
stock weight the model already has (block s−1's MLP before each cut); see `distill.targets`
for every name. The variant it starts from is fitted once and kept, so each run shows every
distilled variant beside its start, at the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from ghosted_core.errors import GhostedError

LOSSES = ("topk", "topk_tail")  # `distill.loss.distill_loss`'s forms

KD_SUFFIX = "+kd"
OPERATOR_TARGET = "operator"  # `+kd`: the operator's own weights
PRECISIONS = ("auto", "fp32", "bf16")  # auto: bf16 autocast on a GPU, fp32 on a CPU


def kd_name(base: str, target: str) -> str:
    """The variant name of `base` distilled with `target` ("ghost+kd", "none+kd_mlp")."""
    return f"{base}{KD_SUFFIX}" if target == OPERATOR_TARGET else f"{base}{KD_SUFFIX}_{target}"


def split_kd_name(name: str) -> tuple[str, str | None]:
    """(base variant, target) of a variant name; target None when the name asks for no distillation."""
    base, found, rest = name.partition(KD_SUFFIX)
    if not found:
        return name, None
    if rest == "":
        return base, OPERATOR_TARGET
    if not rest.startswith("_") or rest == "_":
        raise GhostedError(f"{name!r}: a distilled variant is named BASE+kd (the operator trains) or BASE+kd_TARGET "
                           "(e.g. none+kd_mlp)")
    return base, rest[1:]


@dataclass(frozen=True)
class DistillOptions:
    """A lightweight knowledge distillation after the fit (LinearPatch's, generalized); sized for a 2-core CPU.

    The teacher is the dense model; its top-K next-token distribution is computed once on the
    calibration corpus (never the evaluation text) and cached; the student trains on the KL to
    it. The budget is `steps`, or else `tokens` (both count training tokens once: one epoch).
    """

    tokens: int = 24_576  # training tokens (steps × batch_size × seqlen); the paper's: 5,000 × 2,048
    steps: int | None = None  # optimizer steps; overrides `tokens`
    batch_size: int = 2  # sequences per step (LinearPatch: 1 × 2,048 tokens)
    lr: float | None = None  # AdamW learning rate (None: the target's own default, `targets.TRAINABLES`)
    min_lr_factor: float = 20.0  # the cosine schedule ends at lr / min_lr_factor (LinearPatch's default)
    warmup: int = 0  # linear warm-up steps before the cosine
    # decoupled weight decay pulls weights toward zero, not toward their start (the identity of W = I + M, the
    # dense MLP): 0 by default; LinearPatch's 1e-4 at lr 1e-4 moves a weight by 1e-8 per step
    weight_decay: float = 0.0
    grad_clip: float | None = None  # clip the gradient norm (None: no clipping, as LinearPatch)
    top_k: int = 50  # teacher logits kept per token (LinearPatch: 50); 0: the full vocabulary
    # "topk": LinearPatch's KL over the teacher's top K renormalized among them (blind to the student's tail mass);
    # "topk_tail": those K entries plus one bucket for the rest, from full softmaxes (the head runs on every entry)
    loss: str = "topk"
    val_sequences: int | None = None  # validation windows (None: the run's held-out calibration windows)
    eval_every: int | None = None  # steps between validations (None: about 8 per budget)
    patience: int = 3  # validations without improvement before stopping early (0: never stop early)
    lora_rank: int = 8  # `lora`: the rank of each low-rank change
    lora_window: int = 2  # `lora`: kept blocks on each side of a cut that change (0: every kept block)
    precision: str = "auto"
    prefix_budget: int = 2**30  # bytes of dense prefix states kept for every step (above it: recomputed)
    cache_budget: int = 8 * 2**30  # bytes the teacher cache may take on the host (above it: refused)

    def __post_init__(self) -> None:
        checks = {"--distill_tokens": self.tokens, "--distill_batch_size": self.batch_size,
                  "--distill_lora_rank": self.lora_rank}
        for flag, value in checks.items():
            if value < 1:
                raise GhostedError(f"{flag} must be at least 1 (got {value})")
        if self.steps is not None and self.steps < 1:
            raise GhostedError(f"--distill_steps must be at least 1 (got {self.steps})")
        if self.lr is not None and not 0 < self.lr < 1:
            raise GhostedError(f"--distill_lr must be between 0 and 1 (got {self.lr})")
        if self.min_lr_factor < 1:
            raise GhostedError(f"--distill_min_lr_factor must be at least 1 (got {self.min_lr_factor})")
        if self.top_k < 0 or self.warmup < 0 or self.patience < 0 or self.lora_window < 0 or self.weight_decay < 0:
            raise GhostedError("--distill_top_k, --distill_warmup, --distill_patience, --distill_lora_window and "
                               "--distill_weight_decay must be at least 0")
        if self.val_sequences is not None and self.val_sequences < 1:
            raise GhostedError(f"--distill_val_sequences must be at least 1 (got {self.val_sequences})")
        if self.eval_every is not None and self.eval_every < 1:
            raise GhostedError(f"--distill_eval_every must be at least 1 (got {self.eval_every})")
        if self.loss not in LOSSES:
            raise GhostedError(f"unknown --distill_loss {self.loss!r}; use one of {', '.join(LOSSES)}")
        if self.precision not in PRECISIONS:
            raise GhostedError(f"unknown --distill_precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")

    def planned_steps(self, seqlen: int) -> int:
        """Optimizer steps of the budget: `steps`, or the tokens over the tokens of one step (at least 1)."""
        return self.steps if self.steps is not None else max(1, -(-self.tokens // (self.batch_size * seqlen)))

    def train_windows(self, seqlen: int) -> int:
        """Training windows the budget reads once (one epoch)."""
        return self.planned_steps(seqlen) * self.batch_size

    def validations_every(self, seqlen: int) -> int:
        return self.eval_every or max(1, self.planned_steps(seqlen) // 8)

    def check_vocabulary(self, vocab: int, model: str) -> None:
        """Refuse, before any work, a top-K larger than the model's vocabulary (0 is how to ask for all of it)."""
        if self.top_k > vocab:
            raise GhostedError(f"--distill_top_k {self.top_k} is larger than the vocabulary of {model} ({vocab:,} "
                               "entries); use at most that, or 0 for the whole vocabulary")

    def vocabulary_kept(self, vocab: int) -> int:
        """Teacher entries kept per token: top_k, or the whole vocabulary (top_k 0 or ≥ the vocabulary)."""
        return vocab if self.top_k == 0 or self.top_k >= vocab else self.top_k


# every field's help, for the command line's --distill_<field> flags (one per field: they cannot drift apart)
HELP = {
    "tokens": "training tokens of each distillation (one epoch over calibration windows; the paper: 5,000 x 2,048)",
    "steps": "optimizer steps of each distillation (overrides --distill_tokens)",
    "batch_size": "calibration windows per step",
    "lr": "AdamW learning rate (default: the target's own, see docs/distill.md)",
    "min_lr_factor": "the cosine schedule ends at lr / this",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW's decoupled weight decay (pulls weights toward zero, not toward their start)",
    "grad_clip": "clip the gradient norm at this value (default: no clipping)",
    "top_k": "teacher logits cached per token (LinearPatch: 50); 0 = the whole vocabulary",
    "loss": "topk: KL over the teacher's top K renormalized among them (LinearPatch); topk_tail: those K plus one "
            "bucket for the rest of the vocabulary, from full softmaxes (sees mass leaking to the tail; the head runs "
            "on the whole vocabulary)",
    "val_sequences": "validation windows (default: the run's held-out calibration windows)",
    "eval_every": "steps between validations (default: about 8 per distillation)",
    "patience": "validations without improvement before stopping early (0: never)",
    "lora_rank": "rank of each low-rank change (+kd_lora)",
    "lora_window": "kept blocks on each side of a cut that get low-rank changes (+kd_lora; 0 = every kept block)",
    "precision": "auto (bf16 autocast on a GPU, fp32 on a CPU), fp32 or bf16",
    "prefix_budget": "bytes of dense prefix states the teacher pass keeps for every step (above: recomputed)",
    "cache_budget": "bytes the teacher cache may take on the host (above: refused)",
}
