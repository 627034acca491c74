"""What the pairwise energy ops (energy_score, energy_distance) share: their registration."""

from __future__ import annotations

import torch

from ..rules import pairwise


def register_pairwise_op(name: str, bwd_op) -> None:
    """Fake and autograd rules of a pairwise energy op ``etweedie::<name>_fwd``.

    energy_score and energy_distance share the schema shape
    ``fwd(X, Y, beta, prec, kind, flag) -> (B,)`` and
    ``bwd(grad, X, Y, beta, prec, kind, flag, need_X, need_Y, need_beta, need_prec) -> 4 grads``
    (an unrequested gradient is an empty tensor), so one definition serves both.
    """
    lib = f"etweedie::{name}"
    torch.library.register_fake(lib + "_fwd")(pairwise.fake_fwd)
    torch.library.register_fake(lib + "_bwd")(pairwise.fake_bwd)
    setup_context, backward = pairwise.autograd_rules(bwd_op)
    torch.library.register_autograd(lib + "_fwd", backward, setup_context=setup_context)
