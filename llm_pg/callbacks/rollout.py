"""RolloutCallback: samples, scores and builds one rollout before each training step, handed over as a
`ScoredRollout` (the `RolloutBatch`, its scores and its metrics) on the batch (`PromptBatch.rollout`).

What every rollout of a fit needs is one `RolloutContext`, built once by the module
(`PolicyGradientModule.rollout_context`): the sampler, the sampling settings, the rollout-side variants, the ranks,
and which no-grad log-prob passes run. The `RolloutBatch` is built complete here (advantages, masks, pi_ref and,
where a no-grad pass makes it, pi_old) and is immutable afterwards.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from llm_pg.core.advantages import clipped_advantages, overlong_penalty, settled_groups, truncated_rows, unsettled_rows
from llm_pg.core.rollout import RolloutBatch, concat_rollouts, derive_seed
from llm_pg.data.batches import PromptBatch, ScoredRollout
from llm_pg.data.tasks.base import Example, Score
from llm_pg.engines.episodes import Sampler, episode_sums
from llm_pg.models.generation import Generation, PromptTooLong, Sampling
from llm_pg.runs.guards import FlatRollouts, Ranks, RunStopped, prompt_stop, scores_or_stop, stop_together


@dataclass(frozen=True)
class Variants:
    """The rollout-side options (docs/algorithms.md, "Variants"), applied in this order by `apply_variants`: drop
    settled groups (`filter_zero_std_groups`, DAPO's dynamic sampling; `max_sampling_rounds` > 1 refills), the
    advantage estimator over groups of `group_size` clipped to +-`adv_clip`, and the truncated rows masked
    (`mask_truncated`); `overlong_buffer` > 0 adds DAPO's soft overlong punishment to every reward first."""

    group_size: int
    advantage: str = "grpo"
    adv_clip: float = 5.0
    filter_zero_std_groups: bool = False
    max_sampling_rounds: int = 1
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


class OldPass(Enum):
    """When the rollout runs the no-grad pass that makes pi_old."""

    ALWAYS = "always"  # GRPO, unless its update takes pi_old from its first pass
    WITH_ENGINE_LOGPROBS = "with_engine_logprobs"  # REINFORCE: only to compare with the engine's own log-probs
    NEVER = "never"  # the update takes pi_old from its first pass


@dataclass(frozen=True)
class RolloutContext:
    """What every rollout of a fit needs, built once by the module (`PolicyGradientModule.rollout_context`).

    Args:
        sampler: prompts to completions (`llm_pg.engines.episodes.Sampler`), and the task's scorer.
        sampling: the rollout's sampling settings.
        variants: the rollout-side options.
        prompts_per_step: prompts per iteration on this rank.
        seed: the run's seed; with the iteration and this rank (`ranks.rank`) it seeds each sampling round.
        ranks: this process's rank, and the ranks a failure must stop together.
        pad: the pad id (`llm_pg.models.generation.pad_token_id`).
        pi_old: the no-grad pass of the policy that makes pi_old (`LogProbs.no_grad`).
        pi_ref: the no-grad pass of the reference, or None (`kl_coef` 0).
        old_pass: when the rollout runs `pi_old` (`OldPass`).
    """

    sampler: Sampler
    sampling: Sampling
    variants: Variants
    prompts_per_step: int
    seed: int
    ranks: Ranks
    pad: int
    pi_old: Callable[[RolloutBatch], Tensor]
    pi_ref: Callable[[RolloutBatch], Tensor] | None = None
    old_pass: OldPass = OldPass.NEVER


def with_component(scores: list[Score], name: str, values: list[float]) -> list[Score]:
    """Each score with one more reward component `name` (`values[i]` for row i), added to its total."""
    return [Score(s.total + v, s.correct, {**s.components, name: v}) for s, v in zip(scores, values, strict=True)]


def reduced(trainer: L.Trainer, value: int, op: str) -> int:
    """`value` reduced over the ranks with `op` (`max` or `min`); itself on one process."""
    if trainer.world_size == 1:
        return value
    return int(trainer.strategy.reduce(torch.tensor(float(value), device=trainer.strategy.root_device), reduce_op=op))


class RolloutCallback(Callback):
    """Samples, scores and builds one rollout before each training step and attaches it to the batch
    (`PromptBatch.rollout`, a `ScoredRollout`).

    For the `n` prompts of the dataloader's batch (the data stream's batch at its position) it samples `group_size`
    completions each with the current policy through the module's rollout engine (`module.engine`: HF generate in
    eval mode, no grad, KV cache, or vLLM; seeded from `(seed, iteration, rank)`), and scores them with the task.
    With `filter_zero_std_groups` and `max_sampling_rounds` > 1 (DAPO's dynamic sampling with refill), while fewer
    than `n` groups have reward spread it samples the stream's following batch too (round `k` seeded from `(seed,
    iteration, rank, k)`), up to `max_sampling_rounds` batches; the update then keeps the first `n` groups with
    spread. Under DDP every rank runs as many rounds as the rank that needs the most, and every rank keeps the same
    number of groups: the fewest any rank has (a rank with more leaves its extra groups out), so the ranks make the
    same gradient all-reduces.

    Then it applies the rollout-side variants (`apply_variants`: group filtering, the advantage estimator and its
    clip, masking of truncated rows), and computes pi_old log-probs (GRPO, unless the first training pass provides
    them: `pi_old_from_first_pass`) and pi_ref log-probs (only when `kl_coef > 0`) at `logprob_temperature` (raw
    logits by default, as the course). An engine that reports its own sampled-token log-probs (vLLM) has them kept
    as `sampled_logp`; REINFORCE, which has no pi_old, then gets one no-grad pass of the sampling policy
    (`old_logp`, unused by its loss) so that `llm_pg.engines.logprob_mismatch` has the trainer's side to compare with.
    """

    def __init__(self) -> None:
        self.context: RolloutContext | None = None  # the fit's, built at its first rollout
        self.flat = FlatRollouts()  # warns after rollouts in a row without any advantage

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: PromptBatch, batch_idx: int
    ) -> None:
        start = time.perf_counter()
        if self.context is None:
            self.context = module.rollout_context(trainer.datamodule)
        context, variants = self.context, self.context.variants
        engine, iteration = module.engine, module.iteration  # the engine holds this iteration's weights
        datamodule = trainer.datamodule
        first = datamodule.next_batch  # the stream's first unused batch
        refill = variants.filter_zero_std_groups and variants.max_sampling_rounds > 1
        parts: list[RolloutBatch] = []
        scores: list[Score] = []
        examples: list[Example] = []
        sampling_seconds, spread = 0.0, 0
        for round_ in range(1, variants.max_sampling_rounds + 1):
            position = first + round_ - 1
            drawn = batch.examples if batch.index == position else datamodule.prompt_batch(position).examples
            seed = derive_seed(context.seed, iteration, context.ranks.rank, "sample", *([round_] if round_ > 1 else []))
            part, part_scores, seconds = sample_round(context, engine, drawn, seed, len(examples), iteration + 1)
            parts.append(part)
            scores += part_scores
            examples += drawn
            sampling_seconds += seconds
            spread += int((~settled_groups(part.rewards, variants.group_size)).sum())
            if not refill or not reduced(trainer, int(spread < context.prompts_per_step), "max"):
                break
        rollout = concat_rollouts(parts, context.pad)
        eos = context.sampler.eos
        metrics = rollout_metrics(rollout, scores, variants.group_size, eos, sampling_seconds)
        flat = (metrics[f"train/{name}"] for name in ("frac_zero_std_groups", "reward", "accuracy"))
        message = self.flat.update(iteration + 1, *flat)
        if message:
            rank_zero_warn(message)
        kept = None
        if variants.filter_zero_std_groups:
            kept = reduced(trainer, min(spread, context.prompts_per_step), "min")
        rollout, scores, variant_metrics = apply_variants(rollout, scores, variants, eos, kept)
        if variants.filter_zero_std_groups:
            variant_metrics["train/sampling_rounds"] = float(len(parts))
            variant_metrics["train/prompts_drawn"] = float(len(examples))
            variant_metrics["train/groups_kept"] = float(kept)
        rollout = with_logprobs(context, rollout)
        metrics |= variant_metrics | {"time/rollout": time.perf_counter() - start}
        batch.rollout = ScoredRollout(rollout, scores, metrics, examples, first + len(parts) - 1)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.context = None  # a context is one fit's
        self.flat = FlatRollouts()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(module.device)

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs, batch: PromptBatch, batch_idx: int
    ) -> None:
        """The iteration is trained: the data stream moves past the batches its rollout used
        (`PromptGroupDataModule.mark_consumed`; the next checkpoint saves that position). This callback is the
        cursor's one owner: it reads it before the rollout and moves it here.

        Then `memory/peak_gb` on a GPU: `torch.cuda.max_memory_allocated` since the previous iteration's reading
        (this iteration's rollout and update, and the evaluation that ended the previous one), the max over ranks."""
        if batch.rollout is not None:
            trainer.datamodule.mark_consumed(batch.rollout.last_batch)
        if module.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(module.device) / 2**30
        module.log(
            "memory/peak_gb", peak, on_step=True, on_epoch=False, sync_dist=trainer.world_size > 1, reduce_fx="max"
        )
        torch.cuda.reset_peak_memory_stats(module.device)


def with_logprobs(context: RolloutContext, rollout: RolloutBatch) -> RolloutBatch:
    """`rollout` with the no-grad log-probs the context asks for: pi_old (`old_pass`) and pi_ref (`pi_ref`)."""
    if not len(rollout):
        return rollout
    old = context.old_pass is OldPass.ALWAYS or (
        context.old_pass is OldPass.WITH_ENGINE_LOGPROBS and rollout.sampled_logp is not None
    )
    old_logp = context.pi_old(rollout) if old else None
    ref_logp = context.pi_ref(rollout) if context.pi_ref is not None else None
    return dataclasses.replace(rollout, old_logp=old_logp, ref_logp=ref_logp)


def sample_round(
    context: RolloutContext, engine, examples: list[Example], seed: int, first_prompt: int, iteration: int
) -> tuple[RolloutBatch, list[Score], float]:
    """`group_size` completions of each of `examples`, sampled by `engine` with `seed` and scored (finite rewards,
    or the run stops, naming the row; plus the overlong punishment when `overlong_buffer` > 0) in `iteration`
    (1-based): the `RolloutBatch` (no advantages yet; prompts numbered from `first_prompt`), the scores, and the
    seconds the generation alone took."""
    variants = context.variants
    start = time.perf_counter()
    where = f"iteration {iteration}'s rollout"
    failure = None
    try:
        sample = context.sampler(
            engine, examples, context.sampling, num_samples=variants.group_size, seed=seed, where=where
        )
    except PromptTooLong as error:
        failure = prompt_stop(error, examples, where)
    except RunStopped as stop:  # a tool of a tool task failed
        failure = stop
    stop_together(context.ranks, failure, where)  # under DDP the other ranks stop too, instead of waiting
    seconds = time.perf_counter() - start
    local_index = [i // variants.group_size for i in range(len(sample.texts))]
    rows = [examples[i] for i in local_index]
    scores = scores_or_stop(context.ranks, context.sampler.scorer, sample.texts, rows, iteration)
    mask, attention = sample.completion_mask, sample.completion_attention  # the engine's: never re-inferred here
    if variants.overlong_buffer > 0:  # DAPO's soft overlong punishment, a reward component of every task
        lengths = attention.sum(1)  # [N] tokens up to and including EOS (an episode's: its whole region)
        penalty = overlong_penalty(
            lengths, context.sampling.max_new_tokens, variants.overlong_buffer, variants.overlong_penalty
        )
        scores = with_component(scores, "overlong", penalty.tolist())
    rewards = torch.tensor([s.total for s in scores], dtype=torch.float32, device=sample.completion_ids.device)
    rollout = RolloutBatch(
        input_ids=torch.cat([sample.prompt_ids, sample.completion_ids], dim=1),
        attention_mask=torch.cat([sample.prompt_mask, attention.long()], dim=1),
        completion_mask=mask,
        rewards=rewards,
        prompt_len=sample.prompt_ids.shape[1],
        texts=sample.texts,
        prompt_index=[first_prompt + i for i in local_index],
        sampled_logp=sample.sampled_logp,
        **(episode_fields(sample) if sample.episodes else {}),
    )
    return rollout, scores, seconds


def episode_fields(sample: Generation) -> dict:
    """The per-row episode statistics a `RolloutBatch` carries, on the rollout's device."""
    device = sample.completion_ids.device
    fields = {name: getattr(sample, name).to(device) for name in ("truncated", "turns", "tool_calls", "tool_errors")}
    kinds = None if sample.tool_error_kinds is None else sample.tool_error_kinds.to(device)
    return fields | {"transcripts": sample.transcripts, "calls": sample.calls, "tool_error_kinds": kinds}


def row_truncated(rollout: RolloutBatch, eos: list[int]) -> Tensor:
    """`[N]` bool: rows whose completion ran out of tokens (an episode's last turn; else no EOS at all)."""
    return rollout.truncated if rollout.truncated is not None else truncated_rows(rollout.completion_ids, eos)


def apply_variants(
    rollout: RolloutBatch, scores: list[Score], variants: Variants, eos: list[int], max_groups: int | None = None
) -> tuple[RolloutBatch, list[Score], dict[str, float]]:
    """The rollout-side options, in order: drop settled groups (`filter_zero_std_groups`, DAPO dynamic sampling;
    then keep at most the first `max_groups`),
    compute the advantages of the rows left (`advantage`, then clipped to +-`adv_clip`), and zero the completion
    mask of rows that end without an EOS (`mask_truncated`, DAPO overlong filtering). Returns the rollout, the
    scores of its rows, and metrics: `train/advantage_abs_mean` and the counts of what the options removed (only for
    options that are on)."""
    metrics: dict[str, float] = {}
    if variants.filter_zero_std_groups:
        keep, settled = unsettled_rows(rollout.rewards, variants.group_size, max_groups)
        rollout = rollout.select(keep)
        scores = [scores[i] for i in keep.tolist()]
        metrics["train/filtered_groups"] = float(settled)
    advantages = torch.zeros_like(rollout.rewards)
    if len(rollout):
        advantages = clipped_advantages(rollout.rewards, variants.group_size, variants.advantage, variants.adv_clip)
    # Mean |A| over the rows the update sees: how much signal the rollout carries (0 when every group is settled).
    metrics["train/advantage_abs_mean"] = advantages.abs().mean().item() if len(rollout) else 0.0
    mask = rollout.completion_mask
    if variants.mask_truncated:
        truncated = row_truncated(rollout, eos)
        mask = mask & ~truncated.unsqueeze(1)  # [N, C]
        metrics["train/masked_truncated"] = float(truncated.sum())
    return dataclasses.replace(rollout, advantages=advantages, completion_mask=mask), scores, metrics


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
        sums = episode_sums(rollout.turns, rollout.tool_calls, rollout.tool_errors, rollout.tool_error_kinds)
        metrics |= {f"train/{name}": value / len(rollout) for name, value in sums.items()}
        metrics["train/context_len"] = rollout.attention_mask.sum(1).float().mean().item()
    return metrics
