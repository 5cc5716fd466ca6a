"""Greedy or seeded-sampling generation from every variant with the KV cache, the same prompt for all."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from ghosted_core.progress import track
from ghosted_core.errors import GhostedError
from ghosted_core.stopping import StopCheck, check_stop
from ghosted_core.evaluation.perplexity import input_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationOptions:
    """Same prompt and seed for every variant."""

    max_new_tokens: int = 40
    do_sample: bool = False  # greedy by default; sampling is seeded per variant
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GhostedError(f"--max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if not (math.isfinite(self.temperature) and self.temperature > 0 and 0 <= self.top_p <= 1):
            raise GhostedError(f"sampling needs a temperature above 0 and 0 ≤ top_p ≤ 1 (got {self.temperature}, "
                               f"{self.top_p})")


class SeededSampling(LogitsProcessor):
    """Temperature and nucleus (top-p) sampling that draws from its own `torch.Generator`.

    The drawn token keeps score 0 and every other token gets −inf, so greedy decoding emits
    it. Runs in other threads neither change nor depend on what this one draws, as they
    would through the global RNG that `generate(do_sample=True)` uses.
    """

    def __init__(self, temperature: float, top_p: float, seed: int):
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.generator: torch.Generator | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generator is None:  # created on the logits' device at the first step
            self.generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        probs = torch.softmax(scores.float() / max(self.temperature, 1e-6), dim=-1)  # (B, V)
        ordered, order = probs.sort(dim=-1, descending=True)  # (B, V)
        ordered[(ordered.cumsum(-1) - ordered) > self.top_p] = 0.0  # the most likely token always stays
        drawn = order.gather(-1, torch.multinomial(ordered, 1, generator=self.generator))  # (B, 1)
        return torch.full_like(scores, -math.inf).scatter_(-1, drawn, 0.0)


def generate(variants: Mapping[str, PreTrainedModel], tokenizer, prompt: str,
             options: GenerationOptions = GenerationOptions(), should_stop: StopCheck = None) -> dict[str, str]:
    """Continuation of `prompt` by every variant (KV cache on), decoded without the prompt.

    Greedy, or sampled from a generator seeded per variant (never the global RNG).
    `should_stop` is polled before each variant.
    """
    if not prompt.strip():
        raise GhostedError("the prompt is empty; type some text to continue")
    encoded = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts = {}
    for name, model in track(variants.items(), "generate", unit="variants"):
        check_stop(should_stop, "generate")
        device = input_device(model)
        kwargs = dict(max_new_tokens=options.max_new_tokens, do_sample=False, pad_token_id=pad, temperature=None,
                      top_p=None, top_k=None)
        if options.do_sample:
            kwargs["logits_processor"] = LogitsProcessorList(
                [SeededSampling(options.temperature, options.top_p, options.seed)])
        with torch.no_grad():
            out = model.generate(input_ids=encoded.input_ids.to(device),
                                 attention_mask=encoded.attention_mask.to(device), **kwargs)
        texts[name] = tokenizer.decode(out[0, encoded.input_ids.shape[1]:], skip_special_tokens=True)
    return texts
