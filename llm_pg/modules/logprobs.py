"""Completion logits of a rollout under a model, with each distinct prompt run once (prompt-prefix sharing).

A rollout holds `G` completions per prompt, and every row is `[prompt | completion]`. A plain forward runs each
prompt's tokens `G` times. With prefix sharing the distinct prompts of a batch run once, their keys and values
are copied to every row that shares them (an `index_select`: gradients flow back through it into the one prompt
pass), and the completions run on top of that cache. The logits are the plain forward's up to float rounding
(within 1e-4 on float32 logits: tests/test_prefix_sharing.py), and so are the gradients; the saving is the prompt
tokens of the duplicate rows: `(b - u) * P` of `b * (P + C)` token positions for `b` rows over `u` distinct prompts.

It is used when it is exact and pays off (`shares_prefix`): at least two rows per distinct prompt on average, a
model that is not sharded (FSDP2 would gather the weights twice: the module turns it off for a sharded policy,
`LogProbs.share_prefix`), and, in a forward that builds a graph, no dropout
(the duplicate rows would share one dropout mask on their prompt, which changes the estimator's noise;
`speed.share_prompt_dropout: true` accepts that: one mask per prompt changes the gradient's variance, not its
expectation) and no reentrant gradient checkpointing. Under non-reentrant checkpointing (what
`models.cache.enable_activation_checkpointing` sets) the layers are told to keep the cache for the two calls
(`models.cache.cache_kept_under_checkpointing`), and the caches are ones the backward's recompute of a layer cannot
corrupt: the prompt pass records its keys and values once (`models.cache.PromptCache`), the completion pass reads the
rows' copy without storing (`PromptCache.rows`), so the recompute sees what the forward saw. The reentrant variant
runs each layer's forward without a graph: keys that leave a layer through the cache would carry no gradient, so
sharing stays off there. `model.init_args.speed.share_prompt_prefix: false` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from llm_pg.core.chunked_logprobs import chunked_target_logprobs
from llm_pg.core.losses import differentiable_entropy, target_logprobs, token_entropy
from llm_pg.core.rollout import RolloutBatch
from llm_pg.models.cache import (
    PromptCache,
    activation_checkpointing,
    cache_kept_under_checkpointing,
    cache_survives_checkpointing,
    kv_cache,
    with_kv_cache,
)
from llm_pg.modules import packing


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


def prefix_sharing_in_graph(model: torch.nn.Module, enabled: bool, shared_dropout: bool = False) -> bool:
    """Whether a training forward (grad on, train mode) may share prompt prefixes: on, no gradient
    checkpointing unless a non-reentrant one the cache survives (`models.cache.cache_survives_checkpointing`), and no
    dropout unless `shared_dropout` (the conditions of `shares_prefix` not about the rows)."""
    dropout_ok = shared_dropout or not has_dropout(model)
    checkpointing_ok = not activation_checkpointing(model) or cache_survives_checkpointing(model)
    return enabled and checkpointing_ok and dropout_ok


def shares_prefix(
    model: torch.nn.Module, rollout: RolloutBatch, enabled: bool, shared_dropout: bool = False
) -> tuple[Tensor, Tensor] | None:
    """`distinct_prompts(rollout)` when prefix sharing is on, exact and worth a second forward call, else None.
    `shared_dropout` (`speed.share_prompt_dropout`) accepts, in a training forward, one dropout mask per prompt.
    `enabled` is the caller's: off for a model sharded by FSDP2."""
    if not enabled or len(rollout) < 2:
        return None
    builds_graph = torch.is_grad_enabled() and model.training
    if builds_graph and not prefix_sharing_in_graph(model, enabled, shared_dropout):
        return None
    first, inverse = distinct_prompts(rollout)
    return (first, inverse) if 2 * len(first) <= len(rollout) else None


def _prompt_shared(
    forward: torch.nn.Module, rollout: RolloutBatch, shared: tuple[Tensor, Tensor], field: str, **head_kwargs
) -> Tensor | None:
    """`forward` (a causal LM or its decoder) run on each distinct prompt once, then on every row's completion over
    the rows' copy of the prompt cache: its output `field` `[b, C, *]` at sequence positions `P-1 .. P+C-2`, or None
    when the model keeps no cache (the caller then runs the plain forward).

    In train mode under gradient checkpointing the layers keep the cache for the two calls, and the caches are the
    recompute-safe `PromptCache` and its `rows`; elsewhere the model's own cache, copied to the rows in place."""
    first, inverse = shared
    mask = rollout.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P+C]
    width = rollout.completion_mask.shape[1]  # C
    prompt = rollout.input_ids.shape[1] - width  # P
    checkpointed = forward.training and activation_checkpointing(forward)
    recorded = PromptCache() if checkpointed else None
    # Under checkpointing `use_cache` stays off (transformers would turn it off, with a warning): the cache is ours.
    cache_kwargs = {"use_cache": False, **with_kv_cache(recorded)} if checkpointed else {"use_cache": True}
    with cache_kept_under_checkpointing(forward) if checkpointed else nullcontext():
        head = forward(
            input_ids=rollout.input_ids[first, :prompt],
            attention_mask=mask[first, :prompt],
            position_ids=position_ids[first, :prompt],
            **cache_kwargs,
            **head_kwargs,
        )  # [u, *, *]: position P-1 scores completion token 0
        cache = recorded if checkpointed else kv_cache(head)
        if cache is None or len(cache.layers) == 0:  # no cache kept: a model without one, or the layers dropped it
            return None
        last = getattr(head, field)[inverse, -1:]  # [b, 1, *]
        if width == 1:
            return last
        if checkpointed:
            cache = recorded.rows(inverse)  # [u, ...] -> [b, ...] per layer, read-only
        else:
            cache.reorder_cache(inverse)
        tail = forward(
            input_ids=rollout.input_ids[:, prompt : prompt + width - 1],
            attention_mask=mask[:, : prompt + width - 1],
            position_ids=position_ids[:, prompt : prompt + width - 1],
            **{**cache_kwargs, **with_kv_cache(cache)},
        )  # [b, C-1, *]: positions P .. P+C-2
    return torch.cat([last, getattr(tail, field)], dim=1)


def completion_logits(
    model: torch.nn.Module, rollout: RolloutBatch, share_prefix: bool = True, shared_dropout: bool = False
) -> Tensor:
    """Logits `[b, C, V]` whose position c scores completion token c (sequence positions `P-1 .. P+C-2`).

    Positions number real tokens only (`cumsum(attention_mask) - 1`, as `generate` numbers left-padded prompts),
    so a left-padded row scores as it would alone.
    """
    shared = shares_prefix(model, rollout, share_prefix, shared_dropout)
    logits = None if shared is None else _prompt_shared(model, rollout, shared, "logits", logits_to_keep=1)
    if logits is not None:
        return logits
    mask = rollout.attention_mask
    width = rollout.completion_mask.shape[1]  # C
    return model(
        input_ids=rollout.input_ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=width + 1,
    ).logits[:, :-1]


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


def completion_hidden(
    model: torch.nn.Module, rollout: RolloutBatch, share_prefix: bool = True, shared_dropout: bool = False
) -> Tensor:
    """Final hidden states `[b, C, H]` whose position c scores completion token c (sequence positions
    `P-1 .. P+C-2`): `completion_logits` before the head, the head left to the caller (`chunked_target_logprobs`)."""
    decoder, _ = _decoder_and_head(model)
    shared = shares_prefix(model, rollout, share_prefix, shared_dropout)
    hidden = None if shared is None else _prompt_shared(decoder, rollout, shared, "last_hidden_state")
    if hidden is not None:
        return hidden
    ids, packed_mask, index = packed_layout(rollout)  # [b, T], [b, T], [b, C]
    out = decoder(input_ids=ids, attention_mask=packed_mask, position_ids=(packed_mask.cumsum(-1) - 1).clamp(min=0))
    hidden = out.last_hidden_state  # [b, T, H]
    return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))


@dataclass(frozen=True)
class LogProbs:
    """How completion log-probs are computed in one fit, built once by the module (`PolicyGradientModule.logprobs`):
    at `temperature` (the module's `logprob_temperature`), under `autocast` (its compute dtype), with the head in
    chunks of `chunk_size` positions (`speed.logprob_chunk_size`; 0: one call), each distinct prompt run once when
    `share_prefix` (`speed.share_prompt_prefix`, and `shared_dropout` for `speed.share_prompt_dropout`), and no-grad
    passes in micro-batches of `batch_size` rows (`speed.logprob_batch_size`); for a policy sharded by FSDP2 (and its
    reference, sharded with it) the module sets `chunk_size` 0 and `share_prefix` off. `policy` is the trained model;
    `reference` the frozen copy of full fine-tuning, or None (with LoRA pi_ref is the policy with its adapter switched
    off: `lora`)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    lora: bool
    temperature: float
    chunk_size: int
    share_prefix: bool
    shared_dropout: bool
    batch_size: int
    autocast: Callable[[], AbstractContextManager] = nullcontext
    pack: bool = False

    def __call__(
        self, model: torch.nn.Module, rollout: RolloutBatch, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Completion log-probs `[b, C]` at `temperature` T, and optionally the token entropy `[b, C]` (with its
        gradient: `entropy_grad`): `out[i, c] = log_softmax(logits[i, P-1+c] / T)[input_ids[i, P+c]]`.

        With `chunk_size` > 0 the head and log-softmax run `chunk_size` positions at a time and are recomputed in
        the backward (`llm_pg.core.chunked_logprobs`): no `[b, C, V]` logits tensor is held. 0 (what a model sharded
        by FSDP2 gets, whose root forward gathers the embedding and head weights): one head call.
        """
        if self.chunk_size and self.pack:
            shared = shares_prefix(model, rollout, self.share_prefix, self.shared_dropout)
            if self.packs(model, rollout, None if shared is None else len(shared[0])):
                return self._packed(model, rollout, shared, with_entropy, entropy_grad)
        if self.chunk_size:
            with self.autocast():
                hidden = completion_hidden(model, rollout, self.share_prefix, self.shared_dropout)  # [b, C, H]
                weight = _decoder_and_head(model)[1].weight  # [V, H]
                targets = rollout.completion_ids
                return chunked_target_logprobs(
                    hidden, weight, targets, self.temperature, self.chunk_size, with_entropy, entropy_grad
                )
        with self.autocast():
            logits = completion_logits(model, rollout, self.share_prefix, self.shared_dropout)  # [b, C, V]
        logp = target_logprobs(logits, rollout.completion_ids, self.temperature)
        if entropy_grad:
            return logp, differentiable_entropy(logits, self.temperature)
        return logp, token_entropy(logits, self.temperature) if with_entropy else None

    @staticmethod
    def packs(model: torch.nn.Module, rollout: RolloutBatch, unique_prompts: int | None) -> bool:
        """Whether a forward runs packed (`llm_pg.modules.packing`): the model's attention takes the packed mask
        (SDPA or eager, `packing.MASKS`), and at least `packing.MIN_PADDING` of the positions the other path would
        run are padding: `u * P + N * C` with `unique_prompts` = u shared prompts, else `N * T` for rows moved left
        to the longest row's `T` real tokens (`packed_layout`), against the real tokens needed. Below that the
        padded batch costs no more than the packed one, whose mask and block-diagonal attention are not free: the
        tiny model's format_copy micro-batches waste 1-17 % of their positions, the Qwen math rehearsal's 60-80 %."""
        if getattr(_decoder_and_head(model)[0].config, "_attn_implementation", None) not in packing.MASKS:
            return False
        mask, prompt = rollout.attention_mask, rollout.prompt_len
        if unique_prompts is None:
            real_per_row = mask.sum(1)  # [N]
            padded, real = len(mask) * int(real_per_row.max()), int(real_per_row.sum())
        else:
            padded = unique_prompts * prompt + mask[:, prompt:].numel()
            real = unique_prompts * prompt + int(mask[:, prompt:].sum())
        return padded > 0 and padded - real >= packing.MIN_PADDING * padded

    def _packed(
        self,
        model: torch.nn.Module,
        rollout: RolloutBatch,
        shared: tuple[Tensor, Tensor] | None,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """`__call__` over the packed rows (`llm_pg.modules.packing`): the head scores only real completion tokens;
        the padding positions of the `[b, C]` results are 0 (masked everywhere)."""
        decoder, head = _decoder_and_head(model)
        with self.autocast():
            packed = None if shared is None else packing.packed_completion_hidden(decoder, rollout, shared)
            packed = packed or packing.packed_completion_hidden(decoder, rollout, None)
            hidden, rows, columns = packed  # [n, H], [n], [n]
            targets = rollout.completion_ids[rows, columns]  # [n]
            logp, entropy = chunked_target_logprobs(
                hidden, head.weight, targets, self.temperature, self.chunk_size, with_entropy, entropy_grad
            )
        shape = rollout.completion_mask.shape  # [b, C]
        logp = logp.new_zeros(shape).index_put((rows, columns), logp)
        return logp, None if entropy is None else entropy.new_zeros(shape).index_put((rows, columns), entropy)

    @torch.no_grad()
    def no_grad(self, rollout: RolloutBatch, reference: bool = False) -> Tensor:
        """Log-probs `[N, C]` under pi_old (the policy now, in eval mode) or pi_ref (`reference`), in no-grad
        micro-batches of `batch_size` rows, each cut to its longest completion and padded back with (masked) zeros."""
        policy = self.policy
        model = self.reference if reference and self.reference is not None else policy
        was_training = policy.training
        policy.eval()
        width = rollout.completion_mask.shape[1]
        chunks = []
        for start in range(0, len(rollout), self.batch_size):
            rows = torch.arange(start, min(start + self.batch_size, len(rollout)))
            part = rollout.select(rows).trimmed()
            with policy.disable_adapter() if reference and self.lora else nullcontext():
                logp = self(model, part)[0]
            chunks.append(torch.nn.functional.pad(logp, (0, width - logp.shape[1])))
        policy.train(was_training)
        return torch.cat(chunks) if chunks else rollout.completion_mask.new_zeros(rollout.completion_mask.shape).float()
