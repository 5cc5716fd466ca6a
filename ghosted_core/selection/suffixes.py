"""Run many candidate models from cached residual states, block slot by block slot, candidates batched.

The output-grounded criteria (sleb, kl, swap_kl) score dozens of models that equal the dense
model (or the current pruned one) up to some block and differ after it. Each candidate is a
cached residual state plus the steps it still runs: (slot, module) pairs in ascending slot order,
where the slot fixes the attention kind and positions (Gemma-3's sliding/global layers) and the
module holds the weights. `CandidateRunner.run` walks the slots once; at each slot the candidates
that run the same module there are concatenated along the batch axis and run together, so a
block runs once per slot on a tall batch instead of once per candidate (the same arithmetic,
fewer, larger matrix products). No candidate recomputes the shared prefix before its entry.

Memory: the states of the candidates run together, candidates × B × T × C in the model dtype,
kept under `STATE_BUDGET` by `chunks` (the caller scores chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from ghosted_core.memory_parts import attention_shape
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.model.side_inputs import cached_stream_refusal
from ghosted_core.model.surgery import assemble, sliced_config, stream_fed
from ghosted_core.recovery.modules import module_device
from ghosted_core.config_values import mlp_width

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

    `prefix`: the slots already run to reach `state` (what `run`'s `store` callback extends).
    """

    state: torch.Tensor
    steps: tuple[tuple[int, nn.Module], ...]  # ascending slots; empty: `state` goes straight to the final norm
    prefix: tuple[int, ...] = ()


Store = Callable[[tuple[int, ...], torch.Tensor], None]


@dataclass
class CandidateRunner:
    """Runs blocks of `dense` (or modules standing in for them) one slot at a time on any batch of states."""

    dense: PreTrainedModel
    work: Work = field(default_factory=Work)
    _views: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        why = cached_stream_refusal(self.dense.config, "this criterion")  # blocks reading what a cached stream lacks
        if why:
            raise GhostedError(why)

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
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`module` at `slot` on h (N, T, C); `windows` calibration windows are in the batch (for the count)."""
        view = self._view(slot, module)
        h = h.to(module_device(module))
        mask = None if attention_mask is None else attention_mask.to(h.device)
        with torch.no_grad():
            out = view.model(inputs_embeds=h, attention_mask=mask, use_cache=False).last_hidden_state  # (N, T, C)
        self.work.block_runs += windows
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """h_0 (B, T, C): the embedding as the model applies it (Gemma's scale included); counts one pass."""
        embed = self.dense.get_input_embeddings()
        self.work.passes += 1
        with torch.no_grad():
            return embed(input_ids.to(module_device(embed)))

    def dense_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One dense pass from the tokens: the residual entering every block, then the final norm's input (L+1 states)."""
        states = [self.embed(input_ids)]
        steps = tuple((j, block) for j, block in enumerate(self.blocks))
        self.run([Candidate(states[0], steps)], attention_mask, store=lambda _prefix, h: states.append(h))
        return states

    def run(self, candidates: Sequence[Candidate], attention_mask: torch.Tensor | None = None,
            store: Store | None = None) -> list[torch.Tensor]:
        """Each candidate's residual entering the final norm (B, T, C), every slot run once per distinct module.

        `store(prefix, state)`, if given, receives every state a candidate reaches, keyed by the slots run so far.
        """
        finals: list[torch.Tensor | None] = [c.state if not c.steps else None for c in candidates]
        current = {k: c.state for k, c in enumerate(candidates) if c.steps}
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
                outs = self.run_slot(slot, module, batch, sum(sizes), mask).split(sizes)
                for k, out in zip(members, outs):
                    position[k] += 1
                    if store is not None:
                        store(candidates[k].prefix + tuple(s for s, _ in candidates[k].steps[:position[k]]), out)
                    if position[k] == len(candidates[k].steps):
                        finals[k] = out
                        del current[k]
                    else:
                        current[k] = out
        return finals


def chunks(candidates: Sequence[Candidate], budget: int = STATE_BUDGET) -> Iterator[list[Candidate]]:
    """Consecutive groups of candidates whose states together stay under `budget` bytes (at least one each)."""
    group: list[Candidate] = []
    used = 0
    for candidate in candidates:
        size = candidate.state.numel() * candidate.state.element_size()
        if group and used + size > budget:
            yield group
            group, used = [], 0
        group.append(candidate)
        used += size
    if group:
        yield group
