"""The KV cache and activation checkpointing across transformers versions, and the prompt cache that prefix
sharing keeps under gradient checkpointing.

Two transformers names changed inside the range pyproject allows (5.x): 5.23 renamed `gradient_checkpointing_enable`
to `activation_checkpointing_enable`, 5.24 the KV cache argument and output field `past_key_values` to `cache`. The
old names warn from then on (FutureWarning, removed in 6) and the lock's 5.19 has only them, so no name is in both:
`enable_activation_checkpointing`, `kv_cache` and `with_kv_cache` below branch on the version, and nothing else in
llm_pg names either spelling.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

_TRANSFORMERS = Version(transformers.__version__).release  # (5, 24, 0) for 5.24.0 and its dev and rc builds
CACHE_NAME = "cache" if _TRANSFORMERS >= (5, 24) else "past_key_values"  # the KV cache's kwarg and output field


def kv_cache(output: Any) -> Any:
    """The KV cache a forward with `use_cache=True` returned (None when the model keeps none)."""
    return getattr(output, CACHE_NAME, None)


def with_kv_cache(cache: Any) -> dict[str, Any]:
    """`{name: cache}` for a forward or `generate` call, under this transformers' name for the KV cache."""
    return {CACHE_NAME: cache}


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant torch checkpointing)."""
    if _TRANSFORMERS >= (5, 23):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether any submodule recomputes its activations in the backward pass: the flag transformers sets on each
    checkpointed layer (what `is_activation_checkpointing`, formerly `is_gradient_checkpointing`, reads), through a
    peft wrapper too; False for a model that has none."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _non_reentrant(module: torch.nn.Module) -> bool:
    """Whether the module's checkpoint function is torch's with `use_reentrant=False` (what transformers builds:
    `functools.partial(checkpoint, **kwargs)`); False when that cannot be told."""
    func = getattr(module, "_gradient_checkpointing_func", None)  # private: absent means unknown
    return isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is False


def cache_survives_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a forward that builds a graph can carry a KV cache through the model's checkpointed layers: each is a
    transformers `GradientCheckpointingLayer`, which keeps the cache when `_can_checkpoint_with_cache` is True
    (`cache_kept_under_checkpointing`), and checkpoints non-reentrantly, the variant whose backward reaches tensors
    that left a layer through the cache (the reentrant one runs the forward without a graph). The other flagged
    modules must be the transformers models themselves (their flag only turns `use_cache` off)."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    layers = [m for m in flagged if isinstance(m, GradientCheckpointingLayer)]
    return (
        bool(layers)
        # private (5.x): a transformers without it drops the cache under checkpointing, so sharing stays off there
        and hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
        and all(isinstance(m, GradientCheckpointingLayer | PreTrainedModel) for m in flagged)
        and all(_non_reentrant(m) for m in flagged)
    )


@contextmanager
def cache_kept_under_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's checkpointed layers pass a KV cache on instead of dropping it (an instance
    `_can_checkpoint_with_cache = True` over the class's False); afterwards, also after an exception, each layer
    reads its class value again. Only for caches that a recompute cannot corrupt (`PromptCache` and its `rows`)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]  # None: no instance value
    try:
        for layer in layers:
            layer._can_checkpoint_with_cache = True
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            if value is None:
                layer.__dict__.pop("_can_checkpoint_with_cache", None)
            else:
                layer._can_checkpoint_with_cache = value


class _RecordingLayer(DynamicLayer):
    """Keeps the keys and values of its first `update` `[u, h, P, d]`; a later call (the backward's recompute of a
    checkpointed layer) stores nothing. Every call returns its own keys and values, as a first update of an empty
    cache would, so the forward and its recompute run the same operations."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PromptRowsLayer(DynamicLayer):
    """Read-only prompt keys and values `[b, h, P, d]`: `update` returns `cat(prompt, new)` along the sequence and
    stores nothing, so `get_seq_length` and `get_mask_sizes` stay the prompt's in the forward and its recompute."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PromptCache(Cache):
    """The KV cache of a prompt pass under gradient checkpointing: each layer records its keys and values once."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=_RecordingLayer)

    def rows(self, index: Tensor) -> Cache:
        """A read-only cache of the recorded prompts copied to rows, `keys[index]` per layer (`index_select`, so
        the rows' gradients flow back into the one prompt pass)."""
        return Cache(
            layers=[
                _PromptRowsLayer(m.keys.index_select(0, index), m.values.index_select(0, index)) for m in self.layers
            ]
        )


def prompt_blocks(cache: Cache, copies: int) -> Cache:
    """A read-only cache whose keys and values are a prompt pass's `[u, h, P, d]` laid side by side along the sequence,
    `[copies, h, u * P, d]` per layer (the packed forward's prompt keys, `llm_pg.modules.packing`): a reshape and an
    expand, so the gradients of every copy flow back into the one prompt pass."""
    layers = []
    for layer in cache.layers:
        keys, values = (
            t.transpose(0, 1).reshape(1, t.shape[1], -1, t.shape[-1]).expand(copies, -1, -1, -1)
            for t in (layer.keys, layer.values)
        )
        layers.append(_PromptRowsLayer(keys, values))
    return Cache(layers=layers)
