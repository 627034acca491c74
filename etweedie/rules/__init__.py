"""Fake (meta) and autograd rules of the compiled ops, one module per op stem.

Each op has two implementations of the same schema — the C++ op (``etweedie::<op>_fwd``,
registered by :mod:`etweedie.ops`) and the Triton op (``etweedie_triton::<op>_fwd``, defined
in :mod:`etweedie.kernels`) — and both take the same fake implementation (so they trace under
``torch.compile``) and the same autograd rule around their own fused backward kernel.  The rules
live here, below both layers, so that neither the ops nor the Triton kernels import the other.

    rules/common.py          canonical metric kinds, P·v per row, the first-order-only guard
    rules/pairwise.py        energy_score / energy_distance (shared pairwise schema)
    rules/<op>.py            et_score, langevin_step, student_t_score, energy_score's fused
                             value-and-gradient op
"""
