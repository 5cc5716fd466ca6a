"""What llama.cpp's runtime decides from a GGUF's block count or a layer's index instead of reading the file, and
what a pruned export must therefore write (or refuse) so that llama.cpp computes what transformers computes.

Audited in the llama.cpp that `make llamacpp` builds (commit `LLAMACPP_COMMIT`, src/models/*.cpp): for every
architecture of the table, each fact that depends on `n_layer` (through the model "type") or on a layer's index
and reaches the compute graph. A dense checkpoint matches those rules by construction; a cut one usually does not.

- `swa_period` n (Gemma-2, Gemma-3, gpt-oss: `load_swa_pattern(ml, n)`): without the per-layer array
  `<arch>.attention.sliding_window_pattern`, layer i is windowed when i % n < n − 1. Fix: write the kept layers'
  array (the runtime reads it first). On Gemma-3 it also picks each layer's RoPE base.
- `scale_layers` (Gemma-2 at 46 blocks, Gemma-3 at 62: their 27B): attention is scaled by 1/√(hidden/heads) at
  that block count and by 1/√head_dim at any other; no key overrides it. transformers uses
  1/√query_pre_attn_scalar. Fix: fold the ratio into the query (`scale_into`: Gemma-3's q_norm gain, exact;
  Gemma-2's q_proj, exact before quantization), as llama.cpp will read it.
- `all_sparse` (Qwen2-MoE, Qwen3-MoE): the graph has experts in every block; a config with dense blocks among
  them (`mlp_only_layers`, `decoder_sparse_step`) does not convert, and is refused with the reason.
- `no_rope_step` (SmolLM3, Llama-4): layer i runs without RoPE when (i + 1) % 4 == 0, from no key. No weight can
  carry RoPE, so a cut whose kept `no_rope_layers` break that rule is refused for GGUF, with the reason. (On Llama-4
  the RoPE-less blocks are also its full-attention ones, so the rule keeps its chunked pattern too.)
- `expert_step_key` (Llama-4): block i has experts when (i + 1) % step == 0, step read from that key
  (`interleave_moe_layer_step`); the config lists its expert blocks (`moe_layers`), and a cut that moves them off
  the step is refused.
- `assumed` (Llama-4): values the runtime sets itself whatever the file says (the attention chunk of 8,192
  positions, and the attention temperature on its RoPE-less blocks with floor 8,192 and scale 0.1, as on Scout
  and Maverick); a config with others is refused. MiniCPM3 likewise: the embedding scale 12, the depth scale 1.4
  and the logit base width 256 are constants of its graph (MiniCPM3-4B's).
- `window_ignored` (Mistral, Phi-3, Qwen2): the graph runs full attention whatever the file says (Phi-3: "SWA is
  currently disabled"); an export whose config has a sliding window shorter than its context is warned about.
- `softcap_unless_written` (Gemma 4, Gemma 4 Unified): the final logits are soft-capped at 30 unless the file says otherwise, and
  the converter writes the key only when the config sets one: a config without capping gets 0 written (off).
  Everything else Gemma 4 needs is read from the file (window pattern, per-kind head sizes and kv heads,
  shared-KV count, attention scale 1 as transformers); its type only names the model.
- `kv_store_offsets` (Gemma 4 E2B/E4B): the blocks from `n_layer − shared_kv_layers` on attend with the keys and
  values of the block 2 before the first of them (sliding) or 1 before (full), by position; transformers reads the
  last earlier block of their kind. A cut keeps the blocks that store them (`layer_config.required_reasons`), so a
  cut of E2B/E4B (whose last two unshared blocks are sliding, then full) keeps llama.cpp's positions; a config laid
  out otherwise is refused for GGUF.

Other uses of the type in these architectures only name the model in logs (llama, mistral, qwen2/3, their MoEs,
phi3, olmo2/3, olmoe, granite, granitehybrid, lfm2, gemma4, minicpm3); Qwen3-Next's, OLMo's and LFM2's per-layer kinds are read from
the file the converter writes from the sliced config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeRules:
    swa_period: int | None = None  # layer i windowed when i % n < n - 1, unless the file lists the layers
    scale_layers: int | None = None  # the block count at which attention is scaled by 1/sqrt(hidden / heads)
    scale_into: str = ""  # the tensor (name suffix) whose output scales the query, for the fold
    no_rope_step: int | None = None  # layer i without RoPE when (i + 1) % n == 0, from no key
    all_sparse: bool = False  # the graph has experts in every block: dense blocks among them do not convert
    expert_step_key: str = ""  # block i has experts when (i + 1) % config[key] == 0
    assumed: tuple[tuple[str, object], ...] = ()  # (config key, the value the runtime uses whatever the file says)
    softcap_unless_written: float = 0.0  # the final-logit cap the runtime applies when the file has no key
    window_ignored: bool = False  # the graph runs full attention whatever sliding window the file names
    # shared-KV blocks read the block this many before the first of them, by kind ({"sliding_attention": 2, …})
    kv_store_offsets: tuple[tuple[str, int], ...] = ()


# Gemma 4 and Gemma 4 Unified: one llama.cpp graph (the converter writes GEMMA4 for both)
GEMMA4 = RuntimeRules(softcap_unless_written=30.0, kv_store_offsets=(("sliding_attention", 2), ("full_attention", 1)))
# MiniCPM3: the graph's own constants (src/models/minicpm3.cpp: "if the model varies, these parameters need to be
# read from the model"), the values of MiniCPM3-4B; its depth scale divides by the file's block count, as a
# checkpoint's reload does
MINICPM3 = RuntimeRules(assumed=(("scale_emb", 12), ("scale_depth", 1.4), ("dim_model_base", 256)))

RULES: dict[str, RuntimeRules] = {
    "mistral": RuntimeRules(window_ignored=True),
    "phi3": RuntimeRules(window_ignored=True),
    "qwen2": RuntimeRules(window_ignored=True),
    "gemma2": RuntimeRules(swa_period=2, scale_layers=46, scale_into="self_attn.q_proj.weight"),
    "gemma3_text": RuntimeRules(swa_period=6, scale_layers=62, scale_into="self_attn.q_norm.weight"),
    "gemma4_text": GEMMA4,
    "gemma4_unified_text": GEMMA4,
    "minicpm3": MINICPM3,
    "gpt_oss": RuntimeRules(swa_period=2),
    "smollm3": RuntimeRules(no_rope_step=4),
    "llama4_text": RuntimeRules(no_rope_step=4, expert_step_key="interleave_moe_layer_step",
                                assumed=(("attention_chunk_size", 8192), ("attn_temperature_tuning", True),
                                         ("floor_scale", 8192), ("attn_scale", 0.1))),
    "qwen2_moe": RuntimeRules(all_sparse=True),
    "qwen3_moe": RuntimeRules(all_sparse=True),
}


def converter_fixes(config: dict) -> dict:
    """What the converter must write beyond its own output for `config` (a stock export's config.json):
    {"swa_pattern": [bool per layer]} where the kept layer kinds differ from the runtime's index rule, and
    {"query_scale": {"suffix": ..., "factor": f}} where the runtime's attention scale differs from the config's;
    {"final_softcap": 0.0} where the runtime would cap logits the config leaves uncapped."""
    config = text_values(config)
    rules = RULES.get(str(config.get("model_type")))
    fixes: dict = {}
    if rules is None:
        return fixes
    types, n = config.get("layer_types"), config.get("num_hidden_layers", 0)
    if rules.swa_period and types:
        pattern = [t == "sliding_attention" for t in types]
        if pattern != [i % rules.swa_period < rules.swa_period - 1 for i in range(n)]:
            fixes["swa_pattern"] = pattern
    if rules.scale_layers and config.get("query_pre_attn_scalar"):
        factor = attention_scale_ratio(config, rules)
        if not math.isclose(factor, 1.0, rel_tol=1e-7):
            fixes["query_scale"] = {"suffix": rules.scale_into, "factor": factor}
    if rules.softcap_unless_written and not config.get("final_logit_softcapping"):
        fixes["final_softcap"] = 0.0
    return fixes


def text_values(config: dict) -> dict:
    """A multimodal checkpoint's text config (its decoder is what the rules are about); a text model's as it is."""
    return config | config["text_config"] if isinstance(config.get("text_config"), dict) else config


def attention_scale_ratio(config: dict, rules: RuntimeRules) -> float:
    """transformers' attention scale over the one llama.cpp applies to a model of this block count."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    runtime = (hidden // heads if config["num_hidden_layers"] == rules.scale_layers else head_dim) ** -0.5
    return config["query_pre_attn_scalar"] ** -0.5 / runtime


def ignored_window(config: dict) -> int | None:
    """The sliding window (tokens) that llama.cpp will not apply to this export, where it is shorter than the
    context; None where the runtime applies what transformers does (Qwen2 windows only with use_sliding_window)."""
    config = text_values(config)
    rules = RULES.get(str(config.get("model_type")))
    window = config.get("sliding_window")
    if rules is None or not rules.window_ignored or not window or not config.get("use_sliding_window", True):
        return None
    return window if window < config.get("max_position_embeddings", 0) else None


def runtime_refusal(config: dict) -> str | None:
    """Why llama.cpp would run this export differently from its config, where no file key or weight can say
    otherwise (None: it runs as transformers does)."""
    config = text_values(config)
    rules = RULES.get(str(config.get("model_type")))
    if rules is None:
        return None
    for check in (_dense_among_experts, _assumed_values, _experts_off_step, _rope_off_step, _kv_stores_elsewhere):
        if (reason := check(config, rules)) is not None:
            return reason
    return None


SERVE_STOCK = "serve the stock folder (transformers, vLLM)"


def _dense_among_experts(config: dict, rules: RuntimeRules) -> str | None:
    if rules.all_sparse and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        return (f"llama.cpp's {config['model_type']} graph has experts in every block, and this model has dense "
                f"blocks among them (mlp_only_layers {config.get('mlp_only_layers')}, decoder_sparse_step "
                f"{config.get('decoder_sparse_step', 1)}): {SERVE_STOCK}")
    return None


def _assumed_values(config: dict, rules: RuntimeRules) -> str | None:
    wrong = {key: config[key] for key, value in rules.assumed if key in config and config[key] != value}
    if wrong:
        return (f"llama.cpp runs {config['model_type']} with {dict(rules.assumed)} whatever the file says, and this "
                f"model has {wrong}: {SERVE_STOCK}")
    return None


def _experts_off_step(config: dict, rules: RuntimeRules) -> str | None:
    if not rules.expert_step_key or "moe_layers" not in config:
        return None
    step, n = int(config.get(rules.expert_step_key) or 1), config["num_hidden_layers"]
    runtime = [i for i in range(n) if (i + 1) % step == 0]
    kept = sorted(int(i) for i in config["moe_layers"])
    if kept == runtime:
        return None
    return (f"llama.cpp puts {config['model_type']}'s experts on the last block of every {step} by position "
            f"({rules.expert_step_key} {step}), and this cut has them on blocks {kept[:8]}, not {runtime[:8]}: keep the "
            f"pattern (remove runs of {step} blocks), or {SERVE_STOCK}")


def _rope_off_step(config: dict, rules: RuntimeRules) -> str | None:
    if not rules.no_rope_step or "no_rope_layers" not in config:
        return None
    step, kept = rules.no_rope_step, [int(v) for v in config["no_rope_layers"]]
    runtime = [int((i + 1) % step != 0) for i in range(len(kept))]
    if kept == runtime:
        return None
    wrong = [i for i, (a, b) in enumerate(zip(kept, runtime)) if a != b]
    return (f"llama.cpp runs {config['model_type']} without RoPE on every {step}th block by position and reads no "
            f"per-layer list, so this cut's blocks {wrong[:6]} would run with the wrong RoPE; keep the pattern (remove "
            f"runs of {step} blocks that start at a multiple of {step}, or the last blocks), or {SERVE_STOCK}")


def _kv_stores_elsewhere(config: dict, rules: RuntimeRules) -> str | None:
    shared, kinds = int(config.get("num_kv_shared_layers") or 0), config.get("layer_types") or []
    if not rules.kv_store_offsets or not shared or not kinds:
        return None
    first = len(kinds) - shared
    ours = {kind: max((j for j in range(first) if kinds[j] == kind), default=None) for kind in set(kinds[first:])}
    theirs = {kind: first - offset for kind, offset in rules.kv_store_offsets if kind in ours}
    if ours == theirs:
        return None
    return (f"llama.cpp's {config['model_type']} blocks from {first} on reuse the keys and values of blocks {theirs} by "
            f"position, and this model's come from blocks {ours} (the last earlier block of their kind): {SERVE_STOCK}")
