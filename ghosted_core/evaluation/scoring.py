"""Log-likelihoods of (context, continuation) token pairs for a dense model and many variants in one pass.

What lm-eval's HFLM computes per request, with three exact savings:
- **Shared prefixes, once.** A question's answer choices share their context (and Winogrande's two
  contexts share their start). Requests are packed as a token trie: each trie node is one position of
  one row, its RoPE position is its depth, and an attention mask lets it see its ancestors only. Every
  request then reads exactly the hidden states it would have had alone, and a shared prefix is
  computed once.
- **Shared blocks, once.** A variant runs the dense model's own blocks up to its first change
  (`perplexity.shared_prefix`). The dense segments run once per batch; each variant runs only its own
  suffix from the stream where it departs, as perplexity does.
- **The head where it is read.** The LM head runs on the positions that predict continuation tokens
  only, in chunks, in float32.

A model with recurrent layers (linear attention, convolution, Mamba: `layer_config.recurrent`) cannot be told which
earlier nodes of a row a node descends from, so its rows are single sequences (a request, with its repeats and
prefixes), padded on the right, under the model's own causal masks: the shared blocks still run once.

Requests follow HFLM's truncation: the input is (context + continuation)[-(max_length+1):][:-1], and
the last len(continuation) positions are scored. A sliding-window layer sees ancestors whose depth is
within its window, as transformers' own masks do.

Time: per batch, the dense blocks once over the packed nodes plus each variant's suffix; memory: one
batch of packed nodes' activations (`row_tokens` × rows × (C + intermediate) in the model's dtype),
a bool mask rows × row_tokens² per attention kind, and the head's chunk of scored positions × vocab × 4 B.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from ghosted_core.evaluation.perplexity import _by_prefix, input_device
from ghosted_core.memory_parts import LOGITS_BUDGET
from ghosted_core.model.head import head_logits
from ghosted_core.model.layer_config import recurrent
from ghosted_core.model.side_inputs import dense_per_layer_inputs, stream_kwargs
from ghosted_core.model.surgery import slice_view
from ghosted_core.progress import track

log = logging.getLogger(__name__)

TokenPair = tuple[tuple[int, ...], tuple[int, ...]]  # (context tokens, continuation tokens) as HFLM encodes them
Answer = tuple[float, bool]  # (log-likelihood of the continuation, whether greedy decoding gives it)


@dataclass(frozen=True)
class ScoringOptions:
    """How requests are packed into forward passes (results do not depend on it, only time and memory)."""

    # trie nodes per row (a request longer than this gets a row of its own) and rows × longest row per forward:
    # one row of 256 was the fastest of 128–1024 for SmolLM2 (fp32) and the 1.5B (bf16) on 2 cores, where longer
    # rows lose more to attention and to the matmuls' shapes than they gain in shared contexts
    row_tokens: int = 256
    batch_tokens: int = 256
    max_length: int = 2048  # HFLM's max_length: inputs are left-truncated to it


@dataclass
class _Packed:
    """One row of the batch: trie nodes and, per request, the nodes that predict its continuation."""

    tokens: list[int]
    depth: list[int]
    parent: list[int]
    scored: list[tuple[int, list[int], tuple[int, ...]]]  # (request index, node indices, target tokens)


def _truncated(pair: TokenPair, max_length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input tokens, target tokens): HFLM's left truncation; the targets are the continuation."""
    context, continuation = pair
    if not context or not continuation:
        raise ValueError("a request needs a non-empty context and continuation (lm-eval's own assertion)")
    full = (context + continuation)[-(max_length + 1):]
    return full[:-1], continuation


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _extends(row: _Packed, length: int, shared: int, row_tokens: int, branching: bool = True) -> bool:
    """Whether a request of `length` input tokens, `shared` of them already in `row`, joins the row: when its
    new nodes fit, or when it shares at least as many as it adds (recomputing the shared part in a row of its own
    would cost more than the longer row's attention; BoolQ's yes/no share a whole passage beyond a row's length).
    The second rule keeps a row within twice the longer of a row and the request, so attention stays bounded."""
    new = length - shared
    if not branching:  # only a request already on the row's one path joins it (a repeat, or a prefix)
        return new == 0
    if len(row.tokens) + new <= row_tokens:
        return True
    return shared >= new and len(row.tokens) + new <= 2 * max(row_tokens, length)


def pack(pairs: Sequence[TokenPair], options: ScoringOptions, branching: bool = True) -> list[_Packed]:
    """Rows of a trie over the requests' inputs, in lexicographic order so that sharing requests are neighbours
    (in sorted order a sequence shares most with the one before it, so a row is filled greedily). `branching`
    False: each row is one path (a request and the repeats and prefixes of it), for models with recurrent layers."""
    inputs = [_truncated(p, options.max_length) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: inputs[i][0])
    rows: list[_Packed] = []
    row: _Packed | None = None
    path: list[int] = []  # node indices of the previous request's input in the current row
    previous: tuple[int, ...] = ()
    for i in order:
        tokens, targets = inputs[i]
        shared = _common_prefix(previous, tokens) if row is not None else 0
        if row is None or not _extends(row, len(tokens), shared, options.row_tokens, branching):
            row, path, shared = _Packed([], [], [], []), [], 0  # a request longer than a row gets one of its own
            rows.append(row)
        path = path[:shared]
        for position in range(shared, len(tokens)):
            row.parent.append(path[-1] if path else -1)
            row.tokens.append(tokens[position])
            row.depth.append(position)
            path.append(len(row.tokens) - 1)
        row.scored.append((i, path[len(tokens) - len(targets):], targets))
        previous = tokens
    return rows


def _ancestry(row: _Packed) -> np.ndarray:
    """(n, n) bool: node q may attend to node k (k is q or one of its ancestors). Parents precede children."""
    n = len(row.tokens)
    seen = np.zeros((n, n), dtype=bool)
    for q, p in enumerate(row.parent):
        if p >= 0:
            seen[q] = seen[p]
        seen[q, q] = True
    return seen


def _attention_kinds(config) -> dict[str, tuple[str, int] | None]:
    """Each attention kind the model's layers use and what limits it: ("window", w) for a sliding window (a token
    sees the w − 1 before it), ("chunk", n) for chunked attention (Llama-4: a token sees its own chunk of n
    positions), None for full attention."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        return {"sliding_attention" if window else "full_attention": ("window", window) if window else None}
    limits = {"sliding_attention": ("window", window) if window else None,
              "chunked_attention": ("chunk", chunk) if chunk else None}
    return {kind: limits.get(kind) for kind in dict.fromkeys(kinds)}


def _masks(rows: Sequence[_Packed], config, dtype: torch.dtype, device: torch.device):
    """The batch's 4D masks (B, 1, L, L) per attention kind: a tensor when the model has one kind, else a dict
    by kind (the form transformers' models take ready-made masks in). Padding nodes see only themselves.
    None for a model with recurrent layers: its rows are single paths padded on the right, which the model's
    own causal masks already handle (no valid node sees a later one)."""
    if recurrent(config):
        return None
    length = max(len(r.tokens) for r in rows)
    kinds = _attention_kinds(config)
    out = {}
    ancestry = [_ancestry(r) for r in rows]
    for kind, limit in kinds.items():
        mask = np.zeros((len(rows), 1, length, length), dtype=bool)
        for b, (row, seen) in enumerate(zip(rows, ancestry)):
            n = len(row.tokens)
            allowed = seen
            depth = np.asarray(row.depth)  # a node's position in its own sequence
            if limit is not None and limit[0] == "window":
                allowed = seen & (depth[:, None] - depth[None, :] < limit[1])
            elif limit is not None:  # chunked: the same chunk of positions
                allowed = seen & (depth[:, None] // limit[1] == depth[None, :] // limit[1])
            mask[b, 0, :n, :n] = allowed
            mask[b, 0, np.arange(n, length), np.arange(n, length)] = True
        tensor = torch.from_numpy(mask).to(device)
        if getattr(config, "_attn_implementation", "sdpa") == "eager":  # eager adds the mask to the scores
            tensor = torch.zeros(tensor.shape, dtype=dtype, device=device).masked_fill_(~tensor, torch.finfo(dtype).min)
        out[kind] = tensor
    return next(iter(out.values())) if len(out) == 1 else out


def _batches(rows: list[_Packed], batch_tokens: int) -> list[list[_Packed]]:
    """Rows grouped so that rows × longest row ≤ batch_tokens (rows of similar length together)."""
    rows = sorted(rows, key=lambda r: len(r.tokens), reverse=True)
    out: list[list[_Packed]] = []
    for row in rows:
        if out and (len(out[-1]) + 1) * len(out[-1][0].tokens) <= batch_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


class SharedScorer:
    """Answers for every variant of one dense model, computed together the first time any variant asks.

    `answers(name, pairs)` returns the variant's (log-likelihood, greedy) per pair; pairs not seen yet are
    computed for all variants in one pass and kept (two numbers per pair and variant), so the other
    variants' identical requests cost nothing. Thread-unsafe: one evaluation at a time.
    """

    def __init__(self, dense: PreTrainedModel, variants: Mapping[str, PreTrainedModel],
                 options: ScoringOptions = ScoringOptions(), quiet: bool = True):
        self.dense, self.variants, self.options, self.quiet = dense, dict(variants), options, quiet
        self.groups = _by_prefix(dense, self.variants, None)  # dense block index → variants departing there
        self.depths = sorted(self.groups)
        starts = [0, *self.depths[:-1]]
        self.segments = [slice_view(dense, dense, a, b, normed=False, stream_input=k > 0)  # the first: token ids
                         for k, (a, b) in enumerate(zip(starts, self.depths))]
        self.suffixes = {name: slice_view(self.variants[name], dense, d, stream_input=True) for d in self.depths
                         for name in self.groups[d]}
        self.cache: dict[str, dict[TokenPair, Answer]] = {name: {} for name in self.variants}
        self.forwards = 0  # forward passes run (batches), for the benches

    def answers(self, name: str, pairs: Sequence[TokenPair]) -> list[Answer]:
        known = self.cache[name]
        missing = list(dict.fromkeys(p for p in pairs if p not in known))
        if missing:
            self._compute(missing)
        return [known[p] for p in pairs]

    def _compute(self, pairs: list[TokenPair]) -> None:
        rows = pack(pairs, self.options, branching=not recurrent(self.dense.config))
        device = input_device(self.dense)
        config = self.dense.config
        with torch.no_grad():
            for batch in track(_batches(rows, self.options.batch_tokens), "score requests", unit="batches",
                               quiet=self.quiet):
                length = max(len(r.tokens) for r in batch)
                ids = torch.zeros(len(batch), length, dtype=torch.long)
                positions = torch.zeros(len(batch), length, dtype=torch.long)
                for b, row in enumerate(batch):
                    ids[b, :len(row.tokens)] = torch.tensor(row.tokens)
                    positions[b, :len(row.tokens)] = torch.tensor(row.depth)
                ids, positions = ids.to(device), positions.to(device)
                mask = _masks(batch, config, self.dense.dtype, device)
                side = dense_per_layer_inputs(self.dense, ids)  # Gemma 4 E2B's per-layer inputs, once (else None)
                h = None
                for depth, segment in zip(self.depths, self.segments):
                    step = dict(attention_mask=mask, position_ids=positions, use_cache=False)
                    h = (segment.model(input_ids=ids, **step) if h is None else  # (B, L, C) entering `depth`
                         segment.model(inputs_embeds=h, **step, **stream_kwargs(segment, ids, side))).last_hidden_state
                    for name in self.groups[depth]:
                        suffix = self.suffixes[name]
                        out = suffix.model(inputs_embeds=h, **step,
                                           **stream_kwargs(suffix, ids, side)).last_hidden_state  # (B, L, C) normed
                        self._read(name, batch, out, pairs)
                self.forwards += 1

    def _read(self, name: str, batch: Sequence[_Packed], hidden: torch.Tensor, pairs: Sequence[TokenPair]) -> None:
        """Score every request of the batch from the variant's final hidden states (head on scored nodes only)."""
        rows, nodes, spans = [], [], []
        for b, row in enumerate(batch):
            for request, where, _ in row.scored:
                spans.append((request, len(nodes), len(where), row, b))
                rows += [b] * len(where)
                nodes += where
        picked = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(nodes, device=hidden.device)]  # (N, C)
        targets = torch.tensor([t for b, row in enumerate(batch) for _, _, tg in row.scored for t in tg])  # (N,)
        vocab = self.variants[name].config.vocab_size
        chunk = max(1, LOGITS_BUDGET // (8 * vocab))  # memory: chunk × vocab × (4 B logits + 4 B log-softmax)
        logprob = torch.empty(len(nodes), dtype=torch.float64)
        greedy = torch.empty(len(nodes), dtype=torch.bool)
        for lo in range(0, len(nodes), chunk):
            logits = head_logits(self.variants[name], picked[lo:lo + chunk])  # (n, V) float32
            logs = torch.log_softmax(logits, dim=-1)
            target = targets[lo:lo + chunk].to(logs.device)
            logprob[lo:lo + chunk] = logs.gather(1, target[:, None])[:, 0].double().cpu()
            greedy[lo:lo + chunk] = (logs.argmax(-1) == target).cpu()
        known = self.cache[name]
        for request, start, count, _, _ in spans:
            known[pairs[request]] = (float(logprob[start:start + count].sum()), bool(greedy[start:start + count].all()))
