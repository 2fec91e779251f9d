"""Data parallelism for the manual update loop: DDP gradient averaging, and FSDP2 sharding of the policy and the
reference (`llm_pg.models.parallel`).

DDP: a training step runs many backward passes and optimizer steps inside one forward of the DDP-wrapped module.
DDP's reducer would all-reduce every backward's gradient, and Lightning turns it back on after every step
(`_DDPForwardRedirection.on_after_outer_forward`), so switching it off once does not hold: each backward runs
inside `backward_sync_off`, and `average_gradients` reduces the accumulated gradient once before the step.

FSDP2: the policy (and the frozen reference) are sharded per decoder layer (`shard_model`); every backward
reduce-scatters its gradient into the rank's shard (the mean over ranks), so there is nothing to average and the
clip sees DTensor gradients. Gradient sync is not skipped between accumulated micro-batches (`backward_sync_off`
does nothing there: Lightning's `block_backward_sync` acts on DDP modules only): skipping it would keep a full
unsharded float32 gradient on every rank (30 GB for a 7B model), the memory FSDP exists to save.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy

from llm_pg.engines import samples_sharded
from llm_pg.models.parallel import shard_model


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


def shard_for_strategy(
    strategy: object,
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    device_mesh,
    dtype: torch.dtype,
    lora_rank: int,
    rollout_engine: str,
) -> None:
    """Under `ModelParallelStrategy` (`llm_pg.models.parallel.FSDP2`): shard the policy and the frozen reference
    over the data-parallel ranks of `device_mesh`. Called at the end of `configure_model`; nothing to do under other
    strategies."""
    if not isinstance(strategy, ModelParallelStrategy):
        return
    if lora_rank > 0:
        raise ValueError(
            f"model.lora.r={lora_rank} with trainer.strategy {type(strategy).__name__}: FSDP2 here shards "
            "full fine-tuning only; set model.lora.r=0, or keep LoRA with --trainer.strategy ddp (the adapter is small)"
        )
    if not samples_sharded(rollout_engine):
        raise ValueError(
            f"model.rollout_engine={rollout_engine} with trainer.strategy {type(strategy).__name__}: a sharded policy "
            "samples with an engine that samples with the policy itself only; set rollout_engine: hf"
        )
    mesh = device_mesh["data_parallel"]
    if device_mesh["tensor_parallel"].size() != 1:
        raise ValueError(
            "trainer.strategy: tensor parallelism is not supported (tensor_parallel_size must be 1); "
            "use --trainer.strategy fsdp2"
        )
    shard_model(policy, mesh, dtype)
    if reference is not None:
        shard_model(reference, mesh, dtype, frozen=True)
