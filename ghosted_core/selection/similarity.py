"""The similarity pass: cosines between the dense model's residual streams, streamed over calibration tokens.

One forward per batch feeds every similarity criterion (streamline, shortgpt, angular) and,
when asked, the layer-similarity map: the (L+1)×(L+1) mean per-token cosine cos(h_i, h_j)
over h_0 (embeddings) … h_L (the input of the final norm, hooked there: transformers' last
hidden state is taken after the final norm). Cosines are per token over the hidden dimension,
as the papers define them; `cosine="token-axis"` reproduces the reference repositories' torch
default (`dim=1` of [B, T, C], i.e. over tokens) for the run and block scores. The map is
always per token, token-weighted, over h_0 … h_L (ours: LoRP's map covers the block inputs
h_0 … h_L−1 only, PruneMe's is angular at the last token and per run length, not all pairs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ghosted_core.progress import track
from ghosted_core.calibration.capture import capture, run_forward
from ghosted_core.calibration.collect import CalibrationBatch, valid_mask
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import decoder_blocks
from ghosted_core.selection.footprint import Footprint, ScoreShapes

COSINE_AXES = ("hidden", "token-axis")  # "hidden": the papers' per-token cosine; "token-axis": the reference repos'
MAP_LABEL = ("mean per-token cosine cos(h_i, h_j) over calibration tokens, h_0 = embeddings … h_L = final-norm "
             "input (token-weighted)")


@dataclass(frozen=True)
class SimilarityMap:
    """M[i][j] = mean over calibration tokens of cos(h_i[t], h_j[t]), i, j = 0 … L."""

    matrix: tuple[tuple[float, ...], ...]  # (L+1) × (L+1), symmetric, ones on the diagonal
    tokens: int
    zero_norm_tokens: int  # token states with zero norm (their cosines count as 0); 0 in any real model
    label: str = MAP_LABEL

    def to_json(self) -> dict:
        return {"matrix": [list(row) for row in self.matrix], "tokens": self.tokens,
                "zero_norm_tokens": self.zero_norm_tokens, "label": self.label}


@dataclass(frozen=True)
class SimilarityStats:
    """Mean cosine similarities between residual streams h_j (h_0 = embeddings, h_L = final-norm input)."""

    num_layers: int
    n: int  # run length the run-level scores were measured for
    cosine: str  # "hidden" or "token-axis"
    run_cosine: tuple[float, ...]  # s = 0..L−n: mean cos(h_s, h_s+n)
    block_cosine: tuple[float, ...]  # i = 0..L−1: mean cos(h_i, h_i+1)
    run_angular: tuple[float, ...]  # s = 0..L−n: mean over sequences of arccos(cos(h_s, h_s+n) at the last token) / π
    tokens: int
    map: SimilarityMap | None = None  # the all-pairs map, when the pass was asked for it


def _cosine(a: torch.Tensor, b: torch.Tensor, axis: str) -> torch.Tensor:
    """Per-token cosine over the hidden dimension (B, T), or the repos' per-channel cosine over tokens (B, C)."""
    dim = -1 if axis == "hidden" else 1
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=dim, eps=1e-8)


class _SimilarityAccumulator:
    """Receives h_0 … h_L of one batch in order; keeps only the last n+1 of them."""

    def __init__(self, num_layers: int, n: int, axis: str):
        self.num_layers, self.n, self.axis = num_layers, n, axis
        self.run_sum = torch.zeros(num_layers - n + 1, dtype=torch.float64)
        self.block_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.angular_sum = torch.zeros(num_layers - n + 1, dtype=torch.float64)
        self.count = 0  # tokens (hidden) or channels×sequences (token-axis)
        self.sequences = 0
        self.window: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None
        self.last_index: torch.Tensor | None = None

    def start_batch(self, valid: torch.Tensor) -> None:
        self.window.clear()
        self.valid = valid
        self.last_index = valid.long().cumsum(1).argmax(1)  # last real token of each sequence
        self.count += int(valid.sum()) if self.axis == "hidden" else 0
        self.sequences += valid.shape[0]

    def _mean_sum(self, cos: torch.Tensor) -> float:
        if self.axis == "hidden":
            return float(cos[self.valid.to(cos.device)].double().sum())
        return float(cos.double().sum())

    def on_tensor(self, key: tuple[str, int], h: torch.Tensor) -> None:
        j = key[1]
        self.window[j] = h
        if j >= 1:
            self.block_sum[j - 1] += self._mean_sum(_cosine(self.window[j - 1], h, self.axis))
        if j >= self.n:
            earlier = self.window[j - self.n]
            self.run_sum[j - self.n] += self._mean_sum(_cosine(earlier, h, self.axis))
            rows = torch.arange(h.shape[0], device=h.device)
            last = self.last_index.to(h.device)
            cos_last = _cosine(earlier[rows, last], h[rows, last], "hidden").clamp(-1, 1)  # (B,)
            self.angular_sum[j - self.n] += float((torch.arccos(cos_last) / math.pi).double().sum())
        if self.axis == "token-axis" and j == 0:
            self.count += h.shape[0] * h.shape[-1]
        self.window.pop(j - self.n, None)

    def freeze(self, similarity_map: SimilarityMap | None = None) -> SimilarityStats:
        count = max(self.count, 1)
        return SimilarityStats(
            num_layers=self.num_layers, n=self.n, cosine=self.axis,
            run_cosine=tuple((self.run_sum / count).tolist()),
            block_cosine=tuple((self.block_sum / count).tolist()),
            run_angular=tuple((self.angular_sum / max(self.sequences, 1)).tolist()),
            tokens=self.count if self.axis == "hidden" else self.sequences,
            map=similarity_map,
        )


class _MapAccumulator:
    """The all-pairs cosine sums: each h_j, normalized per token, is dotted with every earlier one of the batch.

    Memory: (L+1) × (valid tokens of one batch) × C float32 normalized states, plus (L+1)² float64 sums.
    """

    def __init__(self, num_layers: int):
        self.size = num_layers + 1
        self.sums = torch.zeros(self.size, self.size, dtype=torch.float64)
        self.tokens = 0
        self.zero_norm = 0
        self.kept: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def start_batch(self, valid: torch.Tensor) -> None:
        self.kept, self.valid = None, valid
        self.tokens += int(valid.sum())

    def on_tensor(self, key: tuple[str, int], h: torch.Tensor) -> None:
        j = key[1]
        x = h[self.valid.to(h.device)].float()  # (N, C) valid tokens
        norms = x.norm(dim=-1, keepdim=True)  # (N, 1)
        self.zero_norm += int((norms == 0).sum())
        unit = x / norms.clamp_min(1e-8)  # (N, C); a zero state stays zero: its cosines count as 0
        if self.kept is None:
            self.kept = torch.empty(self.size, *unit.shape, dtype=unit.dtype, device=unit.device)  # (L+1, N, C)
        self.kept[j] = unit
        dots = torch.einsum("inc,nc->i", self.kept[: j + 1], unit).double().cpu()  # (j+1,) sums over tokens
        self.sums[j, : j + 1] += dots
        self.sums[:j, j] = self.sums[j, :j].clone()  # symmetric by construction

    def freeze(self) -> SimilarityMap:
        matrix = self.sums / max(self.tokens, 1)
        return SimilarityMap(tuple(tuple(row) for row in matrix.tolist()), self.tokens, self.zero_norm)


def measure_similarity(model: PreTrainedModel, n: int, batches: Sequence[CalibrationBatch], cosine: str = "hidden",
                       quiet: bool = False, with_map: bool = False) -> SimilarityStats:
    """Cosine statistics of the dense model's residual streams on calibration batches (held-out ones skipped)."""
    return measure_similarity_depths(model, [n], batches, cosine, quiet, with_map)[max(n, 1)]


def measure_similarity_depths(model: PreTrainedModel, depths: Sequence[int], batches: Sequence[CalibrationBatch],
                              cosine: str = "hidden", quiet: bool = False,
                              with_map: bool = False) -> dict[int, SimilarityStats]:
    """`measure_similarity` for several run lengths from ONE pass (a depth sweep scores the blocks once).

    Each depth keeps its own accumulator, fed the same residual streams, so its statistics
    are exactly those of a single-depth pass. Memory: the last max(depths)+1 residual
    streams of a batch (B × T × C each, references to the captured tensors); with the map,
    also L+1 normalized float32 copies of them (see `_MapAccumulator`).
    """
    if cosine not in COSINE_AXES:
        raise GhostedError(f"unknown cosine axis {cosine!r}; use {' or '.join(COSINE_AXES)}")
    num_layers = len(decoder_blocks(model))
    accs = {n: _SimilarityAccumulator(num_layers, n, cosine) for n in sorted({max(d, 1) for d in depths})}
    all_pairs = _MapAccumulator(num_layers) if with_map else None
    listeners = [*accs.values(), *([all_pairs] if all_pairs else [])]

    def on_tensor(key: tuple[str, int], h: torch.Tensor) -> None:
        for listener in listeners:
            listener.on_tensor(key, h)

    for batch in track([b for b in batches if not b.heldout], "score blocks (similarity pass)", unit="batches", quiet=quiet):
        for listener in listeners:
            listener.start_batch(valid_mask(batch))
        with capture(model, range(num_layers + 1), on_tensor=on_tensor):
            run_forward(model, batch.input_ids, batch.attention_mask)
    frozen_map = all_pairs.freeze() if all_pairs else None
    return {n: acc.freeze(frozen_map) for n, acc in accs.items()}


def similarity_bytes(shapes: ScoreShapes) -> Footprint:
    """The similarity pass at its peak: one forward's transients, the last n+1 residual streams of a batch it
    keeps, the cosine's float32 working copies (two streams), and with the comparison's map its (L+1) normalized
    float32 streams of the batch and one token-normalized copy."""
    s = shapes
    stream32 = s.batch_tokens * s.width * 4  # (B·T, C) float32
    total = s.forward() + (max(s.n, 1) + 1) * s.state() + 2 * stream32
    if s.with_map:
        total += (s.layers + 1) * stream32 + 2 * stream32
    return Footprint(total)
