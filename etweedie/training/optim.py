"""The library's one optimizer loop and its learning-rate schedule.

Posterior training (:func:`etweedie.training.train`), score-matching training
(:func:`etweedie.training.scorematching.train_score_net`) and noise-parameter estimation
(:func:`etweedie.estimate.estimate_noise`) all step through :func:`optimize`: per step the
schedule's learning rate, the caller's loss (which computes its own gradient, so a sharded or
DDP step stays the caller's business), gradient clipping, the optimizer step, the weight average
and the progress bar.  What differs between them — checkpoints and deadlines, held-out model
selection, traces — is the ``after_step`` hook.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

__all__ = ["EMA", "optimize", "warmup_cosine"]


def warmup_cosine(step: int, total: int, lr: float, lr_min: float = 0.0, warmup: int = 0) -> float:
    """The learning rate before optimizer step ``step`` (0-based): a linear warm-up over
    ``warmup`` steps to ``lr``, then a cosine decay reaching ``lr_min`` at step ``total``
    (Loshchilov & Hutter, SGDR, arXiv 1608.03983, without restarts) and staying there."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * progress))


class EMA:
    """An exponential moving average of parameters, θ̄ ← a θ̄ + (1 − a) θ after each step.

    ``averaged`` holds θ̄ (tensors, or another model's parameters) and ``params`` θ, in the same
    order.  With ``warmup`` the decay after step t (1-based) is a_t = min(a, t / (t + 9)), so the
    random initial weights are forgotten at once instead of keeping weight a^t.
    """

    def __init__(self, averaged: Sequence[torch.Tensor], params: Sequence[torch.Tensor], decay: float,
                 warmup: bool = False):
        self.averaged, self.params = list(averaged), list(params)
        self.decay, self.warmup = float(decay), bool(warmup)

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, step / (step + 9)) if self.warmup else self.decay
        torch._foreach_lerp_(self.averaged, [p.detach() for p in self.params], 1.0 - decay)


def optimize(
    optimizer: torch.optim.Optimizer,
    loss_and_grad: Callable[[int], torch.Tensor],
    *,
    start: int,
    stop: int,
    lr_at: Callable[[int], float],
    grad_clip: float = 0.0,
    ema: Optional[EMA] = None,
    bar=None,
    after_step: Optional[Callable[[int, torch.Tensor], bool]] = None,
) -> int:
    """Run optimizer steps ``start, …, stop − 1``; returns the number of steps done.

    Each step sets ``lr_at(step)`` on every parameter group, clears the gradients, calls
    ``loss_and_grad(step)`` (it computes the loss, calls ``backward`` and returns the detached
    loss), clips the global gradient norm to ``grad_clip`` (0: no clipping), steps the optimizer,
    updates ``ema`` and advances ``bar``; then ``after_step(steps_done, loss)`` may log,
    checkpoint or evaluate, and stops the loop by returning True.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    step = start
    while step < stop:
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = loss_and_grad(step)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        step += 1
        if ema is not None:
            ema.update(step)
        if bar is not None:
            bar.update(1)
        if after_step is not None and after_step(step, loss):
            break
    return step
