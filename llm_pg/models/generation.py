"""Prompt encoding and sampling with HF `generate`, shared by rollouts, evaluation and the base-model report."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from llm_pg.core.losses import completion_mask
from llm_pg.models.cache import kv_cache, with_kv_cache
from llm_pg.models.decoding import compiled_forward, decode, reserved_cache
from llm_pg.models.sampling import NucleusSampler

Conversation = Sequence[dict[str, str]]


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn, the settings every engine's `generate` takes: at most `max_new_tokens` (and at
    least `min_new_tokens`) tokens at `temperature` with nucleus `top_p` (1: off), or the argmax with `greedy`; prompts
    longer than `max_prompt_tokens` keep their last tokens; `chat_template` formats the conversation with the
    tokenizer's template (else the turns are joined by blank lines, for base models).

    Rollouts, evaluation and the reports build one (`PolicyGradientModule.sampling`); `greedy_version()` is the same
    settings decoded greedily."""

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    max_prompt_tokens: int | None = None
    chat_template: bool = True

    def greedy_version(self) -> Sampling:
        return replace(self, greedy=True)


@dataclass
class Generation:
    """Sampled completions, `num_samples` per prompt, group-contiguous (row `i*G + j` answers prompt i): what every
    engine's `generate` returns, and the multi-turn episodes of a tool task (`llm_pg.engines.episodes`). The fields
    after `texts` are named as the `llm_pg.core.rollout.RolloutBatch` fields they become."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: Tensor  # [N, C] right-padded with the pad token after the first EOS
    texts: list[
        str
    ]  # [N] completions decoded up to their EOS, special tokens dropped (an episode's: the model's turns)
    # [N, C] bool, the loss mask: the tokens the model sampled, up to and including the first EOS (in an episode, each
    # of its turns with its end token; observations excluded)
    completion_mask: Tensor | None = None
    # [N, C] long: 1 on every real token of the completion region (the completion mask, but for an episode's
    # observations, which are attended and not trained)
    completion_attention: Tensor | None = None
    # [N, C] float32: the engine's own log-prob of each sampled token, 0 elsewhere (vLLM; None: the sampler is the
    # policy itself)
    sampled_logp: Tensor | None = None
    # Episodes only (None for single-turn completions): [N] bool, the last turn ran out of tokens; [N] long model
    # turns, tool calls made and calls answered with an error; [N] the region decoded with its special tokens
    truncated: Tensor | None = None
    turns: Tensor | None = None
    tool_calls: Tensor | None = None
    tool_errors: Tensor | None = None
    transcripts: list[str] = field(default_factory=list)
    # JSON tool calls only: [N, K] long, the errors of each kind (`llm_pg.data.tasks.tool_calls.CallErrorKind`, K
    # kinds in its order)
    tool_error_kinds: Tensor | None = None
    # [N] episodes only: each row's calls in order, `{"turn", "name", "arguments", "observation"}` (and `"error"`:
    # the kind, for a call answered with an error), for the generations table
    calls: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def episodes(self) -> bool:
        """Whether these are a tool task's multi-turn episodes."""
        return self.turns is not None


def single_turn(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    texts: list[str],
    eos: Sequence[int],
    sampled_logp: Tensor | None = None,
) -> Generation:
    """A single-turn `Generation`, its masks from the EOS ids: each completion up to and including its first EOS."""
    mask = completion_mask(completion_ids, list(eos))  # [N, C]
    return Generation(prompt_ids, prompt_mask, completion_ids, texts, mask, mask.long(), sampled_logp)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the model's generation config EOS ids plus the tokenizer's."""
    return configured_eos_ids(model.generation_config, tokenizer)


def pad_token_id(tokenizer: PreTrainedTokenizerBase, eos: Sequence[int]) -> int:
    """The id that pads prompts and completions: the tokenizer's pad token, else the first EOS id (`eos`, as
    `eos_token_ids` gives them). Pad positions are always masked, so the choice never reaches a log-prob."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def configured_eos_ids(generation_config, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The EOS ids of a generation config (one id, a list, or None) plus the tokenizer's, sorted."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def unused_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the model's head scores but the tokenizer does not define: the embedding's padding rows (Qwen2.5:
    151,936 rows for 151,665 tokens). Sampling never draws them (their probability was 3e-11 on a Qwen prompt at
    T 0.8, so the sampler's distribution differs from the full softmax the trainer scores by about that much)."""
    return rows_past_tokenizer(model.config.get_text_config().vocab_size, tokenizer)


def rows_past_tokenizer(rows: int, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids of a head of `rows` rows that the tokenizer does not define (`unused_token_ids`' rule, for a caller
    that has the model's config and not the model)."""
    return list(range(len(tokenizer), rows)) if rows > len(tokenizer) else []


@dataclass(frozen=True)
class ModelTokens:
    """What decoding needs to know about a model's ids, computed once (`model_tokens`): every EOS id, the pad id,
    the head's rows the tokenizer does not define (never sampled), and the context in tokens (None: unknown)."""

    eos: tuple[int, ...]
    pad: int
    unused: tuple[int, ...]
    context: int | None


def model_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ModelTokens:
    """`ModelTokens` of `model` with `tokenizer` (`eos_token_ids`, `pad_token_id`, `unused_token_ids`,
    `context_length`)."""
    eos = eos_token_ids(model, tokenizer)
    return ModelTokens(
        tuple(eos), pad_token_id(tokenizer, eos), tuple(unused_token_ids(model, tokenizer)), context_length(model)
    )


class PromptTooLong(ValueError):
    """A prompt (after `max_prompt_tokens`) leaves no room in the model's context for the completion: raised
    before any tensor is built, naming the batch row (`row`)."""

    def __init__(self, row: int, tokens: int, context: int, max_new_tokens: int) -> None:
        self.row, self.tokens = row, tokens
        super().__init__(
            f"{tokens} tokens, and with max_new_tokens={max_new_tokens} the model's context of {context} tokens "
            "leaves room for at most "
            f"{context - max_new_tokens}; set model.init_args.max_prompt_tokens (each prompt keeps its last tokens) "
            "or fix the data row"
        )


def context_length(model: PreTrainedModel) -> int | None:
    """The model's context in tokens (`max_position_embeddings`), or None where its config does not say."""
    value = getattr(model.config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation],
    max_prompt_tokens: int | None = None,
    chat_template: bool = True,
    context: int | None = None,
    max_new_tokens: int = 0,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Tensor]:
    """Left-padded `input_ids`/`attention_mask` `[B, P]` for chat conversations.

    With `chat_template` the tokenizer's template adds the generation prompt (and, given `tools`, the JSON schemas'
    tool block: `tools=`); without it the turns' contents are joined by blank lines (for base models that have no
    template). Prompts longer than
    `max_prompt_tokens` keep their last tokens, as the question usually sits at the end. With `context` (the
    model's, in tokens), a prompt that leaves fewer than `max_new_tokens` of it raises `PromptTooLong` before any
    tensor is built (a 5 MB data row would otherwise ask for gigabytes of attention).
    """
    if chat_template:
        extra = {"tools": list(tools)} if tools else {}
        texts = [
            tokenizer.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True, **extra)
            for c in conversations
        ]
    else:
        texts = ["\n\n".join(turn["content"] for turn in c) for c in conversations]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_prompt_tokens is not None and any(len(ids) > max_prompt_tokens for ids in encoded):
        longest = max(len(ids) for ids in encoded)
        lost = " (the tools' block at its start is cut first: the model would not see its tools)" if tools else ""
        warnings.warn(
            f"a prompt has {longest} tokens, more than max_prompt_tokens={max_prompt_tokens}: keeping its last "
            f"{max_prompt_tokens}{lost}; raise max_prompt_tokens to keep whole prompts",
            stacklevel=2,
        )
        encoded = [ids[-max_prompt_tokens:] for ids in encoded]
    for row, ids in enumerate(encoded):
        if context is not None and len(ids) + max_new_tokens > context:
            raise PromptTooLong(row, len(ids), context, max_new_tokens)
    pad = pad_token_id(tokenizer, [tokenizer.eos_token_id])
    return left_padded(encoded, pad)


def left_padded(rows: Sequence[Sequence[int]], pad: int) -> dict[str, Tensor]:
    """`input_ids` `[B, W]` (each row's ids at the right, `pad` before them) and `attention_mask` (1 on the ids)."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation],
    sampling: Sampling = Sampling(),
    *,
    num_samples: int = 1,
    seed: int | None = None,
    share_prompt: bool = True,
    compiled: bool = False,
    tokens: ModelTokens | None = None,
) -> Generation:
    """Sample `num_samples` completions per conversation as `sampling` says (KV cache on, model in eval mode).
    `tokens`: the model's `ModelTokens` when the caller holds them (default: computed here).

    Sampling is plain temperature/top-p sampling: top-k and repetition penalties that a model's own
    generation config may carry are switched off, so the log-probs the trainer computes at `temperature`
    are those of the sampling distribution (up to top-p truncation). With `top_p < 1` the token is drawn from
    `llm_pg.models.sampling.nucleus` (transformers' nucleus, without sorting the vocabulary at every token).
    The decode loop is ours (`llm_pg.models.decoding.decode`: rows that have ended leave the batch, the tokens
    are HF `generate`'s); a model whose generation config names a cache of its own decodes with HF `generate`.
    With `seed`, sampling draws from a forked RNG seeded with it: the same seed gives the same completions and
    global RNG state is untouched.
    With `share_prompt` and several samples, each prompt is prefilled once (`prompt_cache`) instead of once per
    sample; the tokens are those of the unshared prefill (the logits agree to float rounding). The cache is a
    reserved one (`llm_pg.models.decoding.reserved_cache`: decoded positions written in place); with `compiled`, the
    decode steps run through `torch.compile` (`llm_pg.models.decoding.compiled_forward`).
    """
    device = next(model.parameters()).device
    tokens = tokens or model_tokens(model, tokenizer)
    encoded = encode_prompts(
        tokenizer,
        conversations,
        sampling.max_prompt_tokens,
        sampling.chat_template,
        tokens.context,
        sampling.max_new_tokens,
    )
    prompt_ids = encoded["input_ids"].repeat_interleave(num_samples, dim=0).to(device)  # [N, P]
    prompt_mask = encoded["attention_mask"].repeat_interleave(num_samples, dim=0).to(device)
    was_training = model.training
    model.eval()  # the prompt cache too is computed in eval mode (no dropout)
    cache = prompt_cache(model, encoded, num_samples) if share_prompt else None
    completion_ids = sample_ids(model, tokens, prompt_ids, prompt_mask, sampling, seed, cache, compiled)  # [N, C]
    model.train(was_training)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return single_turn(prompt_ids, prompt_mask, completion_ids, texts, tokens.eos)


@torch.no_grad()
def continue_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    contexts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    seed: int | None = None,
    compiled: bool = False,
    tokens: ModelTokens | None = None,
    share_prefix: bool = True,
) -> list[list[int]]:
    """One continuation per token-id context (a multi-turn episode's ids so far), sampled as `generate` samples:
    each row's new ids up to and including its first EOS, or `sampling.max_new_tokens` of them. Nothing is
    re-tokenized. With `share_prefix`, the contexts' common first ids (a chat template's system turn and tool block,
    or the whole prompt of one prompt's samples) are prefilled once (`prefix_cache`) and each row's rest after them;
    otherwise the contexts are left-padded into one batch. The tokens are those of the unshared prefill (the logits
    agree to float rounding)."""
    device = next(model.parameters()).device
    tokens = tokens or model_tokens(model, tokenizer)
    was_training = model.training
    model.eval()  # the prefix cache too is computed in eval mode (no dropout)
    cache, ids, mask = prefix_cache(model, contexts, tokens.pad, device) if share_prefix else (None, None, None)
    if cache is None:
        batch = left_padded(contexts, tokens.pad)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    out = sample_ids(model, tokens, ids, mask, sampling, seed, cache, compiled).tolist()
    model.train(was_training)
    rows = []
    for row in out:
        ends = [i for i, token in enumerate(row) if token in tokens.eos]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many first ids every row shares (linear in the ids compared)."""
    first, length = rows[0], min(len(row) for row in rows)
    for row in rows[1:]:
        length = next((k for k in range(length) if row[k] != first[k]), length)
    return length


def prefix_cache(
    model: PreTrainedModel, contexts: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[Any, Tensor | None, Tensor | None]:
    """The KV cache of the ids every context starts with (all but the shortest context's last one), computed once
    and repeated for every row, with the batch it continues: `[N, S + T]` ids and attention mask, the `S` shared ids
    then each row's rest left-padded to `T` (the padding sits between the two; positions count real tokens only, so
    every row decodes as after a prefill of its own). `(None, None, None)` when nothing is shared (one row, no
    common id) or the model keeps no cache of ours (`prompt_cache`'s rules)."""
    shared = min(common_prefix(contexts), min(len(c) for c in contexts) - 1)
    if len(contexts) < 2 or shared < 1:
        return None, None, None
    if getattr(model.generation_config, "cache_implementation", None) is not None:
        return None, None, None
    head = torch.tensor([list(contexts[0][:shared])], dtype=torch.long, device=device)  # [1, S]
    cache = kv_cache(model(input_ids=head, use_cache=True, logits_to_keep=1))
    if cache is None:
        return None, None, None
    cache.batch_repeat_interleave(len(contexts))
    rest = left_padded([c[shared:] for c in contexts], pad)  # [N, T]
    ids = torch.cat([head.expand(len(contexts), -1), rest["input_ids"].to(device)], dim=1)
    mask = torch.cat([torch.ones_like(ids[:, :shared]), rest["attention_mask"].to(device)], dim=1)
    return cache, ids, mask


def sample_ids(
    model: PreTrainedModel,
    tokens: ModelTokens,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    seed: int | None,
    cache,
    compiled: bool,
) -> Tensor:
    """`[N, C]` sampled ids after left-padded `prompt_ids` `[N, P]` (right-padded with the pad id after each row's
    first EOS); `cache`: a prompt cache (`prompt_cache`) or None."""
    device = prompt_ids.device
    eos, pad, unused = list(tokens.eos), tokens.pad, list(tokens.unused)
    was_training = model.training
    model.eval()
    cache = reserved_cache(model, cache, sampling.max_new_tokens)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None), compiled_forward(model, compiled):
        if seed is not None:
            torch.manual_seed(seed)
        if cache is not None:  # our loop: ended rows leave the batch (llm_pg.models.decoding.decode)
            ids = decode(model, prompt_ids, prompt_mask, cache, sampling, eos, pad, unused)
        else:
            ids = hf_generate(model, prompt_ids, prompt_mask, sampling, eos, pad, unused)
    model.train(was_training)
    return ids  # [N, C]


def hf_generate(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    eos: list[int],
    pad: int,
    unused: list[int],
    cache=None,
) -> Tensor:
    """`decode`'s tokens from HF `generate` itself, for a model whose generation config names a cache of its own
    (static, hybrid, ...): every row runs until the longest ends. `cache`: a KV cache to continue (tests compare
    `decode` with this)."""
    if sampling.greedy:
        draw = {"do_sample": False}
    elif sampling.top_p < 1.0:  # our nucleus sampler draws the token; generate's greedy argmax then takes it
        nucleus = NucleusSampler(sampling.temperature, sampling.top_p)
        draw = {"do_sample": False, "logits_processor": LogitsProcessorList([nucleus])}
    else:
        draw = {"do_sample": True, "temperature": sampling.temperature, "top_p": 1.0, "top_k": 0}
    output = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.min_new_tokens,
        repetition_penalty=1.0,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
        # transformers would turn this on for an FSDP model and all-reduce at every token; FSDP2 models are
        # gathered once around the call instead (`llm_pg.models.parallel.unsharded`), so ranks decode alone.
        synced_gpus=False,
        **(with_kv_cache(cache) if cache is not None else {}),
        **({"suppress_tokens": unused} if unused else {}),  # none for the tiny model and SmolLM2
        **draw,
    )
    return output[:, prompt_ids.shape[1] :]  # [N, C]


def prompt_cache(model: PreTrainedModel, encoded: dict[str, Tensor], num_samples: int):
    """The KV cache of every prompt but its last token, computed once per prompt and repeated `num_samples` times
    (rows group-contiguous, as `generate` lays them out); None when there is nothing to share, the model keeps no
    cache, or its generation config names a cache implementation (transformers refuses a cache passed beside one).
    `generate` then runs only each row's last prompt token before sampling, at the position the
    attention mask gives it, so every row decodes as it would after a prefill of its own."""
    ids, mask = encoded["input_ids"], encoded["attention_mask"]  # [B, P]
    if num_samples < 2 or ids.shape[1] < 2:
        return None
    if getattr(model.generation_config, "cache_implementation", None) is not None:
        return None  # the checkpoint asks for a cache of its own (static, hybrid, ...), which generate() builds
    device = next(model.parameters()).device
    ids, mask = ids[:, :-1].to(device), mask[:, :-1].to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # real tokens numbered from 0, as generate() numbers them
    output = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    cache = kv_cache(output)
    if cache is not None:
        cache.batch_repeat_interleave(num_samples)
    return cache
