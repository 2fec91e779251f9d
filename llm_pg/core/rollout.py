"""One rollout as aligned tensors (`RolloutBatch`): core data, no task, model or Lightning imports.

The callback that samples and scores it each iteration is `llm_pg.callbacks.rollout.RolloutCallback`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `(seed, iteration, rank, purpose)`: runs replay and resume without saved RNG state."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def rank_and_world_size(trainer) -> tuple[int, int]:
    """This process's `(global rank, world size)` from a Lightning trainer; `(0, 1)` without one. The one lookup the
    data stream (which prompts a rank draws) and the evaluation (which eval rows a rank decodes) both use."""
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


@dataclass(frozen=True)
class RolloutBatch:
    """Aligned per-row data of one rollout: `N = prompts * group_size` rows, group-contiguous. Immutable: the rollout
    callback builds it complete (advantages, masks, pi_ref, and pi_old where a no-grad pass makes it) and the update
    derives what it needs in its own state (`llm_pg.modules.update.UpdateState`); `select`, `to` and `trimmed` make
    new batches.

    Row `i*G + j` is completion j of prompt i. Sequences are `[prompt (left-padded to P) | completion
    (right-padded to C)]`, so every completion starts at column `prompt_len`. In a multi-turn episode (a tool task,
    `llm_pg.engines.episodes`) the completion is the model's turns and the tool observations between them: all of it
    is attended (`attention_mask`), only the model's turns are trained (`completion_mask`, the loss mask).
    """

    input_ids: Tensor  # [N, P+C] long
    # [N, P+C] long: 1 on real prompt tokens and on the completion's real tokens (up to its first EOS; in an episode,
    # every turn and observation), never inferred from token ids (a pad id may equal an end-of-turn id)
    attention_mask: Tensor
    # [N, C] bool, the loss mask: the tokens the model sampled, up to and including the first EOS (in an episode, each
    # of its turns with its end token; observations excluded). Every loss and token statistic is over it.
    completion_mask: Tensor
    rewards: Tensor  # [N] float32
    # [N] float32, group-normalised and clipped; None only while the rollout callback builds it (before the variants)
    advantages: Tensor | None = None
    # [N, C] float32, log pi_old at `logprob_temperature` from a no-grad pass (GRPO; None when the update takes it from
    # its first pass, `UpdateState.old_logp`)
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None  # [N, C] float32, log pi_ref (only when kl_coef > 0)
    # [N, C] float32, the rollout engine's own log-prob of each sampled token (vLLM; None with HF), 0 on padding:
    # compared with the trainer's pi_old for `rollout/logprob_mismatch_*`; in the loss only through `correction`
    sampled_logp: Tensor | None = None
    # Episodes only (None for single-turn rollouts, whose rows end at their first EOS): [N] bool, the last turn ran
    # out of tokens; [N] long model turns, tool calls run and calls answered with an error
    truncated: Tensor | None = None
    turns: Tensor | None = None
    tool_calls: Tensor | None = None
    tool_errors: Tensor | None = None
    prompt_len: int = 0  # P
    texts: list[str] = field(default_factory=list)  # [N] decoded completions (an episode's: the model's turns)
    prompt_index: list[int] = field(default_factory=list)  # [N] which prompt of the batch each row answers
    transcripts: list[str] = field(default_factory=list)  # [N] episodes only: turns and observations, as sampled
    # JSON tool calls only: [N, K] long, each row's errors by kind (`llm_pg.engines.episodes.KINDS`)
    tool_error_kinds: Tensor | None = None
    calls: list[list[dict]] = field(default_factory=list)  # [N] episodes only: each call with its observation

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor | list) and len(value) not in (0, n):
                raise ValueError(f"RolloutBatch.{f.name} has {len(value)} rows, input_ids has {n}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, tensor_fn, list_fn) -> RolloutBatch:
        """A new batch with `tensor_fn` applied to every tensor field and `list_fn` to every list field."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = tensor_fn(value)
            elif isinstance(value, list):
                changes[f.name] = list_fn(value)
        return dataclasses.replace(self, **changes)

    def select(self, index: Tensor) -> RolloutBatch:
        """The rows `index` (a 1-D long tensor), every field sliced with the same index."""
        rows = index.tolist()
        return self._map(lambda t: t[index.to(t.device)], lambda values: [values[i] for i in rows] if values else [])

    def to(self, device: torch.device | str) -> RolloutBatch:
        return self._map(lambda t: t.to(device), lambda values: values)

    @property
    def completion_ids(self) -> Tensor:  # [N, C]
        return self.input_ids[:, self.prompt_len :]

    def trimmed(self) -> RolloutBatch:
        """The batch cut to its longest completion `w` (real tokens by `attention_mask`): `[b, P+w]` sequences and
        `[b, w]` completion-space fields. The columns cut are padding, masked in every loss and statistic."""
        completion = self.input_ids.shape[1] - self.prompt_len
        width = max(int(self.attention_mask[:, self.prompt_len :].sum(1).max()) if len(self) else 0, 1)
        if width >= completion:
            return self

        changes = {name: getattr(self, name)[:, : self.prompt_len + width] for name in SEQUENCE_FIELDS}
        for name in COMPLETION_FIELDS:  # by name: a per-row field such as tool_error_kinds [N, K] is never cut
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[:, :width]
        return dataclasses.replace(self, **changes)

    def minibatches(self, minibatch_size: int, generator: torch.Generator | None = None) -> Iterator[RolloutBatch]:
        """Rows in a shuffled order (seeded by `generator`), `minibatch_size` at a time; the last may be short."""
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), minibatch_size):
            yield self.select(order[start : start + minibatch_size])


SEQUENCE_FIELDS = ("input_ids", "attention_mask")  # [N, P+C]
COMPLETION_FIELDS = ("completion_mask", "old_logp", "ref_logp", "sampled_logp")  # [N, C]


def concat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch holding the rows of `parts` in order (dynamic sampling's rounds): prompts left-padded to the widest
    prompt and completions right-padded to the widest completion (`pad_id` in `input_ids`, 0 or False elsewhere), so
    every completion still starts at column `prompt_len`. `prompt_index` is kept as given: the caller numbers prompts
    across parts. A single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    prompt = max(p.prompt_len for p in parts)
    completion = max(p.input_ids.shape[1] - p.prompt_len for p in parts)
    fields: dict[str, object] = {"prompt_len": prompt}
    for f in dataclasses.fields(RolloutBatch):
        if f.name == "prompt_len":
            continue
        values = [getattr(p, f.name) for p in parts]
        if all(v is None for v in values):
            fields[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"RolloutBatch.{f.name} is set in some parts and not in others")
        elif isinstance(values[0], list):
            fields[f.name] = [x for v in values for x in v]
        else:
            padded = []
            for p, t in zip(parts, values, strict=True):
                right = completion - (p.input_ids.shape[1] - p.prompt_len)
                left = prompt - p.prompt_len if f.name in SEQUENCE_FIELDS else 0
                if f.name in SEQUENCE_FIELDS or f.name in COMPLETION_FIELDS:
                    t = torch.nn.functional.pad(t, (left, right), value=pad_id if f.name == "input_ids" else 0)
                padded.append(t)
            fields[f.name] = torch.cat(padded)
    return RolloutBatch(**fields)


@dataclass(frozen=True)
class MicroBatch:
    """One forward of the update as its loss sees it: `rows`, a slice of the rollout cut to its longest completion
    (`RolloutBatch.trimmed`, `[b, w]` completion fields); `old_logp` `[b, w]`, pi_old of those rows (the rollout's,
    or the update's own first pass: `llm_pg.modules.update.UpdateState`; None for REINFORCE without one);
    `split_tokens` `[b]`, the completion tokens of the micro-batch each row belongs to in the update's shuffled split
    when the forwards group rows otherwise (`losses.token_mean_share`; None: this forward is that micro-batch); and
    `num_tokens`, the completion tokens of the whole optimizer step (the objective's `aggregation: token_mean`; else
    None)."""

    rows: RolloutBatch
    old_logp: Tensor | None = None
    split_tokens: Tensor | None = None
    num_tokens: float | None = None
