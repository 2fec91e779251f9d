"""One rollout as aligned tensors (`RolloutBatch`), and the callback that samples it each iteration."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from llm_pg.data.tasks.base import Score
from llm_pg.generation import eos_token_ids, generate
from llm_pg.losses import completion_mask, group_advantages, settled_groups


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `(seed, iteration, rank, purpose)`: runs replay and resume without saved RNG state."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class RolloutBatch:
    """Aligned per-row data of one rollout: `N = prompts * group_size` rows, group-contiguous.

    Row `i*G + j` is completion j of prompt i. Sequences are `[prompt (left-padded to P) | completion
    (right-padded to C)]`, so every completion starts at column `prompt_len`.
    """

    input_ids: Tensor  # [N, P+C] long
    attention_mask: Tensor  # [N, P+C] long: 1 on real prompt tokens and on the completion up to its first EOS
    completion_mask: Tensor  # [N, C] bool: completion tokens up to and including the first EOS
    rewards: Tensor  # [N] float32
    advantages: Tensor  # [N] float32, group-normalised and clipped
    old_logp: Tensor | None = None  # [N, C] float32, log pi_old at the sampling temperature (GRPO)
    ref_logp: Tensor | None = None  # [N, C] float32, log pi_ref (only when kl_coef > 0)
    prompt_len: int = 0  # P
    texts: list[str] = field(default_factory=list)  # [N] decoded completions
    prompt_index: list[int] = field(default_factory=list)  # [N] which prompt of the batch each row answers

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
        return self._map(lambda t: t[index.to(t.device)], lambda values: [values[i] for i in rows])

    def to(self, device: torch.device | str) -> RolloutBatch:
        return self._map(lambda t: t.to(device), lambda values: values)

    @property
    def completion_ids(self) -> Tensor:  # [N, C]
        return self.input_ids[:, self.prompt_len :]

    def minibatches(self, minibatch_size: int, generator: torch.Generator | None = None) -> Iterator[RolloutBatch]:
        """Rows in a shuffled order (seeded by `generator`), `minibatch_size` at a time; the last may be short."""
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), minibatch_size):
            yield self.select(order[start : start + minibatch_size])


class RolloutCallback(Callback):
    """Samples and scores one rollout before each training step and attaches it as `batch["rollout"]`.

    For the batch's `n` prompts it samples `group_size` completions each with the current policy
    (eval mode, no grad, KV cache; seeded from `(seed, iteration, rank)`), scores them with the task,
    normalises rewards per group into clipped advantages, and computes pi_old log-probs (GRPO) and
    pi_ref log-probs (only when `kl_coef > 0`) at the sampling temperature.
    """

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: dict, batch_idx: int) -> None:
        start = time.perf_counter()
        hp = module.hparams
        task = trainer.datamodule.task
        examples = batch["examples"]
        sample = generate(
            module.policy,
            module.tokenizer,
            [task.messages(e) for e in examples],
            num_samples=hp.group_size,
            max_new_tokens=hp.max_new_tokens,
            min_new_tokens=hp.min_new_tokens,
            temperature=hp.temperature,
            top_p=hp.top_p,
            max_prompt_tokens=hp.max_prompt_tokens,
            chat_template=hp.chat_template,
            seed=derive_seed(hp.seed, batch["index"], trainer.global_rank, "sample"),
        )
        prompt_index = [i // hp.group_size for i in range(len(sample.texts))]
        scores = [task.score(text, examples[i]) for text, i in zip(sample.texts, prompt_index, strict=True)]
        device = sample.completion_ids.device
        rewards = torch.tensor([s.total for s in scores], dtype=torch.float32, device=device)
        advantages = group_advantages(rewards, hp.group_size).clamp(-hp.adv_clip, hp.adv_clip)
        eos = eos_token_ids(module.policy, module.tokenizer)
        mask = completion_mask(sample.completion_ids, eos)
        rollout = RolloutBatch(
            input_ids=torch.cat([sample.prompt_ids, sample.completion_ids], dim=1),
            attention_mask=torch.cat([sample.prompt_mask, mask.long()], dim=1),
            completion_mask=mask,
            rewards=rewards,
            advantages=advantages,
            prompt_len=sample.prompt_ids.shape[1],
            texts=sample.texts,
            prompt_index=prompt_index,
        )
        if module.needs_old_logp:
            rollout.old_logp = module.frozen_logprobs(rollout, reference=False)
        if hp.kl_coef > 0:
            rollout.ref_logp = module.frozen_logprobs(rollout, reference=True)
        batch["rollout"] = rollout
        batch["scores"] = scores
        batch["rollout_metrics"] = {
            **rollout_metrics(rollout, scores, hp.group_size, eos),
            "time/rollout": time.perf_counter() - start,
        }


def rollout_metrics(rollout: RolloutBatch, scores: list[Score], group_size: int, eos: list[int]) -> dict[str, float]:
    """Reward, reward components, group spread and completion-length statistics of one rollout."""
    rewards = rollout.rewards
    lengths = rollout.completion_mask.sum(1).float()  # [N]
    truncated = ~torch.isin(rollout.completion_ids, torch.tensor(eos, device=rewards.device)).any(1)  # no EOS
    metrics = {
        "train/reward": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/frac_zero_std_groups": settled_groups(rewards, group_size).float().mean().item(),
        "train/completion_len": lengths.mean().item(),
        "train/truncated_frac": truncated.float().mean().item(),
        "train/accuracy": sum(s.correct for s in scores) / len(scores),
    }
    for name in scores[0].components:
        metrics[f"train/reward_{name}"] = sum(s.components.get(name, 0.0) for s in scores) / len(scores)
    return metrics
