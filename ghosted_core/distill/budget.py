"""What a distillation holds, where: the byte formula the memory plan adds as its "distill" phase.

Per distilled variant, trained one after another (the largest counts):
- its trained parameters P, float32: P · (4 weight + 4 gradient + 8 AdamW moments + 4 best copy) B, and
  rotate's H (C² · 4 B) while D trains;
- the activations autograd keeps for one step's backward, from the first trained block to the end:
  blocks · B·T · per-token bytes of a block (`block_activation_bytes`), plus the final hidden states,
  their gradient and one LM-head chunk: the gathered head rows (chunk, K, C) with top-K, or the logits
  (chunk, V), their log-softmax and its gradient with the whole vocabulary; and the gradients backward
  holds at once inside one block (`block_backward_bytes`);
before them, the teacher pass: one LM-head chunk of its logits (`teacher_pass_bytes`); the larger of the
two counts, as they never coexist;
and for the whole stage:
- the teacher cache on the host: windows · T · K · 6 B (K = V: · 2 B), `teacher.target_bytes`;
- dense prefix states on the model's device, at most `prefix_budget` bytes;
- every distilled variant's kept modules, P · (dtype or 4) B each, alive until the run ends.
Grows with the trained parameters, the suffix depth × tokens per step × (C, I), and the
training + validation tokens × K; never with the evaluation text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from ghosted_core.distill.loss import LOGIT_COPIES, TAIL_COPIES, chunk_tokens, gathered_chunk_tokens
from ghosted_core.distill.options import OPERATOR_TARGET, DistillOptions
from ghosted_core.distill.targets import get_trainable
from ghosted_core.distill.teacher import prefix_bytes, target_bytes
from ghosted_core.memory_parts import attention_shape
from ghosted_core.config_values import mlp_width

TRAIN_STATE_BYTES = 20  # per trained parameter: fp32 weight, gradient, two AdamW moments, the best copy


def block_activation_bytes(config: PretrainedConfig, tokens: int, item: int) -> int:
    """What autograd keeps of one pre-norm block for `tokens` tokens: the inputs of its norms (float32 upcasts
    too), projections, attention (q, k, v, output; SDPA keeps no T×T matrix) and the gated MLP's four I-wide
    tensors."""
    c, inner = config.hidden_size, mlp_width(config)
    heads, kv_heads, head_dim = attention_shape(config)
    attention = (2 * heads + 2 * kv_heads) * head_dim  # q, attention output, k, v
    per_token = (6 * c + attention + 4 * inner) * item + 4 * c * 4  # + two norms' float32 copies
    return tokens * per_token


def block_backward_bytes(config: PretrainedConfig, tokens: int, item: int) -> int:
    """The gradients backward holds at once inside one block for `tokens` tokens: the gated MLP's three I-wide
    ones (of its product, of gate and of up) and two C-wide ones (the stream's and its norm's). Without them the
    plan read 0.78-0.86x of the measured peak at C = 2048 (LoRA, the operator, the tail loss)."""
    return tokens * (3 * mlp_width(config) + 2 * config.hidden_size) * item


@dataclass(frozen=True)
class DistillPlan:
    """Bytes of the distill phase on the compute device and on the host, and its parts (results.json)."""

    device: int
    host: int
    kept: int  # the distilled variants' modules, still alive when the run evaluates
    parts: dict

    def to_json(self) -> dict:
        return {"device": self.device, "host": self.host, "kept": self.kept, "parts": self.parts}


def distill_plan(config: PretrainedConfig, item: int, seqlen: int, boundaries: int, options: DistillOptions,
                 variants: Sequence[tuple[str, str]], val_windows: int = 1, train_blocks: int | None = None,
                 prefix_indices: int = 1) -> DistillPlan:
    """The distill phase's bytes for `variants` = (target, the base operator's kept kind) each.

    `val_windows`: the validation windows; `train_blocks`: the blocks from the earliest trained block to the end (None: every kept block, the
    most any cut position can need); `prefix_indices`: distinct blocks whose dense stream the teacher keeps.
    """
    if not variants:
        return DistillPlan(0, 0, 0, {})
    c, vocab = config.hidden_size, int(config.vocab_size)
    kept_blocks = config.num_hidden_layers
    blocks = kept_blocks if train_blocks is None else train_blocks
    tokens = options.batch_size * seqlen
    windows = options.train_windows(seqlen) + val_windows
    trained = [get_trainable(t).parameters(config, boundaries, options, kind) for t, kind in variants]
    rotations = [c * c * 4 * boundaries if t == OPERATOR_TARGET and kind == "rotated" else 0 for t, kind in variants]
    state = max(p * TRAIN_STATE_BYTES + h for p, h in zip(trained, rotations))
    k = options.vocabulary_kept(vocab)
    if k >= vocab:  # the loss over the whole vocabulary: the logits, their log-softmax and its gradient
        loss = chunk_tokens(vocab) * vocab * 4 * LOGIT_COPIES
    elif options.loss == "topk_tail":  # the whole vocabulary's logits, their masked copy and both gradients
        loss = chunk_tokens(vocab, TAIL_COPIES) * vocab * 4 * TAIL_COPIES
    else:  # the gathered head rows (chunk, K, C) in the head's dtype; the head is frozen, so no gradient of them
        loss = min(tokens, gathered_chunk_tokens(k, c)) * k * c * item
    activations = (blocks * block_activation_bytes(config, tokens, item) + block_backward_bytes(config, tokens, item)
                   + 3 * tokens * c * 4 + loss)
    teacher = teacher_pass_bytes(vocab, k, item)
    prefix = min(options.prefix_budget, prefix_indices * prefix_bytes(windows, seqlen, c, item))
    kept = sum(p * (4 if t in (OPERATOR_TARGET, "lora") else item) for p, (t, _) in zip(trained, variants))
    host = target_bytes(windows * seqlen, k, vocab)
    parts = {"train_state": state, "activations": activations, "loss_chunk": loss, "teacher_pass": teacher,
             "prefix_states": prefix, "kept_modules": kept, "teacher_targets": host,
             "trained_parameters": max(trained)}
    # the teacher pass ends before the first student trains: the larger of the two counts, not their sum
    return DistillPlan(max(state + activations, teacher) + prefix + kept, host, kept, parts)


def teacher_pass_bytes(vocab: int, kept: int, item: int) -> int:
    """One LM-head chunk of the teacher pass: the head's logits, their float32 copy where the model is not float32,
    and their log-softmax (over the whole vocabulary, whose top K are kept)."""
    per_entry = item + (4 if item != 4 else 0) + 4
    return chunk_tokens(vocab) * vocab * per_entry
