"""Gradient averaging across DDP ranks for the manual update loop: one all-reduce per optimizer step.

A training step runs many backward passes and optimizer steps inside one forward of the DDP-wrapped module.
DDP's reducer would all-reduce every backward's gradient, and Lightning turns it back on after every step
(`_DDPForwardRedirection.on_after_outer_forward`), so switching it off once does not hold: each backward runs
inside `backward_sync_off`, and `average_gradients` reduces the accumulated gradient once before the step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy


def backward_sync_off(trainer: L.Trainer) -> AbstractContextManager:
    """DDP's reducer off for the backward passes run inside (nothing to do without DDP)."""
    strategy = trainer.strategy
    return strategy.block_backward_sync() if isinstance(strategy, ParallelStrategy) else nullcontext()


def average_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Replace each `p.grad` by its mean over ranks, all-reduced in one flat buffer (a missing grad counts as 0)."""
    if world_size == 1 or not torch.distributed.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()
