"""RolloutCallback: samples, scores and packs one rollout (`RolloutBatch`) before each training step."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from llm_pg.data.tasks.base import Score
from llm_pg.generation import eos_token_ids, generate
from llm_pg.losses import completion_mask, group_advantages, settled_groups
from llm_pg.rollout import RolloutBatch, derive_seed


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
