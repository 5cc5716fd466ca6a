"""Distillation after the fit: LinearPatch's lightweight KD of any operator, and KD of weights a stock model has.

- `options`: `DistillOptions` (budget, schedule, top-K) and the names of distilled variants (`ghost+kd`, `none+kd_mlp`).
- `targets`: what trains (registry: the operator, block s−1's MLP or down_proj, norm gains, low-rank changes).
- `teacher`: the dense model's top-K targets on the calibration text, cached once for every student.
- `loss`: the KL on the teacher's top-K, the LM head in chunks.
- `train`: one student's AdamW loop with validation, early stop and the best state kept.
- `budget`: the byte formula of the distill phase (optimizer state, backward activations, teacher cache).
"""
