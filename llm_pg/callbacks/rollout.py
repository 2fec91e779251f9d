"""RolloutCallback: samples, scores and packs one rollout before each training step, handed over as a
`ScoredRollout` (the `RolloutBatch`, its scores and its metrics) under the batch's `"rollout"` key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from llm_pg.core.losses import completion_mask, overlong_penalty, settled_groups
from llm_pg.core.rollout import RolloutBatch, concat_rollouts, derive_seed
from llm_pg.core.variants import clipped_advantages, truncated_rows, unsettled_rows
from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.engines.episodes import EpisodeGeneration, episode_sums, generate_for
from llm_pg.engines.vllm import VLLMGeneration
from llm_pg.models.generation import PromptTooLong, eos_token_ids
from llm_pg.runs.guards import RunStopped, prompt_stop, scorer_of, scores_or_stop, stop_together


@dataclass
class ScoredRollout:
    """One iteration's rollout as `training_step` receives it: the rows the update trains on (`rows`, after the
    rollout-side variants), the task's score of each of them (`scores`, same order), the rollout's metrics
    (`metrics`: `train/reward...`, lengths, the variants' counts, `time/rollout`), logged with the update's, the
    prompts sampled (`examples`, indexed by `rows.prompt_index`; several batches with dynamic sampling's refill) and
    the last stream batch they came from (`last_batch`: the data module's position is `last_batch + 1` once the
    iteration is done)."""

    rows: RolloutBatch
    scores: list[Score]
    metrics: dict[str, float] = field(default_factory=dict)
    examples: list[Example] = field(default_factory=list)
    last_batch: int = 0


def with_component(scores: list[Score], name: str, values: list[float]) -> list[Score]:
    """Each score with one more reward component `name` (`values[i]` for row i), added to its total."""
    return [Score(s.total + v, s.correct, {**s.components, name: v}) for s, v in zip(scores, values, strict=True)]


def reduced(trainer: L.Trainer, value: int, op: str) -> int:
    """`value` reduced over the ranks with `op` (`max` or `min`); itself on one process."""
    if trainer.world_size == 1:
        return value
    return int(trainer.strategy.reduce(torch.tensor(float(value), device=trainer.strategy.root_device), reduce_op=op))


class RolloutCallback(Callback):
    """Samples and scores one rollout before each training step and attaches it as `batch["rollout"]`, a
    `ScoredRollout`.

    For the `n` prompts of the data stream's next batch (`PromptGroupDataModule.prompt_batch` at its position: the
    dataloader only paces the loop) it samples `group_size` completions each with the current policy through the
    module's rollout engine (`module.engine`: HF generate in eval mode, no grad, KV cache, or vLLM; seeded from
    `(seed, iteration, rank)`), and scores them with the task. With `filter_zero_std_groups` and
    `max_sampling_rounds` > 1 (DAPO's dynamic sampling with refill), while fewer than `n` groups have reward spread
    it samples the stream's following batch too (round `k` seeded from `(seed, iteration, rank, k)`), up to
    `max_sampling_rounds` batches; the update then keeps the first `n` groups with spread. Under DDP every rank runs
    as many rounds as the rank that needs the most, and every rank keeps the same number of groups: the fewest any
    rank has (a rank with more leaves its extra groups out), so the ranks make the same gradient all-reduces.

    Then it applies the rollout-side variants (`apply_variants`: group filtering, the advantage estimator and its
    clip, masking of truncated rows), and computes pi_old log-probs (GRPO, unless the first training pass provides
    them: `pi_old_from_first_pass`) and pi_ref log-probs (only when `kl_coef > 0`) at `logprob_temperature` (raw
    logits by default, as the course). An engine that reports its own sampled-token log-probs (vLLM) has them kept
    as `sampled_logp`; REINFORCE, which has no pi_old, then gets one no-grad pass of the sampling policy
    (`old_logp`, unused by its loss) so that `llm_pg.engines.logprob_mismatch` has the trainer's side to compare with.
    """

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: dict, batch_idx: int) -> None:
        start = time.perf_counter()
        hp = module.hparams
        datamodule = trainer.datamodule
        eos = eos_token_ids(module.policy, module.tokenizer)
        first = datamodule.next_batch  # the stream's first unused batch
        refill = hp.filter_zero_std_groups and hp.max_sampling_rounds > 1
        parts: list[RolloutBatch] = []
        scores: list[Score] = []
        examples: list[Example] = []
        sampling_seconds, spread = 0.0, 0
        for round_ in range(1, hp.max_sampling_rounds + 1):
            drawn = datamodule.prompt_batch(first + round_ - 1)
            seed = derive_seed(
                hp.seed, module.iteration, trainer.global_rank, "sample", *([round_] if round_ > 1 else [])
            )
            part, part_scores, seconds = sample_round(module, datamodule.task, drawn, seed, eos, len(examples))
            parts.append(part)
            scores += part_scores
            examples += drawn
            sampling_seconds += seconds
            spread += int((~settled_groups(part.rewards, hp.group_size)).sum())
            if not refill or not reduced(trainer, int(spread < hp.prompts_per_step), "max"):
                break
        pad = module.tokenizer.pad_token_id if module.tokenizer.pad_token_id is not None else eos[0]
        rollout = concat_rollouts(parts, pad)
        metrics = rollout_metrics(rollout, scores, hp.group_size, eos, sampling_seconds)
        kept = reduced(trainer, min(spread, hp.prompts_per_step), "min") if hp.filter_zero_std_groups else None
        rollout, scores, variant_metrics = apply_variants(rollout, scores, hp, eos, kept)
        if hp.filter_zero_std_groups:
            variant_metrics["train/sampling_rounds"] = float(len(parts))
            variant_metrics["train/prompts_drawn"] = float(len(examples))
            variant_metrics["train/groups_kept"] = float(kept)
        if len(rollout) and module.needs_pi_old and not module.pi_old_from_first_pass:
            rollout.old_logp = module.old_logprobs(rollout)
        elif len(rollout) and not module.needs_pi_old and rollout.sampled_logp is not None:
            rollout.old_logp = module.old_logprobs(rollout)  # REINFORCE: for the mismatch only
        if len(rollout) and hp.kl_coef > 0:
            rollout.ref_logp = module.reference_logprobs(rollout)
        metrics |= variant_metrics | {"time/rollout": time.perf_counter() - start}
        batch["rollout"] = ScoredRollout(rollout, scores, metrics, examples, first + len(parts) - 1)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(module.device)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        """`memory/peak_gb` on a GPU: `torch.cuda.max_memory_allocated` since the previous iteration's reading (this
        iteration's rollout and update, and the evaluation that ended the previous one), the max over ranks."""
        if module.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(module.device) / 2**30
        module.log(
            "memory/peak_gb", peak, on_step=True, on_epoch=False, sync_dist=trainer.world_size > 1, reduce_fx="max"
        )
        torch.cuda.reset_peak_memory_stats(module.device)


def sample_round(
    module: L.LightningModule, task: Task, examples: list[Example], seed: int, eos: list[int], first_prompt: int
) -> tuple[RolloutBatch, list[Score], float]:
    """`group_size` completions of each of `examples`, sampled with `seed` and scored (finite rewards, or the run
    stops, naming the row; plus the overlong punishment when `overlong_buffer` > 0): the `RolloutBatch` (advantages
    still 0; prompts numbered from `first_prompt`), the scores, and the seconds the generation alone took."""
    hp = module.hparams
    start = time.perf_counter()
    where = f"iteration {module.iteration_in_progress}'s rollout"
    failure = None
    try:
        sample = generate_for(
            module,
            task,
            examples,
            module.sampling(),
            num_samples=hp.group_size,
            seed=seed,
            where=where,
        )
    except PromptTooLong as error:
        failure = prompt_stop(error, examples, where)
    except RunStopped as stop:  # a tool of a tool task failed
        failure = stop
    stop_together(module, failure, where)  # under DDP the other ranks stop too, instead of waiting in a collective
    seconds = time.perf_counter() - start
    local_index = [i // hp.group_size for i in range(len(sample.texts))]
    rows = [examples[i] for i in local_index]
    scores = scores_or_stop(module, scorer_of(module, task), sample.texts, rows, module.iteration_in_progress)
    episodes = isinstance(sample, EpisodeGeneration)
    if episodes:  # the masks come with the episodes: never inferred from ids
        mask, attention = sample.loss_mask, sample.attention
    else:
        mask = completion_mask(sample.completion_ids, eos)
        attention = mask.long()
    if hp.overlong_buffer > 0:  # DAPO's soft overlong punishment, a reward component of every task
        lengths = attention.sum(1)  # [N] tokens up to and including EOS (an episode's: its whole region)
        penalty = overlong_penalty(lengths, hp.max_new_tokens, hp.overlong_buffer, hp.overlong_penalty)
        scores = with_component(scores, "overlong", penalty.tolist())
    rewards = torch.tensor([s.total for s in scores], dtype=torch.float32, device=sample.completion_ids.device)
    sampled = sample.sampled_logprobs if isinstance(sample, VLLMGeneration | EpisodeGeneration) else None
    rollout = RolloutBatch(
        input_ids=torch.cat([sample.prompt_ids, sample.completion_ids], dim=1),
        attention_mask=torch.cat([sample.prompt_mask, attention.long()], dim=1),
        completion_mask=mask,
        rewards=rewards,
        advantages=torch.zeros_like(rewards),  # set by apply_variants, on the rows that are kept
        prompt_len=sample.prompt_ids.shape[1],
        texts=sample.texts,
        prompt_index=[first_prompt + i for i in local_index],
        sampled_logp=sampled,
        **(episode_fields(sample) if episodes else {}),
    )
    return rollout, scores, seconds


def episode_fields(sample: EpisodeGeneration) -> dict:
    """The per-row episode statistics a `RolloutBatch` carries, on the rollout's device."""
    device = sample.completion_ids.device
    fields = {name: getattr(sample, name).to(device) for name in ("truncated", "turns", "tool_calls", "tool_errors")}
    return fields | {"transcripts": sample.transcripts}


def row_truncated(rollout: RolloutBatch, eos: list[int]) -> Tensor:
    """`[N]` bool: rows whose completion ran out of tokens (an episode's last turn; else no EOS at all)."""
    return rollout.truncated if rollout.truncated is not None else truncated_rows(rollout.completion_ids, eos)


def apply_variants(
    rollout: RolloutBatch, scores: list[Score], hp, eos: list[int], max_groups: int | None = None
) -> tuple[RolloutBatch, list[Score], dict[str, float]]:
    """The rollout-side options, in order: drop settled groups (`filter_zero_std_groups`, DAPO dynamic sampling;
    then keep at most the first `max_groups`),
    compute the advantages of the rows left (`advantage`, then clipped to +-`adv_clip`), and zero the completion
    mask of rows that end without an EOS (`mask_truncated`, DAPO overlong filtering). Returns the rollout, the
    scores of its rows, and metrics: `train/advantage_abs_mean` and the counts of what the options removed (only for
    options that are on)."""
    metrics: dict[str, float] = {}
    if hp.filter_zero_std_groups:
        keep, settled = unsettled_rows(rollout.rewards, hp.group_size, max_groups)
        rollout = rollout.select(keep)
        scores = [scores[i] for i in keep.tolist()]
        metrics["train/filtered_groups"] = float(settled)
    if len(rollout):
        rollout.advantages = clipped_advantages(rollout.rewards, hp.group_size, hp.advantage, hp.adv_clip)
    # Mean |A| over the rows the update sees: how much signal the rollout carries (0 when every group is settled).
    metrics["train/advantage_abs_mean"] = rollout.advantages.abs().mean().item() if len(rollout) else 0.0
    if hp.mask_truncated:
        truncated = row_truncated(rollout, eos)
        rollout.completion_mask = rollout.completion_mask & ~truncated.unsqueeze(1)  # [N, C]
        metrics["train/masked_truncated"] = float(truncated.sum())
    return rollout, scores, metrics


def rollout_metrics(
    rollout: RolloutBatch,
    scores: list[Score],
    group_size: int,
    eos: list[int],
    sampling_seconds: float | None = None,
) -> dict[str, float]:
    """Reward, reward components, group spread and completion-length statistics of one rollout (all `N` rows,
    before any variant drops or masks some).

    Lengths are completion tokens up to and including the first EOS (the completion mask); a row is truncated when
    it holds no EOS at all (it reached `max_new_tokens`). Stds are population stds over the `N` rows (as
    `train/reward_std`). `time/tokens_per_s` = the rollout's completion tokens / `sampling_seconds` (generation
    alone, without scoring or log-prob passes), when given.
    """
    rewards = rollout.rewards
    lengths = rollout.completion_mask.sum(1).float()  # [N]
    truncated = row_truncated(rollout, eos)  # [N]: no EOS
    metrics = {
        "train/reward": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/frac_zero_std_groups": settled_groups(rewards, group_size).float().mean().item(),
        "train/completion_len": lengths.mean().item(),
        "train/completion_len_min": lengths.min().item(),
        "train/completion_len_max": lengths.max().item(),
        "train/truncated_frac": truncated.float().mean().item(),
        "train/accuracy": sum(s.correct for s in scores) / len(scores),
    }
    for name in scores[0].components:
        values = torch.tensor([float(s.components.get(name, 0.0)) for s in scores], dtype=torch.float64)  # [N]
        metrics[f"train/reward_{name}"] = sum(s.components.get(name, 0.0) for s in scores) / len(scores)
        metrics[f"train/reward_{name}_std"] = values.std(unbiased=False).item()
    if sampling_seconds is not None and sampling_seconds > 0:
        metrics["time/tokens_per_s"] = lengths.sum().item() / sampling_seconds
    if rollout.turns is not None:  # a tool task's episodes: means per row, and the context the last turn saw
        sums = episode_sums(rollout.turns, rollout.tool_calls, rollout.tool_errors)
        metrics |= {f"train/{name}": value / len(rollout) for name, value in sums.items()}
        metrics["train/context_len"] = rollout.attention_mask.sum(1).float().mean().item()
    return metrics
