"""A config's values as a cut or a plan reads them, also where transformers 5 refuses to answer.

A heterogeneous config (`per_layer_config`: Gemma 4's wider heads on its full-attention blocks) raises on a global
read of an attribute that varies by block. A plan wants the largest value (`widest`), a cut each block's overrides
(`layer_overrides`), and the config's own view of its fields (`global_value`).
"""

from __future__ import annotations


def global_value(config, name: str, default=None):
    """`config.name` as the config holds it globally, also where a heterogeneous config (`per_layer_config`,
    transformers 5) refuses to answer for a per-layer attribute (Gemma 4's head_dim and kv heads)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, default) if read is not None else getattr(config, name, default)


def layer_overrides(config) -> dict[int, dict]:
    """A heterogeneous config's per-block overrides ({block: {attribute: value}}, only blocks that differ from the
    global config); {} for a homogeneous one."""
    spec = config.__dict__.get("_heterogeneity_spec")
    return dict(spec.per_layer_overrides) if spec is not None else {}


def widest(config, name: str, default=None):
    """The largest value of `name` over the blocks (a heterogeneous config's overrides included): what a bound on
    one block's memory or work reads; the config's own value where it is homogeneous."""
    values = [value for j, over in layer_overrides(config).items() if (value := over.get(name)) is not None]
    own = global_value(config, name, default)
    return max([v for v in (own, *values) if v is not None], default=default)


# a dense MLP's inner width, by family (Llama-4: `intermediate_size` is its experts', `intermediate_size_mlp` its MLP's)
INNER_NAMES = ("intermediate_size", "intermediate_size_mlp", "ffn_dim", "ffn_hidden_size", "n_inner")
EXPERT_NAMES = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")


def mlp_width(config) -> int:
    """The inner width I of a block's widest MLP, under whichever names the config gives it: a dense MLP's (Llama's
    intermediate_size, Llama-4's intermediate_size_mlp, Moshi's ffn_dim, GPT-2's n_inner), else the widest expert or
    shared expert (Qwen3.5-MoE names no dense width), else 4·C (GPT-2-style `n_inner = None`). Heterogeneous
    configs: the widest block."""
    for names in (INNER_NAMES, EXPERT_NAMES):
        values = [v for name in names if isinstance(v := widest(config, name), int) and v > 0]
        if values:
            return max(values)
    return 4 * int(config.hidden_size)


def per_layer_width(config) -> int:
    """P, the width of each block's slice of per-layer embeddings (Gemma 4 E2B/E4B; the field the family's table
    entry names), 0 where the family or checkpoint has none."""
    from ghosted_core.architectures import architecture_of  # the table reads config values too

    return architecture_of(config).per_layer_inputs_width(config)


def kv_stores(config) -> tuple[int, ...]:
    """The blocks whose keys and values later blocks reuse on the same pass (Gemma 4 E2B/E4B: transformers'
    `kv_sharing_modes`), () where none do."""
    if not int(getattr(config, "num_kv_shared_layers", 0) or 0):
        return ()
    modes = list(getattr(config, "kv_sharing_modes", None) or [])
    return tuple(j for j, mode in enumerate(modes) if mode == "store") if "reuse" in modes else ()
