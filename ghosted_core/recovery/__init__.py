"""Recovery: fit the operators at each boundary, turn them into modules, and measure them.

- `operators`: the operator registry and the fits (pure tensor maths on the statistics).
- `magcomp`: Prune&Comp's magnitude-compensation scalar from per-channel sums, and the view it compensates.
- `refit`: the down_proj refit (a change of block s−1's down_proj on its intermediate activations), its candidates.
- `linalg`: the linear algebra the fits share (the ridge solve and its conditioning test, sink directions, projected normal equations).
- `assessment`: boundary errors, anti-symmetric share and singular values of a fit (`FitReport`).
- `modules`: a fit as the `nn.Module`s a variant needs.
- `heldout`: held-out boundary errors, measured directly once the fits exist.
"""
