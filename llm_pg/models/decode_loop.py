"""The HF engine's decode loop: rows that have ended leave the batch.

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

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from llm_pg.models.cache import with_kv_cache
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
