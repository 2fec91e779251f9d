"""Completion logits of a rollout under a model, with each distinct prompt run once (prompt-prefix sharing).

A rollout holds `G` completions per prompt, and every row is `[prompt | completion]`. A plain forward runs each
prompt's tokens `G` times. With prefix sharing the distinct prompts of a batch run once, their keys and values
are copied to every row that shares them (`Cache.reorder_cache`, an `index_select`: gradients flow back through
it into the one prompt pass), and the completions run on top of that cache. The logits are the plain forward's up
to float rounding (within 1e-4 on float32 logits: tests/test_prefix_sharing.py), and so are the gradients; the
saving is the prompt tokens of the duplicate rows: `(b - u) * P` of `b * (P + C)` token positions for `b` rows
over `u` distinct prompts.

It is used when it is exact and pays off (`shares_prefix`): at least two rows per distinct prompt on average, a
model that is not sharded (FSDP2 would gather the weights twice), and, in a forward that builds a graph, no
gradient checkpointing (transformers then drops the cache) and no dropout (the duplicate rows would share one
dropout mask on their prompt, which changes the estimator's noise; `share_prompt_dropout: true` accepts that: one
mask per prompt changes the gradient's variance, not its expectation). `model.init_args.share_prompt_prefix: false`
turns it off.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from llm_pg.chunked_logprobs import chunked_target_logprobs
from llm_pg.losses import target_logprobs, token_entropy
from llm_pg.models import activation_checkpointing, kv_cache, with_kv_cache
from llm_pg.rollout import RolloutBatch
from llm_pg.strategies import is_sharded


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward in train mode is random: a Dropout module (LoRA's among them) or a config dropout > 0."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if config is not None else {}
    return any(
        ("dropout" in key or "pdrop" in key) and isinstance(value, int | float) and value > 0
        for key, value in settings.items()
    )


def distinct_prompts(rollout: RolloutBatch) -> tuple[Tensor, Tensor]:
    """`(first, inverse)`: one row index per distinct prompt `[u]` (ids and padding both equal), and each row's
    prompt number `[b]`, so `first[inverse]` maps every row to a row with the same prompt."""
    prompt = rollout.input_ids.shape[1] - rollout.completion_mask.shape[1]
    key = torch.cat([rollout.input_ids[:, :prompt], rollout.attention_mask[:, :prompt]], dim=1)  # [b, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.empty(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.long, device=inverse.device)
    first[inverse] = torch.arange(len(inverse), device=inverse.device)  # any row of each prompt will do
    return first, inverse


def shares_prefix(
    model: torch.nn.Module, rollout: RolloutBatch, enabled: bool, shared_dropout: bool = False
) -> tuple[Tensor, Tensor] | None:
    """`distinct_prompts(rollout)` when prefix sharing is on, exact and worth a second forward call, else None.
    `shared_dropout` (`share_prompt_dropout`) accepts, in a training forward, one dropout mask per prompt."""
    if not enabled or len(rollout) < 2 or is_sharded(model):
        return None
    builds_graph = torch.is_grad_enabled() and model.training
    if builds_graph and (activation_checkpointing(model) or (has_dropout(model) and not shared_dropout)):
        return None
    first, inverse = distinct_prompts(rollout)
    return (first, inverse) if 2 * len(first) <= len(rollout) else None


def completion_logits(
    model: torch.nn.Module, rollout: RolloutBatch, share_prefix: bool = True, shared_dropout: bool = False
) -> Tensor:
    """Logits `[b, C, V]` whose position c scores completion token c (sequence positions `P-1 .. P+C-2`).

    Positions number real tokens only (`cumsum(attention_mask) - 1`, as `generate` numbers left-padded prompts),
    so a left-padded row scores as it would alone.
    """
    mask = rollout.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P+C]
    width = rollout.completion_mask.shape[1]  # C
    prompt = rollout.input_ids.shape[1] - width  # P
    shared = shares_prefix(model, rollout, share_prefix, shared_dropout)
    if shared is None:
        return model(
            input_ids=rollout.input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=width + 1
        ).logits[:, :-1]
    first, inverse = shared
    head = model(
        input_ids=rollout.input_ids[first, :prompt],
        attention_mask=mask[first, :prompt],
        position_ids=position_ids[first, :prompt],
        use_cache=True,
        logits_to_keep=1,
    )  # logits [u, 1, V]: position P-1 scores completion token 0
    cache = kv_cache(head)
    if cache is None:  # a model that keeps no cache: run the plain forward after all
        return completion_logits(model, rollout, share_prefix=False)
    if width == 1:
        return head.logits[inverse]
    cache.reorder_cache(inverse)  # [u, ...] -> [b, ...] per layer
    tail = model(
        input_ids=rollout.input_ids[:, prompt : prompt + width - 1],
        attention_mask=mask[:, : prompt + width - 1],
        position_ids=position_ids[:, prompt : prompt + width - 1],
        use_cache=True,
        **with_kv_cache(cache),
    ).logits  # [b, C-1, V]: positions P .. P+C-2
    return torch.cat([head.logits[inverse], tail], dim=1)


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model's decoder stack (hidden states after the final norm) and its LM head, through a peft wrapper."""
    from peft import PeftModel  # imported where LoRA is used, as llm_pg.models does

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.get_decoder(), base.get_output_embeddings()


def packed_layout(rollout: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's real tokens (prompt then completion) moved to the left, padding only at the right: input ids and
    attention mask `[b, T]` (`T` the longest row), and `[b, C]` the column whose hidden state scores completion
    token c, `p_i - 1 + c` for a row with `p_i` real prompt tokens (clamped for padding positions, which are masked).

    The same tokens at the same positions (`cumsum(mask) - 1`) under a causal mask: the plain forward's hidden states
    to float rounding, without the padding between a short prompt and its completion.
    """
    mask = rollout.attention_mask  # [b, P+C]
    order = torch.sort(1 - mask, dim=1, stable=True).indices  # real tokens first, in their order
    total = max(int(mask.sum(1).max()), 1)  # T
    ids, packed_mask = rollout.input_ids.gather(1, order)[:, :total], mask.gather(1, order)[:, :total]
    prompt_tokens = mask[:, : rollout.prompt_len].sum(1, keepdim=True)  # [b, 1]
    width = rollout.completion_mask.shape[1]
    index = prompt_tokens - 1 + torch.arange(width, device=mask.device)  # [b, C]
    return ids, packed_mask, index.clamp(0, total - 1)


def prefix_sharing_in_graph(model: torch.nn.Module, enabled: bool, shared_dropout: bool = False) -> bool:
    """Whether a training forward (grad on, train mode) may share prompt prefixes: on, unsharded, no gradient
    checkpointing, and no dropout unless `shared_dropout` (the conditions of `shares_prefix` not about the rows)."""
    dropout_ok = shared_dropout or not has_dropout(model)
    return enabled and not is_sharded(model) and not activation_checkpointing(model) and dropout_ok


def completion_hidden(
    model: torch.nn.Module, rollout: RolloutBatch, share_prefix: bool = True, shared_dropout: bool = False
) -> Tensor:
    """Final hidden states `[b, C, H]` whose position c scores completion token c (sequence positions
    `P-1 .. P+C-2`): `completion_logits` before the head, the head left to the caller (`chunked_target_logprobs`)."""
    decoder, _ = _decoder_and_head(model)
    mask = rollout.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P+C]
    width = rollout.completion_mask.shape[1]  # C
    prompt = rollout.input_ids.shape[1] - width  # P
    shared = shares_prefix(model, rollout, share_prefix, shared_dropout)
    if shared is None:
        ids, packed_mask, index = packed_layout(rollout)  # [b, T], [b, T], [b, C]
        out = decoder(input_ids=ids, attention_mask=packed_mask, position_ids=(packed_mask.cumsum(-1) - 1).clamp(min=0))
        hidden = out.last_hidden_state  # [b, T, H]
        return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    first, inverse = shared
    head = decoder(
        input_ids=rollout.input_ids[first, :prompt],
        attention_mask=mask[first, :prompt],
        position_ids=position_ids[first, :prompt],
        use_cache=True,
    )  # hidden [u, P, H]: position P-1 scores completion token 0
    cache = kv_cache(head)
    if cache is None:
        return completion_hidden(model, rollout, share_prefix=False)
    last = head.last_hidden_state[inverse, -1:]  # [b, 1, H]
    if width == 1:
        return last
    cache.reorder_cache(inverse)  # [u, ...] -> [b, ...] per layer
    tail = decoder(
        input_ids=rollout.input_ids[:, prompt : prompt + width - 1],
        attention_mask=mask[:, : prompt + width - 1],
        position_ids=position_ids[:, prompt : prompt + width - 1],
        use_cache=True,
        **with_kv_cache(cache),
    ).last_hidden_state  # [b, C-1, H]: positions P .. P+C-2
    return torch.cat([last, tail], dim=1)


def sequence_logprobs(module, model: torch.nn.Module, rollout: RolloutBatch, with_entropy: bool = False):
    """Completion log-probs `[b, C]` at the module's `logprob_temperature` T, and optionally the token entropy
    `[b, C]`: `out[i, c] = log_softmax(logits[i, P-1+c] / T)[input_ids[i, P+c]]`, in the module's compute dtype.

    With `logprob_chunk_size` > 0 the head and log-softmax run `logprob_chunk_size` positions at a time and are
    recomputed in the backward (`llm_pg.chunked_logprobs`): no `[b, C, V]` logits tensor is held. 0 (and a model
    sharded by FSDP2): one head call.
    """
    temperature = module.logprob_temperature
    hp = module.hparams
    chunk = hp.logprob_chunk_size
    # Under FSDP2 the root module's forward gathers the embedding and head weights: keep the plain path there.
    if chunk and not is_sharded(model):
        with module.autocast():
            hidden = completion_hidden(model, rollout, hp.share_prompt_prefix, hp.share_prompt_dropout)  # [b, C, H]
            weight = _decoder_and_head(model)[1].weight  # [V, H]
            return chunked_target_logprobs(hidden, weight, rollout.completion_ids, temperature, chunk, with_entropy)
    with module.autocast():
        logits = completion_logits(model, rollout, hp.share_prompt_prefix, hp.share_prompt_dropout)  # [b, C, V]
    logp = target_logprobs(logits, rollout.completion_ids, temperature)
    return logp, token_entropy(logits, temperature) if with_entropy else None


@torch.no_grad()
def frozen_logprobs(module, rollout: RolloutBatch, reference: bool) -> Tensor:
    """Log-probs `[N, C]` under pi_old (the policy now) or pi_ref, in no-grad micro-batches of
    `logprob_batch_size` rows, each cut to its longest completion and padded back with (masked) zeros."""
    policy = module.policy
    model = policy if not reference else (module.reference or policy)
    was_training = policy.training
    policy.eval()
    width = rollout.completion_mask.shape[1]
    chunks = []
    for start in range(0, len(rollout), module.hparams.logprob_batch_size):
        rows = torch.arange(start, min(start + module.hparams.logprob_batch_size, len(rollout)))
        part = rollout.select(rows).trimmed()
        adapter_off = policy.disable_adapter() if reference and module.uses_lora else nullcontext()
        with adapter_off:
            logp = sequence_logprobs(module, model, part)[0]
        chunks.append(torch.nn.functional.pad(logp, (0, width - logp.shape[1])))
    policy.train(was_training)
    return torch.cat(chunks) if chunks else rollout.completion_mask.new_zeros(rollout.completion_mask.shape).float()
