"""Gemma 4 E2B's side inputs at C = 4096: a random E2B-shaped text model (4 blocks, 16 heads of 256 (512 on the full
blocks), per-layer embeddings of 256 per block, the last block sharing KV; a 4,096-token vocabulary), cut at block 0,
run whole and as a stream-fed suffix given its per-layer inputs, and its kept per-layer table sliced as an export
writes it; then one round of sleb on the dense model from cached streams. Prints the suffix's relative gap to the
whole model, the exported table's shape, sleb's choice and its NLL's gap to a full forward, the time and peak RSS.

    .venv/bin/python bench/side_inputs_scale.py
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from ghosted_core.export.checkpoint import module_tensors  # noqa: E402  (the repository root, as the other benches)
from ghosted_core.model.side_inputs import stream_kwargs  # noqa: E402
from ghosted_core.calibration.collect import make_batches  # noqa: E402
from ghosted_core.model.layer_config import required_blocks  # noqa: E402
from ghosted_core.model.surgery import build_variant, slice_view  # noqa: E402
from ghosted_core.selection.sleb import sleb_order  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    started = time.perf_counter()
    config = Gemma4TextConfig(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=4096,
                              intermediate_size=8192, num_hidden_layers=4, num_attention_heads=16,
                              num_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
                              num_kv_shared_layers=1, sliding_window=64,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"])
    dense = Gemma4ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 128))
    with torch.no_grad():
        cut = build_variant(dense, (0,))
        whole = cut(ids, use_cache=False).logits
        stream = slice_view(cut, dense, 0, 0, normed=False, stream_input=False).model(input_ids=ids).last_hidden_state
        suffix = slice_view(cut, dense, 0, stream_input=True)
        out = suffix.model(inputs_embeds=stream, use_cache=False, **stream_kwargs(suffix, ids)).last_hidden_state
        gap = float((cut.lm_head(out) - whole).abs().max() / whole.abs().max())
        table = dict(module_tensors(cut.model, "model."))["model.embed_tokens_per_layer.weight"]
        # sleb from cached streams (per-layer inputs given per slot, stored keys and values carried): round 1's
        # NLL of its choice against a full forward of that cut
        scored = time.perf_counter()
        result = sleb_order(dense, 1, make_batches(ids, None, 1))
        chosen = result.order[0]
        logp = torch.log_softmax(build_variant(dense, (chosen,))(ids).logits[:, :-1].double(), dim=-1)
        full = float(-logp.gather(-1, ids[:, 1:, None]).sum())
        sleb_gap = abs(result.rounds[0].nll[chosen] - full) / full
        sleb_seconds = time.perf_counter() - scored
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"suffix vs whole: relative gap {gap:.2e}; exported per-layer table {tuple(table.shape)} "
          f"(dense {tuple(dense.model.embed_tokens_per_layer.weight.shape)}); sleb removes block {chosen} (kept: "
          f"{list(required_blocks(dense.config))}), its NLL vs the full forward: relative gap {sleb_gap:.2e}, "
          f"{sleb_seconds:.1f} s; {time.perf_counter() - started:.1f} s in all, peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    main()
