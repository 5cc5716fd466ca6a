"""A causal LM view over the dense model with a given block list, final norm and config: how every pruned,
recovered, sliced or scaled view is put together (`surgery`, `scaling`), sharing the dense model's weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from transformers import PreTrainedModel

from ghosted_core.model.loading import final_norm_name
from ghosted_core.model.shallow import shallow_view
from ghosted_core.model.side_inputs import carry, dense_rows


def assemble(dense: PreTrainedModel, layers: Sequence[nn.Module], config, norm: nn.Module,
             record: Mapping | None = None, rows: Sequence[int] | None = None) -> PreTrainedModel:
    """A causal LM view over `dense` with the given block list, final norm and config (see `sliced_config`).

    `rows`: the dense indices of `layers` (default: those `dense` holds), for what blocks read besides the stream
    (`side_inputs.carry`). `record` is stored in the config as `ghosted` (what was removed and how it was
    recovered) so that saved configs carry it.
    """
    if record is not None:
        config.ghosted = dict(record)
    base = shallow_view(dense.model, layers=nn.ModuleList(layers), **{final_norm_name(dense): norm})
    base.config = config
    carry(base, dense.model, dense_rows(dense) if rows is None else rows, config)
    view = shallow_view(dense, model=base)
    view.config = config
    return view
