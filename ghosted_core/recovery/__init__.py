"""Recovery: fit the operators at each boundary, turn them into modules, and measure them.

- `operators`: the operator registry and the fits (pure tensor maths on the statistics).
- `magcomp`: Prune&Comp's magnitude-compensation scalar from per-channel sums, and the view it compensates.
- `assessment`: boundary errors, anti-symmetric share and singular values of a fit (`FitReport`).
- `modules`: a fit as the `nn.Module`s a variant needs.
- `heldout`: held-out boundary errors, measured directly once the fits exist.
"""
