"""Gemma 4 E2B/E4B's blocks read more than the residual stream (per-layer embeddings of the tokens, keys and values
stored by earlier blocks): a cut, a stream-fed view and an export carry both, held against the dense model's blocks
run by hand with the full per-layer inputs."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import KVSharingDict
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from conftest import make_tiny_model, random_tokens
from ghosted_core.evaluation.perplexity import shared_prefix
from ghosted_core.export.checkpoint import module_tensors
from ghosted_core.model import side_inputs
from ghosted_core.model.side_inputs import PackedRows, dense_per_layer_inputs, self_contained_start, stream_kwargs
from ghosted_core.model.surgery import build_variant, slice_view


@pytest.fixture(scope="module")
def e2b():
    return make_tiny_model("gemma4_e2b")


def by_hand(dense, ids: torch.Tensor, removed) -> torch.Tensor:
    """Logits of the dense model without the `removed` blocks, each kept block fed its own dense per-layer input
    and one KV-sharing dict filled by the blocks that run, as transformers' forward does for the whole model."""
    base, config = dense.model, dense.config
    embeds = base.embed_tokens(ids)
    per_layer = base.project_per_layer_inputs(embeds, base.get_per_layer_inputs(ids))  # (B, T, L, P)
    positions = torch.arange(ids.shape[1])[None]
    kw = dict(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
    masks = {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}
    h, shared = embeds, KVSharingDict()
    for j, block in enumerate(base.layers):
        if j in removed:
            continue
        kind = config.layer_types[j]
        h = block(h, per_layer[:, :, j], shared_kv_states=shared, position_embeddings=base.rotary_emb(h, positions, kind),
                  attention_mask=masks[kind], position_ids=positions)
    return dense.lm_head(base.norm(h))


@pytest.mark.parametrize("removed", [(0,), (4,), (0, 1), (1, 4), (0, 1, 4)])
def test_a_cut_reads_each_kept_blocks_own_per_layer_input_and_stored_keys(e2b, removed):
    """The cut model (fed token ids, with and without a KV cache) equals the dense blocks run by hand."""
    ids = random_tokens(2, 20, seed=1)
    variant = build_variant(e2b, removed)
    assert variant.config.num_kv_shared_layers == 2 - (4 in removed)
    with torch.no_grad():
        expected = by_hand(e2b, ids, removed)
        torch.testing.assert_close(variant(ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
        prefill = variant(ids[:, :12], use_cache=True)
        step = variant(ids[:, 12:13], past_key_values=prefill.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], expected[:, 12], rtol=1e-4, atol=1e-4)


def test_a_stream_fed_suffix_is_given_its_per_layer_inputs_and_starts_where_it_computes_its_keys(e2b):
    """A suffix fed the stream equals the whole model from every start up to the first storing block (2), given its
    per-layer inputs from the token ids; from block 3 on it would miss the keys block 2 stores for block 4, so no
    view starts there: prefix sharing stops at block 2 whatever a variant shares."""
    ids = random_tokens(2, 20, seed=2)
    assert self_contained_start(e2b.config) == 2
    with torch.no_grad():
        full = e2b.model(input_ids=ids, use_cache=False).last_hidden_state
        for start in range(0, 3):
            h = slice_view(e2b, e2b, 0, start, normed=False, stream_input=False).model(input_ids=ids).last_hidden_state
            suffix = slice_view(e2b, e2b, start, stream_input=True)
            out = suffix.model(inputs_embeds=h, use_cache=False, **stream_kwargs(suffix, ids)).last_hidden_state
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="per-layer inputs"):  # its own would come from the stream
            suffix.model(inputs_embeds=h, use_cache=False)
        h = slice_view(e2b, e2b, 0, 3, normed=False, stream_input=False).model(input_ids=ids).last_hidden_state
        late = slice_view(e2b, e2b, 3, stream_input=True)
        with pytest.raises(KeyError):
            late.model(inputs_embeds=h, use_cache=False, **stream_kwargs(late, ids))
    assert shared_prefix(e2b, build_variant(e2b, (4,))) == 2


def test_a_views_slices_of_the_dense_per_layer_inputs_equal_its_own():
    """Perplexity and task scoring make the dense model's per-layer inputs once per batch and give each stream-fed
    view its slices (`stream_kwargs(view, ids, dense_inputs)`): the same tensors the view's own packed modules make,
    for suffixes of cuts that keep other blocks."""
    model = make_tiny_model("gemma4_e2b")
    ids = random_tokens(2, 12, seed=4)
    dense_inputs = dense_per_layer_inputs(model, ids)
    assert dense_inputs.shape == (2, 12, 6, model.config.hidden_size_per_layer_input)
    for removed, start in (((0,), 0), ((0, 4), 1), ((1,), 1)):
        variant = build_variant(model, removed)
        suffix = slice_view(variant, model, start, stream_input=True)
        own = stream_kwargs(suffix, ids)["per_layer_inputs"]
        torch.testing.assert_close(stream_kwargs(suffix, ids, dense_inputs)["per_layer_inputs"], own, rtol=1e-6,
                                   atol=1e-6)
    assert dense_per_layer_inputs(make_tiny_model("llama"), ids) is None


def realized(tensor) -> torch.Tensor:
    """A streamed tensor's pieces joined (what the writer puts in the file), checked against its declared size."""
    pieces = list(tensor.pieces())
    assert all(p.is_contiguous() for p in pieces)
    return torch.cat([p.reshape(-1) for p in pieces]).view(tensor.shape)


@pytest.mark.parametrize("slab", [side_inputs.SLAB_BYTES, 1])  # one slab; every vocabulary row its own
def test_an_export_writes_the_kept_blocks_slices_of_the_packed_tensors(e2b, slab, monkeypatch):
    """The per-layer table (V × L·P) and projection (L·P × C) are written with the removed blocks' slices left out,
    in the kept blocks' order, a slab at a time (never copied whole), and `meta` gives the same shapes without
    reading anything."""
    monkeypatch.setattr(side_inputs, "SLAB_BYTES", slab)
    variant = build_variant(e2b, (0, 4))
    width = e2b.config.hidden_size_per_layer_input
    tensors = {k: realized(v) if hasattr(v, "pieces") else v for k, v in module_tensors(variant.model, "model.")}
    meta = dict(module_tensors(variant.model, "model.", device="meta"))
    table = e2b.model.embed_tokens_per_layer.weight.unflatten(1, (-1, width))  # (V, L, P)
    projection = e2b.model.per_layer_model_projection.weight.unflatten(0, (-1, width))  # (L, P, C)
    kept = [1, 2, 3, 5]
    assert torch.equal(tensors["model.embed_tokens_per_layer.weight"], table[:, kept].flatten(1))
    assert torch.equal(tensors["model.per_layer_model_projection.weight"], projection[kept].flatten(0, 1))
    assert {k: v.shape for k, v in meta.items()} == {k: v.shape for k, v in tensors.items()}
    assert isinstance(variant.model.embed_tokens_per_layer, PackedRows)
    assert e2b.model.embed_tokens_per_layer.weight.shape[1] == 6 * width  # the dense model is never touched
