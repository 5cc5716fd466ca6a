"""Run many candidate models from cached residual states, block slot by block slot, candidates batched.

The output-grounded criteria (sleb, kl, swap_kl) score dozens of models that equal the dense
model (or the current pruned one) up to some block and differ after it. Each candidate is a
cached residual state plus the steps it still runs: (slot, module) pairs in ascending slot order,
where the slot fixes the attention kind and positions (Gemma-3's sliding/global layers) and the
module holds the weights. `CandidateRunner.run` walks the slots once; at each slot the candidates
that run the same module there are concatenated along the batch axis and run together, so a
block runs once per slot on a tall batch instead of once per candidate (the same arithmetic,
fewer, larger matrix products). No candidate recomputes the shared prefix before its entry.

What a block reads besides the stream travels with it (`side_inputs`): Gemma 4 E2B/E4B's per-layer
inputs are made once per call from the batch's tokens and each slot is given its own slice; the keys
and values a KV-storing block computes for later blocks (`Candidate.shared`) follow each candidate
along its path, split and concatenated with it, and are kept with its states (`Store`).

Memory: the states of the candidates run together, candidates × B × T × C in the model dtype,
kept under `STATE_BUDGET` by `chunks` (the caller scores chunk by chunk); with shared KV, each
candidate's stored keys and values (B × kv heads × T × head dim per store, two stores on E2B/E4B)
and the per-layer inputs of one batch (B × T × L × P).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import KVSharingDict

from ghosted_core.memory_parts import attention_shape
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.model.side_inputs import dense_per_layer_inputs
from ghosted_core.model.surgery import assemble, sliced_config, stream_fed
from ghosted_core.recovery.modules import module_device
from ghosted_core.config_values import kv_stores, mlp_width

STATE_BUDGET = 2**29  # bytes of candidate residual states alive at once (512 MiB)


@dataclass
class Work:
    """What a criterion's scoring ran, counted as it runs (in calibration windows, so independent of batching)."""

    passes: int = 0  # passes that started from the tokens (the embedding ran), over the whole calibration set
    block_runs: int = 0  # window × block evaluations
    head_runs: float = 0.0  # window × (final norm + LM head) evaluations (a vocabulary subset counts its share)
    seconds: float = 0.0

    def to_json(self, windows: int, config=None) -> dict:
        """Counts per calibration window and the wall time; with the model's config, also the work in full-pass
        equivalents (`pass_equivalents`)."""
        per = max(windows, 1)
        out = {"passes": self.passes, "block_runs_per_window": self.block_runs / per,
               "head_runs_per_window": self.head_runs / per, "seconds": round(self.seconds, 3)}
        if config is not None:
            out["full_pass_equivalents"] = round(pass_equivalents(config, self.block_runs / per, self.head_runs / per), 2)
        return out


def pass_equivalents(config, block_runs: float, head_runs: float) -> float:
    """Block and head runs per window in full forward passes (L blocks and one head), weighted by the
    multiply-adds of their projections per token (attention scores left out: they grow with T alike)."""
    c, inner = config.hidden_size, mlp_width(config)
    heads, kv, head_dim = attention_shape(config)
    block = c * head_dim * (2 * heads + 2 * kv) + 3 * c * inner  # q, o, k, v and the gated MLP
    head = config.vocab_size * c
    return (block_runs * block + head_runs * head) / (config.num_hidden_layers * block + head)


@dataclass(frozen=True)
class Candidate:
    """A model from a cached residual on: `state` (B, T, C) enters the first of `steps`, each (slot, module).

    `prefix`: the slots already run to reach `state` (what `run`'s `store` callback extends). `shared`: the keys
    and values the KV-storing blocks of the prefix computed, by attention kind (empty for most families).
    """

    state: torch.Tensor
    steps: tuple[tuple[int, nn.Module], ...]  # ascending slots; empty: `state` goes straight to the final norm
    prefix: tuple[int, ...] = ()
    shared: dict = field(default_factory=dict)  # {kind: (keys, values)}, each (B, kv heads, T, head dim)


Store = Callable[[tuple[int, ...], torch.Tensor, dict], None]  # (prefix, state, shared KV after the prefix)


@dataclass
class CandidateRunner:
    """Runs blocks of `dense` (or modules standing in for them) one slot at a time on any batch of states."""

    dense: PreTrainedModel
    work: Work = field(default_factory=Work)
    _views: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.shares_kv = bool(kv_stores(self.dense.config))

    @property
    def blocks(self) -> nn.ModuleList:
        return decoder_blocks(self.dense)

    def _view(self, slot: int, module: nn.Module) -> PreTrainedModel:
        """A one-block model: `module` at dense slot `slot` (its mask kind and positions), no final norm."""
        key = (slot, id(module))
        if key not in self._views:
            config = sliced_config(self.dense.config, [slot])
            view = stream_fed(assemble(self.dense, [module], config, nn.Identity(), rows=[slot]))
            self._views[key] = (view, module)  # keeps `module` alive
        return self._views[key][0]

    def run_slot(self, slot: int, module: nn.Module, h: torch.Tensor, windows: int,
                 attention_mask: torch.Tensor | None = None, **side) -> torch.Tensor:
        """`module` at `slot` on h (N, T, C); `windows` calibration windows are in the batch (for the count).
        `side`: what the block reads besides the stream (`per_layer_inputs` (N, T, 1, P) for this slot;
        `shared_kv_states`, which a storing block fills in place)."""
        view = self._view(slot, module)
        h = h.to(module_device(module))
        mask = None if attention_mask is None else attention_mask.to(h.device)
        with torch.no_grad():
            out = view.model(inputs_embeds=h, attention_mask=mask, use_cache=False, **side).last_hidden_state
        self.work.block_runs += windows
        return out  # (N, T, C)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """h_0 (B, T, C): the embedding as the model applies it (Gemma's scale included); counts one pass."""
        embed = self.dense.get_input_embeddings()
        self.work.passes += 1
        with torch.no_grad():
            return embed(input_ids.to(module_device(embed)))

    def dense_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[Candidate]:
        """One dense pass from the tokens: the residual entering every block, then the final norm's input (L+1
        entries, each with the shared KV its prefix stored; no steps: give each its own)."""
        entries = [Candidate(self.embed(input_ids), ())]
        steps = tuple((j, block) for j, block in enumerate(self.blocks))
        self.run([Candidate(entries[0].state, steps)], attention_mask,
                 lambda prefix, h, shared: entries.append(Candidate(h, (), prefix, shared)), input_ids)
        return entries

    def run(self, candidates: Sequence[Candidate], attention_mask: torch.Tensor | None = None,
            store: Store | None = None, input_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each candidate's residual entering the final norm (B, T, C), every slot run once per distinct module.

        `store(prefix, state, shared)`, if given, receives every state a candidate reaches, keyed by the slots run
        so far, with the shared KV stored on the way. `input_ids` (B, T): the batch every candidate's state belongs
        to, needed where blocks read per-layer inputs of the tokens (Gemma 4 E2B/E4B).
        """
        per_layer = dense_per_layer_inputs(self.dense, input_ids)  # (B, T, L, P), or None: the family has none
        finals: list[torch.Tensor | None] = [c.state if not c.steps else None for c in candidates]
        current = {k: c.state for k, c in enumerate(candidates) if c.steps}
        shared = {k: dict(candidates[k].shared) for k in current}
        position = {k: 0 for k in current}
        for slot in sorted({s for c in candidates for s, _ in c.steps}):
            groups: dict[int, list[int]] = {}
            for k in current:
                step_slot, module = candidates[k].steps[position[k]]
                if step_slot == slot:
                    groups.setdefault(id(module), []).append(k)
            for members in groups.values():
                module = candidates[members[0]].steps[position[members[0]]][1]
                sizes = [current[k].shape[0] for k in members]
                batch = torch.cat([current[k].to(module_device(module)) for k in members])  # (Σ B, T, C)
                mask = None if attention_mask is None else attention_mask.repeat(len(members), 1)
                side = {}
                if per_layer is not None:  # this slot's slice, once per member
                    side["per_layer_inputs"] = per_layer[:, :, slot:slot + 1].repeat(len(members), 1, 1, 1)
                if self.shares_kv:
                    side["shared_kv_states"] = _joined([shared[k] for k in members])
                outs = self.run_slot(slot, module, batch, sum(sizes), mask, **side).split(sizes)
                stored = _split(side.get("shared_kv_states", {}), sizes)
                for k, out, kv in zip(members, outs, stored):
                    position[k] += 1
                    shared[k] = kv
                    if store is not None:
                        store(candidates[k].prefix + tuple(s for s, _ in candidates[k].steps[:position[k]]), out, kv)
                    if position[k] == len(candidates[k].steps):
                        finals[k] = out
                        del current[k]
                    else:
                        current[k] = out
        return finals


def carried_bytes(state: torch.Tensor, shared: dict) -> int:
    """Bytes of a cached state and the stored keys and values it carries (`Candidate.shared`)."""
    return sum(t.numel() * t.element_size() for t in (state, *(x for kv in shared.values() for x in kv)))


def _joined(members: Sequence[dict]) -> dict:
    """The members' stored keys and values concatenated along the batch, for the kinds every member has."""
    kinds = set(members[0]).intersection(*members[1:]) if members else set()
    return KVSharingDict({kind: tuple(torch.cat([m[kind][t] for m in members]) for t in (0, 1)) for kind in kinds})


def _split(joined, sizes: Sequence[int]) -> list[dict]:
    """Each member's part of the (possibly newly stored) keys and values, in order."""
    parts: list[dict] = [{} for _ in sizes]
    for kind, (keys, values) in dict(joined).items():
        for part, k, v in zip(parts, keys.split(list(sizes)), values.split(list(sizes))):
            part[kind] = (k, v)
    return parts


def chunks(candidates: Sequence[Candidate], budget: int = STATE_BUDGET) -> Iterator[list[Candidate]]:
    """Consecutive groups of candidates whose states (with the keys and values they carry) together stay under
    `budget` bytes (at least one each)."""
    group: list[Candidate] = []
    used = 0
    for candidate in candidates:
        size = carried_bytes(candidate.state, candidate.shared)
        if group and used + size > budget:
            yield group
            group, used = [], 0
        group.append(candidate)
        used += size
    if group:
        yield group
