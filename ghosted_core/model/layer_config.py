"""The config of the kept blocks: every field that describes blocks, found on the config itself, made true again.

A decoder's config describes its blocks in four ways (transformers 5.25), and a cut must keep each true:
- **per-layer lists**, one entry per block (`layer_types`, `no_rope_layers`, `layers_block_type`): sliced
  to the kept blocks;
- **layer-index lists**, the indices of blocks with some property (`mlp_only_layers`, `full_attn_idxs`,
  `moe_layers`): renumbered over the kept blocks, dropping removed ones;
- **per-layer overrides** of a heterogeneous config (`per_layer_config`, keyed by block: Gemma 4's larger heads
  on its full-attention blocks): re-keyed over the kept blocks;
- **counts and steps** (`max_window_layers`, `first_k_dense_replace`: the blocks below a count;
  `decoder_sparse_step`: every k-th block has experts): re-counted, or replaced by the explicit index list
  they stand for, since a step cannot survive an arbitrary cut. Each is a small function in `RECOUNTS`.

The first two are inferred from the values, so a family needs no entry for them: a list of exactly as many
scalars as there are blocks is per-layer, and a sorted list of distinct block indices whose name says so
(`…_idxs`, `…_indices`, or `…_layers` with fewer entries than blocks) is an index list. `KNOWN_*` settle the
cases the values leave open (`no_rope_layers` holds 0/1 flags, a `full_attn_idxs` listing every block);
`NOT_LAYER_FIELDS` lists the token-id and naming lists that are never about blocks, whatever their length.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ghosted_core.architectures import architecture_of
from ghosted_core.config_values import global_value, layer_overrides
from ghosted_core.errors import GhostedError
from ghosted_core.config_values import kv_stores

log = logging.getLogger(__name__)

KNOWN_PER_LAYER = frozenset({"layer_types", "no_rope_layers", "layers_block_type", "sliding_window_pattern_list"})
KNOWN_INDEX_LISTS = frozenset({"mlp_only_layers", "full_attn_idxs", "moe_layers", "no_rope_layer_idxs"})
NOT_LAYER_FIELDS = frozenset({
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids", "mrope_section",
    "id2label", "label2id", "task_specific_params", "auto_map",
})  # fmt: skip
INDEX_SUFFIXES = ("_idxs", "_indices", "_layer_ids")
RECURRENT_KINDS = frozenset({"linear_attention", "conv", "mamba"})  # `layer_types` kinds that carry a state along


def recurrent(config) -> bool:
    """Whether some block carries a state along the sequence (linear attention, convolution, Mamba)."""
    return bool(RECURRENT_KINDS & set(getattr(config, "layer_types", None) or ()))


@dataclass(frozen=True)
class LayerFields:
    """Which config fields describe blocks, by how a cut changes them."""

    per_layer: tuple[str, ...]  # one entry per block: sliced
    index_lists: tuple[str, ...]  # block indices: renumbered
    recounts: tuple[str, ...]  # counts and steps with a rule in RECOUNTS


def _scalars(values: list) -> bool:
    return all(v is None or isinstance(v, (str, int, float, bool)) for v in values)


def _indices(values: list, num_layers: int) -> bool:
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return len(ints) == len(values) and ints == sorted(set(ints)) and all(0 <= v < num_layers for v in ints)


def _is_index_list(name: str, values: list, num_layers: int) -> bool:
    if name in KNOWN_INDEX_LISTS:
        return True
    if name in KNOWN_PER_LAYER or not _indices(values, num_layers):
        return False
    return name.endswith(INDEX_SUFFIXES) or (name.endswith("_layers") and len(values) != num_layers)


def layer_fields(config, values: Mapping | None = None, num_layers: int | None = None) -> LayerFields:
    """The fields of `config` (a decoder's text config) that describe its blocks; `values` and `num_layers`:
    read those instead of the config's own (an export's config.json dict, at the dense block count)."""
    num_layers = int(config.num_hidden_layers if num_layers is None else num_layers)
    values = {name: global_value(config, name) for name in config.to_dict()} if values is None else values
    per_layer, index_lists = [], []
    for name, value in values.items():
        if name in NOT_LAYER_FIELDS or not isinstance(value, (list, tuple)) or not _scalars(list(value)):
            continue
        if _is_index_list(name, list(value), num_layers):
            index_lists.append(name)
        elif len(value) == num_layers and num_layers > 1:
            per_layer.append(name)
    recounts = tuple(name for name in RECOUNTS if values.get(name) is not None)
    return LayerFields(tuple(per_layer), tuple(index_lists), recounts)


# ---------------------------------------------------------------- counts and steps

Recount = Callable[[object, Sequence[int]], dict]  # (dense config, kept blocks) -> the fields to set


def _leading_count(name: str) -> Recount:
    """Blocks below the count have a property (Qwen2's full attention below `max_window_layers`, DeepSeek's dense
    MLP below `first_k_dense_replace`): the new count is the number of kept blocks below it."""
    return lambda config, kept: {name: sum(1 for j in kept if j < getattr(config, name))}


def _sparse_step(config, kept: Sequence[int]) -> dict:
    """Qwen-MoE's rule: block j has experts unless j is in `mlp_only_layers`, or every `decoder_sparse_step`-th
    (j + 1 divisible by it). After a cut the rule would put experts on other blocks, so the dense blocks are
    written out as `mlp_only_layers` over the kept ones, with a step of 1."""
    step = int(config.decoder_sparse_step)
    experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    dense = [i for i, j in enumerate(kept) if j in dense_only or not (experts > 0 and step > 0 and (j + 1) % step == 0)]
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


def _trailing_count(name: str) -> Recount:
    """The last `name` blocks have a property (Gemma 4's `num_kv_shared_layers`: they reuse earlier blocks' keys and
    values): the new count is the number of kept blocks among them."""
    return lambda config, kept: {name: sum(1 for j in kept if j >= config.num_hidden_layers - getattr(config, name))}


RECOUNTS: dict[str, Recount] = {
    "max_window_layers": _leading_count("max_window_layers"),
    "num_kv_shared_layers": _trailing_count("num_kv_shared_layers"),
    "first_k_dense_replace": _leading_count("first_k_dense_replace"),
    "decoder_sparse_step": _sparse_step,
}


# ---------------------------------------------------------------- slicing


def sliced_values(config, kept: Sequence[int]) -> dict:
    """The new values of every block-describing field of `config` for the blocks `kept` (ascending)."""
    fields = layer_fields(config)
    position = {j: i for i, j in enumerate(kept)}
    values: dict = {}
    for name in fields.per_layer:
        values[name] = [getattr(config, name)[j] for j in kept]
    for name in fields.index_lists:
        values[name] = [position[j] for j in getattr(config, name) if j in position]
    for name in fields.recounts:  # after the index lists: a step rewrites `mlp_only_layers` from the dense config
        values.update(RECOUNTS[name](config, kept))
    return values


def required_reasons(config) -> dict[int, str]:
    """The blocks every cut must keep, by the family's rules, with why: Gemma 4's last (`Architecture.last_block_stays`)
    and the blocks whose keys and values later blocks reuse (`config_values.kv_stores`)."""
    reasons = {j: f"the keys and values it computes are reused by the last {config.num_kv_shared_layers} blocks "
                  "(shared KV): without it they would read another block's" for j in kv_stores(config)}
    if architecture_of(config).last_block_stays:
        reasons[int(config.num_hidden_layers) - 1] = f"it is the last: {architecture_of(config).last_block_stays}"
    return reasons


def required_blocks(config) -> tuple[int, ...]:
    """The blocks every cut must keep (`required_reasons`), ascending."""
    return tuple(sorted(required_reasons(config)))


def check_required_kept(config, removed: Sequence[int]) -> None:
    """Refuse a cut that removes a block the family requires (see `required_reasons`), with the reason."""
    reasons = required_reasons(config)
    for j in sorted(set(removed) & set(reasons)):
        raise GhostedError(f"block {j} must stay: {reasons[j]}")


def check_kept_kinds(config, kept: Sequence[int]) -> None:
    """Refuse a cut of a hybrid model that keeps none of its attention blocks: transformers sizes a cache's masks
    by an attention layer, so such a model cannot generate (it still runs without a cache)."""
    kinds = list(getattr(config, "layer_types", None) or ())
    if not kinds or not recurrent(config) or not kept:
        return
    attention = [j for j, kind in enumerate(kinds) if kind not in RECURRENT_KINDS]
    if attention and all(kinds[j] in RECURRENT_KINDS for j in kept):
        raise GhostedError(f"this cut removes every attention block of the model ({', '.join(map(str, attention))}); "
                           "transformers cannot generate with a cache of recurrent layers alone: keep one of them "
                           "(--layers for a manual cut, or fewer blocks)")


def sliced_config(config, kept: Sequence[int]):
    """A copy of `config` (a decoder's text config) for the blocks at indices `kept` (ascending) of the model it
    describes; the dense config is never touched."""
    values = sliced_values(config, kept)
    overrides = layer_overrides(config)
    config = copy.deepcopy(config)
    for name, value in values.items():
        setattr(config, name, value)
    config.num_hidden_layers = len(kept)
    if overrides:  # renumbered over the kept blocks (after the count: transformers checks keys against it)
        config.per_layer_config = {i: copy.deepcopy(overrides[j]) for i, j in enumerate(kept) if j in overrides}
    return config
