"""Our forward passes as an lm-eval model: lm-eval keeps its task configs, prompts and metrics.

`SharedPrefixLM` is lm-eval's own HFLM for one variant (so tokenization, BOS handling, truncation,
rolling windows and generation are HFLM's, unchanged), with the one method that runs the model,
`_loglikelihood_tokens`, answered by a `scoring.SharedScorer` shared by every variant of the run.
The first variant to ask computes every variant's answers in one pass (the dense prefix once,
each answer's context once, the head on continuation positions only); the others read them.
Registered with lm-eval as "ghosted-shared" (it needs in-memory models, so build it with
`SharedPrefixLM(scorer, name, tokenizer)`, not from a model string).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ghosted_core.evaluation.scoring import SharedScorer

log = logging.getLogger(__name__)


@register_model("ghosted-shared")
class SharedPrefixLM(HFLM):
    """HFLM for the variant `name` of `scorer`, whose log-likelihoods come from the shared scorer."""

    def __init__(self, scorer: SharedScorer, name: str, tokenizer, batch_size: int = 8, progress: bool = False):
        super().__init__(pretrained=scorer.variants[name], tokenizer=tokenizer, batch_size=batch_size)
        if scorer.options.max_length != self.max_length:  # HFLM's truncation rule, from the same config
            scorer.options = replace(scorer.options, max_length=self.max_length)
        self.scorer, self.variant, self.progress = scorer, name, progress

    def loglikelihood(self, requests, disable_tqdm: bool = False):  # noqa: ANN001
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):  # noqa: ANN001
        pairs = [(tuple(context), tuple(continuation)) for _, context, continuation in requests]
        self.scorer.quiet = disable_tqdm or not self.progress
        answers = self.scorer.answers(self.variant, pairs)
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:  # rolling windows come without their strings (HFLM caches those itself)
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers
