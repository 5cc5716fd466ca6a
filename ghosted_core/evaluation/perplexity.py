"""Perplexity and per-block drift for many variants of one dense model.

Variants differ from the dense model only from their first modified block on, and they
share the module objects before it. Perplexity therefore runs the common prefix once per
batch of windows and only each variant's own suffix after it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.model.loading import final_norm
from ghosted_core.progress import track
from ghosted_core.calibration.collect import CalibrationOptions, sink_mask
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.errors import GhostedError
from ghosted_core.plan import PruningPlan
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.model.head import head_logits
from ghosted_core.model.side_inputs import dense_per_layer_inputs, self_contained_start, stream_kwargs
from ghosted_core.model.surgery import slice_view
from ghosted_core.memory_parts import LOGITS_BUDGET

log = logging.getLogger(__name__)


def shared_prefix(dense: PreTrainedModel, variant: PreTrainedModel) -> int:
    """Number of leading blocks the variant runs exactly as the dense model (same module objects), and from whose
    end its suffix computes everything it reads from the stream (`side_inputs.self_contained_start`)."""
    count = 0
    for mine, theirs in zip(variant.model.layers, dense.model.layers):
        if mine is not theirs:
            break
        count += 1
    return min(count, self_contained_start(dense.config))


def input_device(model: PreTrainedModel) -> torch.device:
    weight = model.get_input_embeddings().weight
    return weight.device if weight.device.type != "meta" else torch.device("cpu")


def _token_nll(model: PreTrainedModel, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL of the windows from the final hidden states, LM head in chunks.

    The head runs in the model's dtype; its logits are cast to fp32 before the log-softmax,
    and the sum is accumulated in fp32 per chunk, then in a Python float.
    """
    batch, length, _ = hidden.shape
    vocab = model.config.vocab_size
    per_logit = 4 + (hidden.element_size() if hidden.dtype != torch.float32 else 0)  # fp32 copy + the head's own output
    chunk = max(1, LOGITS_BUDGET // (per_logit * vocab * batch))  # memory: chunk·batch·vocab·per_logit ≤ LOGITS_BUDGET
    labels = input_ids[:, 1:].to(hidden.device)  # (B, T-1)
    total = 0.0
    for lo in range(0, length - 1, chunk):
        hi = min(lo + chunk, length - 1)
        logits = head_logits(model, hidden[:, lo:hi])  # (B, t, V) float32
        target = labels[:, lo:hi].to(logits.device)
        total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
    return total, batch * (length - 1)


def perplexity(dense: PreTrainedModel, variants: Mapping[str, PreTrainedModel], windows: torch.Tensor,
               batch_size: int = 4, quiet: bool = False, desc: str = "perplexity",
               should_stop: StopCheck = None) -> dict[str, float]:
    """exp(mean NLL) over non-overlapping windows (N, T) for every variant, sharing the dense prefix.

    Variants are grouped by how many leading blocks they share with the dense model: per batch the
    dense blocks run once, segment by segment, and each group's suffixes start where its prefix ends
    (a variant that changes block 0, as magcomp's scaled writers do, starts from the embeddings
    without costing the others their shared prefix). `should_stop` is polled before every batch and
    variant (`RunStopped` when it says so).
    """
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise GhostedError("perplexity needs windows of at least 2 tokens")
    groups = _by_prefix(dense, variants, None)
    depths = sorted(groups)
    segments = [slice_view(dense, dense, a, b, normed=False, stream_input=k > 0)  # the first one takes the ids
                for k, (a, b) in enumerate(zip([0, *depths[:-1]], depths))]
    suffixes = {name: slice_view(variants[name], dense, d, stream_input=True) for d in depths for name in groups[d]}
    nll = dict.fromkeys(variants, 0.0)
    count = 0
    device = input_device(dense)
    with torch.no_grad():
        for ids in track(windows.split(batch_size), desc, unit="batches", quiet=quiet):
            check_stop(should_stop, "perplexity")
            ids = ids.to(device)
            side = dense_per_layer_inputs(dense, ids)  # Gemma 4 E2B's per-layer inputs, once per batch (else None)
            h = None
            for depth, segment in zip(depths, segments):
                h = (segment.model(input_ids=ids, use_cache=False) if h is None else  # (B, T, C) entering `depth`
                     segment.model(inputs_embeds=h, use_cache=False, **stream_kwargs(segment, ids, side))).last_hidden_state
                tokens = _add_suffix_nll(nll, {n: suffixes[n] for n in groups[depth]}, variants, h, ids, should_stop,
                                         side)
            count += tokens
    return {name: math.exp(value / count) for name, value in nll.items()}


def _by_prefix(dense: PreTrainedModel, variants: Mapping[str, PreTrainedModel],
               available: Iterable[int] | None) -> dict[int, list[str]]:
    """Variant names grouped by the dense block index their own computation starts at: their shared prefix
    (or, with `available`, the largest available index not beyond it; 0 when none is)."""
    groups: dict[int, list[str]] = {}
    cached = None if available is None else sorted(available)
    for name, model in variants.items():
        prefix = shared_prefix(dense, model)
        if cached is not None:
            prefix = max((j for j in cached if j <= prefix), default=0)
        groups.setdefault(prefix, []).append(name)
    return groups


def _add_suffix_nll(nll: dict[str, float], suffixes: Mapping[str, PreTrainedModel],
                    variants: Mapping[str, PreTrainedModel], h: torch.Tensor, ids: torch.Tensor,
                    should_stop: StopCheck = None, side: torch.Tensor | None = None) -> int:
    """Add each variant's summed NLL of one batch, its suffix fed the shared prefix output h (and its slices of
    the batch's per-layer inputs `side`, where the family has them); returns the token count."""
    tokens = 0
    for name, suffix in suffixes.items():
        check_stop(should_stop, "perplexity")  # a batch runs every variant: stop between them too
        out = suffix.model(inputs_embeds=h, use_cache=False,
                           **stream_kwargs(suffix, ids, side)).last_hidden_state  # (B, T, C) after the final norm
        total, tokens = _token_nll(variants[name], out, ids)
        nll[name] += total
    return tokens


@dataclass
class PrefixStates:
    """The dense model's residual stream entering some blocks, for every batch of evaluation windows.

    Several groups of variants (the depths of a sweep) that differ from the dense model only
    after different blocks can then each run only their own suffix, and the dense model runs
    once. Memory: tokens × C × dtype bytes per kept index (8192 tokens at C = 4096 in bf16:
    64 MiB per index), on the model's device.
    """

    windows: torch.Tensor  # (N, T) evaluation windows
    batch_size: int
    states: dict[int, list[torch.Tensor]]  # dense block index → per batch (B, T, C) residual entering it
    dense_perplexity: float
    tokens: int  # next-token predictions the perplexities rest on: N × (T − 1)

    def drop(self, index: int) -> None:
        """Free the states at one index once no variant needs them."""
        self.states.pop(index, None)


def dense_prefix_states(dense: PreTrainedModel, windows: torch.Tensor, indices: Iterable[int], batch_size: int = 4,
                        quiet: bool = False, desc: str = "perplexity dense") -> PrefixStates:
    """One dense pass over the windows: its perplexity, and the residual entering each block in `indices`."""
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise GhostedError("perplexity needs windows of at least 2 tokens")
    num_layers = len(dense.model.layers)
    wanted = sorted({int(j) for j in indices if 0 <= j < num_layers})
    states: dict[int, list[torch.Tensor]] = {j: [] for j in wanted}
    nll, count = 0.0, 0
    device = input_device(dense)
    with torch.no_grad():
        for ids in track(windows.split(batch_size), desc, unit="batches", quiet=quiet):
            ids = ids.to(device)
            with capture(dense, [*wanted, num_layers]) as seen:  # stops at the final norm's input
                run_forward(dense, ids)
            for j in wanted:
                states[j].append(seen[("residual", j)])  # (B, T, C)
            out = final_norm(dense)(seen[("residual", num_layers)])  # (B, T, C) as the full forward ends
            total, tokens = _token_nll(dense, out, ids)
            nll += total
            count += tokens
    return PrefixStates(windows, batch_size, states, math.exp(nll / count), count)


def perplexity_from_states(dense: PreTrainedModel, variants: Mapping[str, PreTrainedModel], cached: PrefixStates,
                           quiet: bool = False, desc: str = "perplexity", should_stop: StopCheck = None) -> dict[str, float]:
    """`perplexity` of variants that share the dense prefix up to a cached index: only their suffixes run (a
    variant sharing less than any cached index, e.g. one that changes block 0, runs from the embeddings)."""
    groups = _by_prefix(dense, variants, cached.states)
    suffixes = {name: slice_view(variants[name], dense, start, stream_input=True) for start, names in groups.items()
                for name in names}
    embed = slice_view(dense, dense, 0, 0, normed=False)  # the embeddings alone
    nll = dict.fromkeys(variants, 0.0)
    count = 0
    device = input_device(dense)
    with torch.no_grad():
        for k, ids in enumerate(track(list(cached.windows.split(cached.batch_size)), desc, unit="batches",
                                           quiet=quiet)):  # stop checks: per variant, inside
            ids = ids.to(device)
            for start, names in groups.items():
                h = cached.states[start][k] if start in cached.states else \
                    embed.model(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, C)
                tokens = _add_suffix_nll(nll, {n: suffixes[n] for n in names}, variants, h, ids, should_stop)
            count += tokens
    return {name: math.exp(value / count) for name, value in nll.items()}


@dataclass(frozen=True)
class BlockDrift:
    """Relative error of a variant's residual stream against the dense one, per dense block index."""

    blocks: tuple[int, ...]  # dense index j (num_layers = final-norm input)
    error: tuple[float, ...]  # ‖h_j − h_j^dense‖ / ‖h_j^dense‖ over all tokens
    error_ordinary: tuple[float, ...]  # … with massive-activation tokens left out

    def to_json(self) -> dict:
        return {"blocks": list(self.blocks), "error": list(self.error), "error_ordinary": list(self.error_ordinary)}


def block_drift(dense: PreTrainedModel, variants: Mapping[str, PreTrainedModel], plan: PruningPlan,
                windows: torch.Tensor, options: CalibrationOptions = CalibrationOptions(),
                should_stop: StopCheck = None) -> dict[str, BlockDrift]:
    """Per-block drift downstream of the first boundary, for every variant (dense = 0 by definition)."""
    if not plan.boundaries:
        return {}
    first = plan.boundaries[0].start
    kept = list(plan.kept) + [plan.num_layers]  # pruned layer i sits at dense index kept[i]; the last is the final norm
    wanted = [(i, j) for i, j in enumerate(kept) if j >= first]

    def layer_of(model: PreTrainedModel, j: int) -> int:
        return j if len(model.model.layers) == plan.num_layers else kept.index(j)

    diff = {name: torch.zeros(len(wanted), 2, dtype=torch.float64) for name in variants}
    ref = torch.zeros(len(wanted), 2, dtype=torch.float64)
    with torch.no_grad():
        for ids in track(windows.split(1), "drift", unit="windows", quiet=options.quiet):
            check_stop(should_stop, "drift")
            with capture(dense, [j for _, j in wanted]) as seen_dense:
                run_forward(dense, ids)
            valid = torch.ones(ids.shape, dtype=torch.bool)
            masks = []
            for k, (_, j) in enumerate(wanted):
                h = seen_dense[("residual", j)].double()
                ordinary = (~sink_mask(h, h, valid.to(h.device), options)).to(h.device)
                masks.append(ordinary)
                ref[k, 0] += float((h * h).sum())
                ref[k, 1] += float((h[ordinary] ** 2).sum())
            for name, model in variants.items():
                with capture(model, [layer_of(model, j) for _, j in wanted]) as seen:
                    run_forward(model, ids)
                for k, (_, j) in enumerate(wanted):
                    d = seen[("residual", layer_of(model, j))].double().to(seen_dense[("residual", j)].device) - seen_dense[("residual", j)].double()
                    diff[name][k, 0] += float((d * d).sum())
                    diff[name][k, 1] += float((d[masks[k]] ** 2).sum())
    ratios = {name: (d / ref.clamp_min(1e-30)).sqrt() for name, d in diff.items()}
    blocks = tuple(j for _, j in wanted)
    return {name: BlockDrift(blocks, tuple(r[:, 0].tolist()), tuple(r[:, 1].tolist())) for name, r in ratios.items()}


def llamacpp_tokens(tokenizer, text: str) -> list[int]:
    """`text`'s token ids as llama.cpp's tools read a text file: special-token strings in it are plain text
    (llama-perplexity tokenizes without parsing specials). PTB's "<unk>" is Gemma-3's unknown token to a
    transformers tokenizer, an unpredictable id about once in 20 tokens; to llama.cpp it is "<", "unk", ">"."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"])


def llamacpp_windowed_perplexity(model: PreTrainedModel, tokenizer, text: str, context: int,
                                 chunks: int | None = None) -> float:
    """llama-perplexity's estimate of `text`, computed in transformers, so that a GGUF's number has a reference.

    As llama-perplexity does (tools/perplexity/perplexity.cpp): the whole text is tokenized once
    (`llamacpp_tokens`), with BOS first where the tokenizer adds one (`corpora.default_bos`); the stream is
    cut into non-overlapping windows of `context` tokens (the remainder dropped, at most `chunks` windows);
    each window's first token is replaced by BOS where the tokenizer adds one; and only the second half is
    scored: the logits at positions context/2 … context−2 predict the tokens after them. Needs at least 2·`context` tokens.
    Time: chunks forward passes of `context` tokens; memory: one window's activations and context/2 × vocabulary
    fp32 logits (the head runs on the scored half only).
    """
    from ghosted_core.data.corpora import default_bos

    bos = default_bos(tokenizer)
    ids = ([bos] if bos is not None else []) + llamacpp_tokens(tokenizer, text)
    if len(ids) < 2 * context:
        raise GhostedError(f"the text has {len(ids)} tokens; llama-perplexity's windows of {context} need at least "
                           f"{2 * context}")
    count = len(ids) // context if chunks is None else min(chunks, len(ids) // context)
    windows = torch.tensor(ids[: count * context]).view(count, context)  # (chunks, context)
    if bos is not None:
        windows[:, 0] = bos
    first = context // 2
    device = input_device(model)
    nll, scored = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(input_ids=window[None].to(device), use_cache=False,
                           logits_to_keep=context - first).logits[0, :-1].float()  # (context/2 − 1, V)
            target = window[first + 1:].to(logits.device)  # (context/2 − 1,)
            nll += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
            scored += target.numel()
    return math.exp(nll / scored)
