"""Reports: tables, charts and the sweep page from a run's JSON, without gradio (used by the CLI and the app).

- `tables`: perplexity, task and generation tables, colours and captions.
- `charts`: plotly figures of a run (scores, boundary errors, drift, structure, tasks).
- `summary`: the answer first: the best variant (or criterion and operator), by how much, and what it buys.
- `sweep`: a depth sweep's curve, damage-recovered chart and table; `sweep.html` for the CLI.
- `compare`: a criteria comparison: the layer-similarity map, each criterion's scores, the criteria × operators table; `compare.html`.
- `tradeoff`: what pruning buys: perplexity against measured speed and size, one point per variant and depth, the Pareto front.
"""
