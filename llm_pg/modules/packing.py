"""Completion hidden states of a rollout without padding: the rows' real tokens concatenated into a few packed
sequences, each token attending only to its own row (a block-diagonal causal mask).

A micro-batch of rows `[prompt (left-padded to P) | completion (right-padded to C)]` wastes every position of a
completion shorter than the longest, and the head scores them too. On the Qwen math rehearsal (64 rows, completions
of 14 tokens on average, the longest 60-72) four positions in five of a micro-batch's completion forward were padding.
Packed, the forward touches only tokens that are context or score something:

- with prefix sharing (`shared`: each distinct prompt once, `logprobs.distinct_prompts`) the prompts run as today
  (one row each, their keys and values kept), and every row's completion tokens but its last are concatenated;
  a token attends to its own prompt's real tokens (the prompts' keys laid side by side, `models.cache.prompt_blocks`)
  and to its own row's earlier tokens. Position c of a row's completion is scored by its prompt's last hidden state
  (c = 0) or by the packed hidden state of token c-1;
- without it, every row's real tokens but its last are concatenated, prompt included.

Position ids stay `cumsum(attention_mask) - 1` of each row, so every token sees what it sees in the padded forward:
the same hidden states to float rounding (tests/test_packing.py on random Llama and Qwen2 models,
tests/test_real_model.py on SmolLM2 and the Qwen). Rows are packed in order into sequences of at most `PACK_TOKENS`
tokens (a longer row gets one of its own), so the attention's cost, quadratic in a sequence's length, stays a small
part of the forward's. A padding slot at a sequence's end attends to itself only: no query row is fully masked, so
no NaN enters the backward through `0 * NaN`.

The mask is built for the model's attention: boolean for SDPA, additive float for the eager one (`MASKS`); other
attention implementations (flash, flex) keep the padded forward, and so does a forward whose padding is less than
`MIN_PADDING` of its positions (`LogProbs.packs`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from llm_pg.core.rollout import RolloutBatch
from llm_pg.models.cache import (
    PromptCache,
    activation_checkpointing,
    cache_kept_under_checkpointing,
    kv_cache,
    prompt_blocks,
    with_kv_cache,
)

PACK_TOKENS = 1024  # tokens per packed sequence: attention over 1024 positions is ~10 % of a 0.5B layer's matmuls
MIN_PADDING = 0.2  # pack a forward when at least this share of its padded positions is padding
MASKS: dict[str, Callable[[Tensor, torch.dtype], Tensor]] = {
    "sdpa": lambda allowed, dtype: allowed,
    "eager": lambda allowed, dtype: torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    ),
}


@dataclass(frozen=True)
class PackedRows:
    """The kept tokens of a rollout's rows laid into `k` packed sequences of width `S`; padding slots have owner -1.

    `row` and `column` name each kept token's place in the rollout's `[N, P+C]` layout (in packed order: sequence by
    sequence, row by row, column by column); `slot` is its flat index into `[k * S]`."""

    ids: Tensor  # [k, S] long
    positions: Tensor  # [k, S] long, the token's position among its row's real tokens
    owner: Tensor  # [k, S] long, the token's rollout row, -1 on padding
    row: Tensor  # [n] long
    column: Tensor  # [n] long
    slot: Tensor  # [n] long


def kept_tokens(attention_mask: Tensor, start: int) -> Tensor:
    """`[N, L]` bool: the real tokens from column `start` on, each row's last real token left out (it scores nothing
    and no later token of its row attends to it)."""
    real = attention_mask.bool()
    keep = torch.zeros_like(real)
    keep[:, start:-1] = real[:, start:-1] & real[:, start + 1 :]
    return keep


def pack_rows(input_ids: Tensor, attention_mask: Tensor, keep: Tensor, budget: int = PACK_TOKENS) -> PackedRows:
    """Rows' `keep` tokens `[N, L]` packed in row order into sequences of at most `budget` tokens (a row longer than
    the budget alone in one), with their positions `cumsum(attention_mask) - 1`."""
    counts = keep.sum(1).tolist()
    sequences: list[list[int]] = [[]]
    filled = 0
    for index, count in enumerate(counts):
        if count == 0:
            continue
        if sequences[-1] and filled + count > budget:
            sequences.append([])
            filled = 0
        sequences[-1].append(index)
        filled += count
    width = max([sum(counts[i] for i in rows) for rows in sequences] + [1])  # S
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, L]
    device = input_ids.device
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    pos = torch.zeros_like(ids)
    owner = torch.full_like(ids, -1)
    rows, columns, slots = [], [], []
    for number, members in enumerate(sequences):
        members_t = torch.tensor(members, dtype=torch.long, device=device)
        local, column = keep[members_t].nonzero(as_tuple=True)  # row-major: each row's tokens in column order
        row = members_t[local]
        here = torch.arange(len(row), device=device)
        ids[number, here] = input_ids[row, column]
        pos[number, here] = positions[row, column]
        owner[number, here] = row
        rows.append(row)
        columns.append(column)
        slots.append(number * width + here)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return PackedRows(ids, pos, owner, torch.cat(rows or [empty]), torch.cat(columns or [empty]),
                      torch.cat(slots or [empty]))  # fmt: skip


def packed_mask(packed: PackedRows, prompts: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`[k, 1, S, K]` bool, True where a query may attend: its own row's earlier tokens (and itself; a padding slot
    only itself), and with `prompts` = `(inverse [N], prompt_mask [u, P])` first the `u * P` prompt keys laid side
    by side, of which a token sees its own prompt's real ones (`K = u * P + S`, else `K = S`)."""
    owner = packed.owner  # [k, S]
    width = owner.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=owner.device).tril()
    same = owner[:, :, None] == owner[:, None, :]  # [k, S, S]
    diagonal = torch.eye(width, dtype=torch.bool, device=owner.device)
    allowed = (same & causal & (owner[:, :, None] >= 0)) | diagonal
    if prompts is not None:
        inverse, prompt_mask = prompts
        unique, length = prompt_mask.shape
        block = inverse[owner.clamp(min=0)]  # [k, S] the prompt each token's row answers
        key_block = torch.arange(unique, device=owner.device).repeat_interleave(length)  # [u * P]
        sees = (block[:, :, None] == key_block) & prompt_mask.reshape(-1).bool() & (owner[:, :, None] >= 0)
        allowed = torch.cat([sees, allowed], dim=-1)
    return allowed[:, None]


def packed_completion_hidden(
    decoder: torch.nn.Module, rollout: RolloutBatch, shared: tuple[Tensor, Tensor] | None, budget: int = PACK_TOKENS
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Final hidden states `[n, H]` of the positions that score a real completion token, with that token's row `[n]`
    and completion column `[n]`: `decoder` (a causal LM's decoder stack, final norm included) over the packed rows.

    `shared` = `(first, inverse)` from `logprobs.distinct_prompts` runs each distinct prompt once and packs only the
    completions (None when the model keeps no cache of the prompts); without it every row is packed whole."""
    mask = rollout.attention_mask  # [N, P+C]
    prompt = rollout.prompt_len  # P
    dtype = torch.get_autocast_dtype(mask.device.type) if torch.is_autocast_enabled(mask.device.type) else None
    make_mask = MASKS[decoder.config._attn_implementation]
    checkpointed = decoder.training and activation_checkpointing(decoder)
    heads: list[Tensor] = []
    rows: list[Tensor] = []
    columns: list[Tensor] = []
    cache_kwargs: dict = {}
    prompts = None
    with cache_kept_under_checkpointing(decoder) if checkpointed and shared is not None else nullcontext():
        if shared is not None:
            first, inverse = shared
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            recorded = PromptCache() if checkpointed else None
            start_kwargs = {"use_cache": False, **with_kv_cache(recorded)} if checkpointed else {"use_cache": True}
            out = decoder(
                input_ids=rollout.input_ids[first, :prompt],
                attention_mask=mask[first, :prompt],
                position_ids=positions[first, :prompt],
                **start_kwargs,
            )
            cache = recorded if checkpointed else kv_cache(out)
            if cache is None or len(cache.layers) == 0:  # a model that keeps no cache: the caller runs unshared
                return None
            scores_first = mask[:, prompt].bool()  # [N]: completion token 0 is real
            heads.append(out.last_hidden_state[inverse[scores_first], -1])  # [b0, H]
            rows.append(scores_first.nonzero().squeeze(1))
            columns.append(torch.zeros_like(rows[-1]))
            prompts = (inverse, mask[first, :prompt])
        packed = pack_rows(rollout.input_ids, mask, kept_tokens(mask, prompt if shared is not None else 0), budget)
        allowed = packed_mask(packed, prompts)
        if shared is not None:
            cache_kwargs = {
                "use_cache": not checkpointed,
                **with_kv_cache(prompt_blocks(cache, len(packed.ids))),
            }
        tail = decoder(
            input_ids=packed.ids,
            attention_mask=make_mask(allowed, dtype or torch.float32),
            position_ids=packed.positions,
            **cache_kwargs,
        ).last_hidden_state  # [k, S, H]
    scoring = packed.column >= prompt - 1  # a prompt token scores nothing but the prompt's last
    flat = tail.reshape(-1, tail.shape[-1])
    heads.append(flat[packed.slot[scoring]])
    rows.append(packed.row[scoring])
    columns.append(packed.column[scoring] - prompt + 1)
    return torch.cat(heads), torch.cat(rows), torch.cat(columns)
