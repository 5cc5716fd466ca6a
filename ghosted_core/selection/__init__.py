"""Which blocks to remove: criteria registered by name, the passes that score them, and the entry points.

- `criteria`: the registry (`register_criterion`, `Scoring`, `SelectionRequest`) and the simple criteria:
  streamline, shortgpt, angular, manual, none.
- `similarity`: the shared similarity pass (run and block cosines, the (L+1)×(L+1) layer-similarity map).
- `suffixes`: run many candidate models from cached residual states, batched slot by slot; the work counter.
- `next_token`: candidates' summed NLL, its vocabulary-subset lower bound, and KL to the dense model.
- `sleb`: SLEB's greedy NLL rounds, exact with shared prefixes and bound-screened heads.
- `kl`: output-grounded removal of a run by KL to the dense next-token distribution.
- `swap`: No Free Swap's replacement and interchange probes, and the removals they guide (swap_kl, swap_kl_repl).
- `weights`: forward-free selection from the weights (ours, inspired by WRP's abstract).
- `prunecomp`: Prune&Comp's iterative Block Influence on the magnitude-compensated model.
- `footprint`: what a criterion's scoring holds at its peak (the terms each criterion's memory declaration adds up).
- `choose`: select_blocks (a run), select_blocks_depths (a sweep), score_criteria (a comparison).

Importing the package registers every criterion (the modules below register themselves).
"""

from ghosted_core.selection import kl, prunecomp, sleb, swap, weights  # noqa: F401  (registration)
