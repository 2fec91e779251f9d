"""HF sampling's decode loop, its KV cache and its decode steps: `decode` samples token by token with the rows that
have ended leaving the batch, `ReservedLayer` writes each decoded position in place (`reserved_cache` gives `generate`
a cache of them), and `compiled_forward` runs the decode steps through `torch.compile` (`speed.compile_generation`).
`llm_pg.models.generation.generate` uses all three.

The decode loop (`decode`), where rows that have ended leave the batch:
HF `generate` runs every row of a batch until the longest one ends, feeding pad tokens to the rows that have
finished. A rollout's completions differ widely in length (on the Qwen math rehearsal the mean row is a fifth of the
longest), and a decode step's cost grows with its rows (Qwen2.5-0.5B in bf16 on 2 CPU threads: 817 ms at 64 rows,
233 at 16, 85 at 1), so most of that rollout was spent on rows whose completion was already over. `decode` drops
them: once an eighth of the batch has ended, the KV cache, the attention mask and the next tokens keep only the rows
still running (`Cache.batch_select_indices`; `ReservedLayer` selects its buffers in place).

The tokens are chosen as HF `generate` chooses them, so a seed keeps its meaning:
- the logits of the last position in float32; EOS blocked before `min_new_tokens` (`-inf`), the head's rows past
  the tokenizer never drawn (`-inf`); then the argmax (`greedy`), the nucleus draw (`top_p < 1`,
  `llm_pg.models.sampling.nucleus`) or `torch.multinomial` over `softmax(logits / temperature)`;
- each random draw is made over the whole batch's `[N, ...]` shape, ended rows included (they get a one-hot row):
  torch's draw for a row depends on the tensor's shape, not on the other rows' values, so a running row draws
  what it would draw in HF's loop, which still carries the ended rows.
A running row's logits come from a forward over fewer rows than HF's; they are the same up to float rounding of the
matmuls (bitwise the same on the CPUs tried: tests/test_decode_loop.py), so the tokens equal HF `generate`'s. One
exception: the nucleus widens its candidate list for the rows that need it, and HF's loop would also widen it for an
ended row whose pad-token distribution is flat; the draw's shape then differs.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from llm_pg.models.cache import CACHE_NAME, with_kv_cache
from llm_pg.models.sampling import nucleus

if TYPE_CHECKING:  # generation imports this module
    from llm_pg.models.generation import Sampling

COMPACT_FRACTION = 8  # drop ended rows once at least 1/8 of the batch has ended: a copy of the cache per 1/8


def decode(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cache: Cache,
    sampling: Sampling,
    eos: list[int],
    pad: int,
    unused: list[int],
) -> Tensor:
    """`[N, C]` ids sampled after left-padded `prompt_ids` `[N, P]` (mask `prompt_mask`), as `sampling` says: each
    row up to and including its first id in `eos`, then `pad`; C is the longest row's length (at most
    `sampling.max_new_tokens`). `cache` holds the KV of a first part of the prompt (`prompt_cache`) or nothing; it
    is filled and cut down in place. Random draws come from torch's current stream."""
    rows, device = prompt_ids.shape[0], prompt_ids.device
    out = torch.full((rows, sampling.max_new_tokens), pad, dtype=torch.long, device=device)  # [N, C]
    eos_ids = torch.tensor(eos, device=device)
    batch = torch.arange(rows, device=device)  # [b]: the output row of each batch row
    running = torch.ones(rows, dtype=torch.bool, device=device)  # [b]
    compactable = all(hasattr(layer, "batch_select_indices") for layer in getattr(cache, "layers", [None]))
    seen = cache.get_seq_length()
    mask = prompt_mask  # [b, P + t]
    ids = prompt_ids[:, seen:]  # the prompt positions not in the cache yet
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, seen:]  # as generate numbers them
    steps = 0
    for step in range(sampling.max_new_tokens):
        logits = (
            model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **with_kv_cache(cache),
            )
            .logits[:, -1]
            .float()
        )  # [b, V]
        tokens = choose(logits[running], step, sampling, eos, unused, batch[running], rows)  # [r]
        out[batch[running], step] = tokens
        steps = step + 1
        nxt = torch.full_like(batch, pad)
        nxt[running] = tokens
        running[running.nonzero().squeeze(1)[torch.isin(tokens, eos_ids)]] = False
        if not bool(running.any()):
            break
        ended = len(batch) - int(running.sum())
        keep = kept_rows(running) if compactable and ended * COMPACT_FRACTION >= len(batch) else None
        if keep is not None and len(keep) < len(batch):
            cache.batch_select_indices(keep)
            batch, mask, nxt, running = batch[keep], mask[keep], nxt[keep], running[keep]
        mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
        ids = nxt[:, None]  # [b, 1]
        positions = mask.sum(-1, keepdim=True) - 1  # the new token's position among the row's real tokens
    return out[:, :steps]


def kept_rows(running: Tensor) -> Tensor:
    """The batch rows `[k]` a compaction keeps: the running ones, and one ended row beside a last running row (a
    compiled decode step specialises a batch of one row, and would compile again for it)."""
    keep = running.nonzero().squeeze(1)
    if len(keep) == 1 and len(running) > 1:
        keep = torch.cat([keep, (~running).nonzero()[:1, 0]]).sort().values
    return keep


def choose(
    logits: Tensor, step: int, sampling: Sampling, eos: list[int], unused: list[int], who: Tensor, rows: int
) -> Tensor:
    """The next id `[r]` of each running row from its float32 logits `[r, V]` (changed in place) at decode step
    `step`; `who` `[r]` are the rows' places in a batch of `rows`, the shape every random draw is made over."""
    if step < sampling.min_new_tokens:
        logits[:, eos] = float("-inf")
    if unused:
        logits[:, unused] = float("-inf")
    if sampling.greedy:
        return logits.argmax(-1)
    if sampling.top_p < 1.0:
        probs = torch.softmax(logits / sampling.temperature, dim=-1)  # [r, V]
        weights, index = nucleus(probs, sampling.top_p)  # [r, k]
        choice = torch.multinomial(batch_rows(weights, who, rows), 1)[who]  # [r, 1]
        return index.gather(1, choice).squeeze(1)
    if sampling.temperature != 1.0:  # HF's temperature warper is skipped at 1
        logits = logits / sampling.temperature
    probs = torch.softmax(logits, dim=-1)  # [r, V]
    return torch.multinomial(batch_rows(probs, who, rows), 1)[who].squeeze(1)


def batch_rows(weights: Tensor, who: Tensor, rows: int) -> Tensor:
    """`[rows, K]` sampling weights: `weights` `[r, K]` at rows `who`, a one-hot row elsewhere (an ended row)."""
    full = weights.new_zeros(rows, weights.shape[1])
    full[:, 0] = 1.0
    full[who] = weights
    return full


_COMPILED: dict[type, Callable] = {}  # one compiled forward per model class; its graphs serve every instance
_FAILED: set[type] = set()  # classes whose compile failed: they decode eagerly from then on


def compiled_forward(model: torch.nn.Module, enabled: bool = True):
    """A context in which `generate`'s decode steps on `model` (under a peft wrapper, on the wrapped causal LM, whose
    forward `generate`'s loop calls) run through `torch.compile(dynamic=True)`; outside it the model is untouched,
    so training forwards stay eager.

    The first forward of each `generate` call (the prefill) runs eagerly, and so does any call that builds a graph
    or whose cache is not all `ReservedLayer`s with room for its tokens (`ReservedLayer.has_room`): a compiled step
    only writes into buffers allocated outside it. The decode steps of every call then share one graph across batch
    sizes, prompt widths and cache lengths (dynamic shapes, without duck sizing, which would tie a batch size to an
    equal model dimension). The first step compiles (10-30 s on the CPU for the tiny model); weights updated in place
    are read at every call, so nothing recompiles when the optimizer steps. Fused kernels round differently from
    eager ones: the logits agree to float rounding, not bit for bit (tests/test_compiled_generation.py). Should the
    compile fail, a warning names the error and the class decodes eagerly for the rest of the process. A model whose
    forward is already replaced on the instance (a hook library's wrapper) is left as it is, eager."""
    if not enabled:
        return nullcontext()
    return _compiled_forward(model)


@contextmanager
def _compiled_forward(model: torch.nn.Module) -> Iterator[None]:
    from peft import PeftModel  # imported where LoRA is used, as llm_pg.models does

    target = model.get_base_model() if isinstance(model, PeftModel) else model
    if "forward" in vars(target):  # someone else's wrapper: replacing it, then deleting ours, would lose it
        yield
        return
    cls = type(target)
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.forward, dynamic=True)
    target.forward = _DecodeSteps(target)  # an instance attribute: `nn.Module.__call__` finds it before the class's
    try:
        yield
    finally:
        del target.forward  # the class's eager forward again


class _DecodeSteps:
    """The forward `generate` calls inside `compiled_forward`: the prefill eagerly, decode steps compiled."""

    def __init__(self, target: torch.nn.Module) -> None:
        self.target, self.calls = target, 0
        # `generate` reads the forward's parameters to decide what to pass (position_ids among them): keep them.
        self.__signature__ = inspect.signature(type(target).forward.__get__(target))

    def __call__(self, *args, **kwargs):
        self.calls += 1
        cls = type(self.target)
        if self.calls > 1 and cls not in _FAILED and _writes_in_place(kwargs):
            try:
                # No duck sizing: it would tie a batch size to an equal model dimension (and recompile at the next).
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return _COMPILED[cls](self.target, *args, **kwargs)
            except Exception as error:  # a compiler failure: the eager call below is the same step
                _FAILED.add(cls)
                lines = [line for line in str(error).splitlines() if line.strip() and "TORCHDYNAMO" not in line]
                message = lines[-1].strip() if lines else type(error).__name__
                warnings.warn(
                    f"speed.compile_generation: torch.compile failed on {cls.__name__} ({message}); decoding eagerly "
                    "from here on (set speed.compile_generation: false to skip the attempt)",
                    stacklevel=2,
                )
        return cls.forward(self.target, *args, **kwargs)


def _writes_in_place(kwargs: dict) -> bool:
    """Whether a forward builds no graph and every layer of its cache has room for its tokens."""
    cache, ids = kwargs.get(CACHE_NAME), kwargs.get("input_ids")
    layers = getattr(cache, "layers", None)
    if ids is None or torch.is_grad_enabled() or not layers:
        return False
    return all(isinstance(layer, ReservedLayer) and layer.has_room(ids.shape[1]) for layer in layers)


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers with room for `reserve` more positions.

    `DynamicLayer.update` concatenates, so decoding T tokens copies the whole cache T times (O(T^2) memory traffic:
    at 64 rows x 128 tokens on the tiny model that copy was ~60 % of a decode step on the CPU). Here an update
    writes the new positions into the buffers in place, and `keys`/`values` are the buffers' first `held`
    positions: the same keys and values, the same shapes, so attention computes what it computed before. When the
    buffers are full, or something assigns `keys`/`values` (a crop, a batch reorder), the layer leaves its buffers
    (`_release`) and the next update copies the current contents into new ones.

    The buffers and the count `held` are the whole state while they are in use: a compiled decode step
    (`compiled_forward`) sees two tensors it writes into and an integer, never a view beside the tensor it views.
    """

    def __init__(self, reserve: int) -> None:
        self._buffers: tuple[Tensor, Tensor] | None = None  # [B, H, capacity, D] keys and values
        self._held = 0  # positions of the buffers in use
        self._keys: Tensor | None = None  # keys and values while no buffers are in use
        self._values: Tensor | None = None
        super().__init__()
        self.reserve = reserve

    @property
    def keys(self) -> Tensor | None:
        return self._keys if self._buffers is None else self._buffers[0][..., : self._held, :]

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self._release()
        self._keys = value

    @property
    def values(self) -> Tensor | None:
        return self._values if self._buffers is None else self._buffers[1][..., : self._held, :]

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self._release()
        self._values = value

    def _release(self) -> None:
        """Stop using the buffers; keys and values become the views of their used positions (for `DynamicLayer`'s
        methods, which replace one and then the other)."""
        if self._buffers is not None:
            self._keys, self._values = (buffer[..., : self._held, :] for buffer in self._buffers)
            self._buffers = None

    def get_seq_length(self) -> int:
        return self._held if self._buffers is not None else super().get_seq_length()

    def has_room(self, new: int) -> bool:
        """Whether an update of `new` positions writes into the buffers in use, leaving a position free after them
        (so a view of the used positions is never the whole buffer: one graph serves every step of a decode)."""
        return self._buffers is not None and self._held + new < self._buffers[0].shape[-2]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not self.has_room(new):
            held = self.get_seq_length()
            buffers = self._reallocate(held, new, key_states, value_states)
            self._buffers, self._held, self._keys, self._values = buffers, held, None, None
        held = self._held
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[..., held : held + new, :].copy_(states)
        self._held = held + new
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep the batch rows `indices` `[b]` (`llm_pg.models.decoding.decode` dropping ended rows): the buffers are
        selected, with their room, instead of leaving them as `DynamicLayer`'s assignment would."""
        if self._buffers is None:
            super().batch_select_indices(indices)
        else:
            keys, values = (buffer.index_select(0, indices) for buffer in self._buffers)
            self._buffers = (keys, values)

    def _reallocate(self, held: int, new: int, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        capacity = held + new + max(self.reserve, held) + 1  # + 1: `has_room` keeps one position free
        fresh = []
        for old, states in ((self.keys, key_states), (self.values, value_states)):
            shape = (*states.shape[:-2], capacity, states.shape[-1])
            buffer = states.new_empty(shape)
            if held:
                buffer[..., :held, :].copy_(old)
            fresh.append(buffer)
        return fresh[0], fresh[1]


def reserved_cache(model: PreTrainedModel, cache: DynamicCache | None, max_new_tokens: int) -> DynamicCache | None:
    """`cache` (a new empty one when None) with each plain `DynamicLayer` replaced by a `ReservedLayer` holding the
    same keys and values and room for `max_new_tokens` more positions; sliding-window and other layer kinds are kept.
    None where `generate` must build its own cache (the generation config names a cache implementation) or the
    model's config gives no cache layout."""
    if cache is None:
        if getattr(model.generation_config, "cache_implementation", None) is not None:
            return None
        try:
            cache = DynamicCache(config=model.config)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            reserved = ReservedLayer(max_new_tokens)
            if layer.is_initialized and layer.get_seq_length() > 0:
                reserved.update(layer.keys, layer.values)
            layers[index] = reserved
    return cache
