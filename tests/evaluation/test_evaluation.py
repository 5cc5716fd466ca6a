"""Evaluation: prefix-shared perplexity equals the plain computation; drift and generation."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from conftest import TINY_LAYERS, make_tiny_model, random_tokens, run_blocks
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.evaluation.generation import GenerationOptions, generate
from ghosted_core.evaluation.perplexity import block_drift, perplexity, shared_prefix
from ghosted_core.plan import PruningPlan
from ghosted_core.stopping import RunStopped
from ghosted_core.model.surgery import build_variant
from conftest import recovered_variants


def plain_perplexity(model, windows: torch.Tensor) -> float:
    """transformers' own loss, window by window, as an independent reference."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            loss = model(ids[None], labels=ids[None], use_cache=False).loss
            total += float(loss) * (len(ids) - 1)
            count += len(ids) - 1
    return math.exp(total / count)


def test_perplexity_with_shared_prefix_equals_plain(tiny_model):
    plan, variants = recovered_variants(tiny_model, (2, 3, 5))
    models = {"dense": tiny_model, **variants}
    windows = random_tokens(5, 12, seed=4)
    got = perplexity(tiny_model, models, windows, batch_size=2, quiet=True)
    for name, model in models.items():
        assert got[name] == pytest.approx(plain_perplexity(model, windows), rel=1e-5), name


@pytest.mark.parametrize("family", ["granite", "granitemoehybrid", "gemma2", "qwen3_next", "lfm2", "gpt_oss",
                                    "llama4_text", "gemma4_text"])
def test_perplexity_with_shared_prefix_equals_plain_on_the_new_families(family):
    """Granite multiplies the embeddings inside the base model's forward: a suffix fed the stream must not multiply
    it again. Its embeddings are made small here, so that what the blocks write matters to the logits (with the
    tiny models' scaled-up embeddings a second multiplication hides in the noise)."""
    model = make_tiny_model(family)
    with torch.no_grad():
        model.model.embed_tokens.weight.div_(20 * getattr(model.config, "embedding_multiplier", 1.0))
    plan, variants = recovered_variants(model, (2, 3))
    models = {"dense": model, **{k: variants[k] for k in ("none", "ghost", "magcomp")}}
    windows = random_tokens(4, 12, seed=4)
    got = perplexity(model, models, windows, batch_size=2, quiet=True)
    for name, variant in models.items():
        assert got[name] == pytest.approx(plain_perplexity(variant, windows), rel=1e-5), (family, name)


@pytest.mark.parametrize("removed", [(4,), (0, 1)])
def test_gemma4_e2b_perplexity_with_shared_prefix_equals_plain(removed):
    """Gemma 4 E2B's suffixes fed the shared stream are given their slices of the batch's per-layer inputs (made
    once from the dense model) and start no later than the first KV-storing block: equal to full forwards."""
    model = make_tiny_model("gemma4_e2b")
    _plan, variants = recovered_variants(model, removed)
    models = {"dense": model, "none": variants["none"], "ghost": variants["ghost"]}
    windows = random_tokens(4, 12, seed=4)
    got = perplexity(model, models, windows, batch_size=2, quiet=True)
    for name, variant in models.items():
        assert got[name] == pytest.approx(plain_perplexity(variant, windows), rel=1e-5), (removed, name)


def test_cached_dense_states_serve_variants_that_share_less_than_any_of_them(tiny_llama):
    """magcomp changes block 0 (its writers are scaled): it runs from the embeddings, the others from the cache."""
    from ghosted_core.evaluation.perplexity import dense_prefix_states, perplexity_from_states

    _plan, variants = recovered_variants(tiny_llama, (3, 4))
    models = {name: variants[name] for name in ("none", "magcomp", "replaceme", "ghost")}
    assert shared_prefix(tiny_llama, models["magcomp"]) == 0 and shared_prefix(tiny_llama, models["none"]) == 3
    windows = random_tokens(4, 12, seed=6)
    cached = dense_prefix_states(tiny_llama, windows, [3], batch_size=2, quiet=True)
    got = perplexity_from_states(tiny_llama, models, cached, quiet=True)
    for name, model in models.items():
        assert got[name] == pytest.approx(plain_perplexity(model, windows), rel=1e-5), name


def test_shared_prefix_counts_identical_leading_blocks(tiny_llama):
    assert shared_prefix(tiny_llama, tiny_llama) == TINY_LAYERS
    assert shared_prefix(tiny_llama, build_variant(tiny_llama, (3, 4))) == 3
    _plan, variants = recovered_variants(tiny_llama, (3, 4))
    assert shared_prefix(tiny_llama, variants["replaceme"]) == 2  # block 2's down projection is folded


def test_perplexity_needs_two_tokens(tiny_llama):
    with pytest.raises(GhostedError):
        perplexity(tiny_llama, {"dense": tiny_llama}, random_tokens(2, 1), quiet=True)


def test_block_drift_against_direct_computation(tiny_llama):
    """Every block's drift, all tokens and ordinary tokens, from residual streams computed by hand."""
    plan = PruningPlan(TINY_LAYERS, (2, 3), "manual")
    pruned = build_variant(tiny_llama, plan.removed)
    ids = random_tokens(3, 10)
    options = CalibrationOptions(sink_rule="position", sink_positions=1)  # position 0 counts as a sink
    drift = block_drift(tiny_llama, {"none": pruned}, plan, ids, options)["none"]
    assert drift.blocks == (4, 5, 6)  # dense indices after the cut; 6 = the final norm's input
    blocks = list(tiny_llama.model.layers)
    with torch.no_grad():
        h = [tiny_llama.model.embed_tokens(ids)]  # h[j]: the dense stream entering block j
    for block in blocks:
        h.append(run_blocks(tiny_llama, h[-1], [block]))
    mine = h[2]  # the pruned model feeds h_2 where the dense one fed h_4
    for k, j in enumerate(drift.blocks):
        diff, ref = (mine - h[j]).double(), h[j].double()
        assert drift.error[k] == pytest.approx(float(diff.norm() / ref.norm()), rel=1e-5), j
        ordinary = float(diff[:, 1:].norm() / ref[:, 1:].norm())
        assert drift.error_ordinary[k] == pytest.approx(ordinary, rel=1e-5), j
        assert abs(drift.error_ordinary[k] - drift.error[k]) > 1e-6  # the sink position really was left out
        if j < TINY_LAYERS:
            mine = run_blocks(tiny_llama, mine, [blocks[j]])


def greedy_by_hand(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy continuation from cache-free full forwards: argmax of the last position, appended, repeated."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, prompt.shape[1]:].tolist()


class DigitTokenizer:
    """The smallest tokenizer generate() needs: space-separated token ids."""

    pad_token_id, eos_token_id = 0, 0

    def __call__(self, text, return_tensors="pt"):
        ids = torch.tensor([[int(t) for t in text.split()]])
        return type("Encoded", (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def test_greedy_generation_follows_the_argmax_of_full_forwards(tiny_llama):
    models = {"dense": tiny_llama, "none": build_variant(tiny_llama, (2, 3))}
    texts = generate(models, DigitTokenizer(), "5 17 23 4", GenerationOptions(max_new_tokens=6))
    prompt = torch.tensor([[5, 17, 23, 4]])
    for name, model in models.items():
        assert texts[name] == " ".join(map(str, greedy_by_hand(model, prompt, 6))), name


def test_sampled_generation_is_seeded_and_leaves_the_global_generator_alone(tiny_llama):
    models = {"dense": tiny_llama}
    sampled = GenerationOptions(max_new_tokens=8, do_sample=True, seed=3, temperature=1.0, top_p=1.0)
    torch.manual_seed(123)
    first = generate(models, DigitTokenizer(), "5 17 23 4", sampled)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), after)  # generation forked the RNG instead of consuming it
    assert generate(models, DigitTokenizer(), "5 17 23 4", sampled) == first
    others = {generate(models, DigitTokenizer(), "5 17 23 4", replace(sampled, seed=s))["dense"] for s in (4, 5, 6)}
    assert others - {first["dense"]}  # the seed decides the sample
    with pytest.raises(GhostedError):
        generate(models, DigitTokenizer(), "   ")


def test_sampling_draws_from_its_own_generator_not_the_global_rng(tiny_llama):
    tokenizer, prompt = DigitTokenizer(), "5 17 23 4"
    models = {"dense": tiny_llama, "none": build_variant(tiny_llama, (2, 3))}
    sampled = GenerationOptions(max_new_tokens=8, do_sample=True, seed=3, temperature=2.0, top_p=1.0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = generate(models, tokenizer, prompt, sampled)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was neither used nor reseeded
    torch.manual_seed(999)  # another global state changes nothing
    assert generate(models, tokenizer, prompt, sampled) == first
    greedy = generate(models, tokenizer, prompt, replace(sampled, do_sample=False))
    assert first != greedy  # at temperature 2 on a random model, 16 draws all equal to the argmax is not credible
    # top_p = 0 keeps only the most likely token: sampling becomes greedy decoding
    assert generate(models, tokenizer, prompt, replace(sampled, top_p=0.0)) == greedy
    # two runs in threads at once draw exactly what they draw one after the other
    seeds = [3, 4, 3, 4]
    alone = [generate(models, tokenizer, prompt, replace(sampled, seed=s)) for s in seeds]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda s: generate(models, tokenizer, prompt, replace(sampled, seed=s)), seeds))
    assert together == alone and alone[0] != alone[1]


def test_a_stop_request_ends_perplexity_drift_and_generation_before_the_next_batch(tiny_llama):
    models = {"dense": tiny_llama, "none": build_variant(tiny_llama, (2, 3))}
    ids = random_tokens(8, 16)
    polls = []

    def stop_on_second_poll() -> bool:
        polls.append(1)
        return len(polls) >= 2

    with pytest.raises(RunStopped, match="perplexity"):
        perplexity(tiny_llama, models, ids, batch_size=2, should_stop=stop_on_second_poll)
    assert len(polls) == 2  # stopped before the first batch's second variant
    plan = PruningPlan(TINY_LAYERS, (2, 3), "manual")
    with pytest.raises(RunStopped, match="drift"):
        block_drift(tiny_llama, {"none": models["none"]}, plan, ids[:2], should_stop=lambda: True)
    with pytest.raises(RunStopped, match="generate"):
        generate(models, DigitTokenizer(), "5 17", should_stop=lambda: True)
    assert perplexity(tiny_llama, models, ids, should_stop=lambda: False) == perplexity(tiny_llama, models, ids)
