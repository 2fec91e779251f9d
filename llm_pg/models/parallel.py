"""FSDP2 for full fine-tuning: the strategy (`--trainer.strategy fsdp2`) and what sharded models need.

    llm-pg fit --config configs/math_hard/grpo_7b_fsdp.yaml      # trainer.strategy: fsdp2, 8 GPUs

`FSDP2` is Lightning's `ModelParallelStrategy` with every rank of every node in one data-parallel group and no
tensor parallelism. `PolicyGradientModule.configure_model` shards the policy and the frozen reference with
`shard_model` (one FSDP unit per decoder layer, then the root): each rank holds `1 / world_size` of the weights,
gradients and AdamW state, and still rolls out and trains on its own prompt groups, as under DDP. Every backward
reduce-scatters its gradient (the mean over ranks) into the rank's shard. Checkpoints are single files gathered on
rank zero by default (`save_distributed_checkpoint=False`), so the atomic hashed `last.ckpt` works as under DDP.

Every forward of a sharded model is collective: all ranks must run the same forwards. HF generate stops at a
rank's own EOS, a different step on every rank, so generation runs inside `unsharded`, which gathers the weights
once for the whole call (not once per token) and lets each rank decode alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


class FSDP2(ModelParallelStrategy):
    """`ModelParallelStrategy(data_parallel_size=world size, tensor_parallel_size=1)`: FSDP2 over every rank of
    every node (`trainer.num_nodes x trainer.devices`). Checkpoints are single files gathered on rank zero (atomic and
    hash-verified); Lightning's sharded folder checkpoints (`save_distributed_checkpoint=True`) are refused until
    that write handles folders."""

    def __init__(
        self,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if save_distributed_checkpoint:  # a folder per checkpoint: not yet atomic, hashed and verified
            raise ValueError(
                "trainer.strategy.save_distributed_checkpoint=true is not supported yet: llm_pg's checkpoints are "
                "single files written atomically and verified by hash; leave it false"
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        # Known only now; the parent's "auto" would be the node count (one data-parallel replica per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


# `--trainer.strategy fsdp2` beside Lightning's own names (`ddp`, ...): a class path given as a plain string is read
# as a name, so without this only `--trainer.strategy.class_path llm_pg.models.parallel.FSDP2` would select it.
StrategyRegistry.register(
    "fsdp2", FSDP2, description="FSDP2 over every rank (llm_pg.models.parallel.FSDP2)", override=True
)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` went through `shard_model` (FSDP2)."""
    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, mesh, compute_dtype: torch.dtype, frozen: bool = False) -> torch.nn.Module:
    """FSDP2 over `mesh` (1-D, the data-parallel ranks): one unit per decoder layer (the classes a transformers model
    lists in `_no_split_modules`), then the root, which holds the embeddings, the final norm and the LM head.

    `frozen`: a model that only runs no-grad forwards (the reference). Parameters keep their dtype (float32 master
    weights); with a bf16 compute dtype the all-gathers and the forward run in bf16 and gradients are reduced in
    float32 (`MixedPrecisionPolicy`), where one process computes under autocast.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    kwargs = {"mesh": mesh}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if frozen:  # it never runs a backward, which is when the root would otherwise free its gathered weights
        model.set_reshard_after_forward(True, recurse=False)
    return model


_unshard_depth: dict[int, int] = {}  # id(root) -> nesting depth of `unsharded` (the outermost one gathers)


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Gather a sharded model's full weights once on entry and free them on exit; nothing to do when not sharded.

    Inside, forwards make no collectives (each unit stays gathered after its forward), so a generation may take a
    different number of decoding steps on every rank. Nested uses gather once: an evaluation wrapped whole stays one
    gather whatever its batch count per rank. Every rank must enter together (the gather is collective).
    """
    if not is_sharded(model):
        yield
        return
    key = id(model)
    outermost = key not in _unshard_depth
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if outermost:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
    _unshard_depth[key] = _unshard_depth.get(key, 0) + 1
    try:
        yield
    finally:
        _unshard_depth[key] -= 1
        if outermost:
            del _unshard_depth[key]
            for unit in units:
                unit.reshard()
                # FSDP2's default back: layers reshard after forward; the root does not (training would gather it
                # again at once for the backward).
                unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's full state dict on rank zero's CPU (empty on the other ranks); collective: every rank must
    call it. An unsharded model's own state dict."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
