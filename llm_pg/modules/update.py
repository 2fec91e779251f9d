"""The update of one RL iteration: `epochs` shuffled passes over a rollout in micro-batches, accumulated into
clipped optimizer steps. `PolicyGradientModule.training_step` calls `run_update`; the loss is the module's.

Per pass the rows are shuffled (seeded generator), cut into micro-batches of `minibatch_size` rows, and every
`grad_accum_steps` micro-batches make one optimizer step. When a pass is one step over equal micro-batches, the
forwards take whole prompt groups instead (each prompt run once) and the loss weighs every row as its micro-batch
of the shuffled split would (`grouped_passes`): the same step. Where prefix sharing cannot apply to those forwards
(reentrant gradient checkpointing, dropout without `share_prompt_dropout`), they take rows of similar length
instead (`group_by_length`, `length_sorted`).
Each micro-batch is trimmed to its longest completion first (`RolloutBatch.trimmed`): the columns cut are padding,
masked everywhere, so the loss is unchanged.

Scaling of each micro-batch's loss before its backward:
- `seq_mean_token_mean`, `seq_mean_token_sum_norm`: divided by the micro-batches of the step, so the step's
  gradient is the mean of the micro-batch gradients (the course).
- `token_mean`: the loss is already a token sum over the step's token count (`num_tokens`, the global count under
  DDP, where the gradient average over ranks is undone by a factor `world_size`), so the step's objective is one
  mean over every completion token of the step, whatever the split into micro-batches and ranks.

pi_old from the first pass: when one optimizer step covers a whole pass (`PolicyGradientModule.first_pass_is_old`),
no weight changes before every row's first forward, so the detached log-probs of the first pass are pi_old; the
rollout then arrives without `old_logp` and this loop fills it in during the first pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from llm_pg.core.losses import entropy_bonus, split_token_counts, token_mean_share
from llm_pg.core.rollout import RolloutBatch
from llm_pg.models.parallel import is_sharded
from llm_pg.modules.distributed import average_gradients, backward_sync_off
from llm_pg.modules.logprobs import prefix_sharing_in_graph


def _all_reduce(value: float, op: torch.distributed.ReduceOp, device: torch.device) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=op)
    return float(tensor)


def steps_per_pass(rows: int, minibatch_size: int, grad_accum_steps: int) -> int:
    """Optimizer steps of one pass over `rows` rows: `ceil(ceil(rows / minibatch_size) / grad_accum_steps)`."""
    return math.ceil(math.ceil(rows / minibatch_size) / grad_accum_steps)


def clipped_step(module, optimizer) -> float:
    """Average the accumulated gradient over ranks, clip it and step, or skip (and count) when it is not finite.

    Under FSDP2 the backward passes already reduce-scattered the mean gradient into each rank's shard: no
    all-reduce here, and the clip's norm (a DTensor) is the norm of the whole gradient, equal on every rank.
    """
    params = [p for p in module.policy.parameters() if p.requires_grad]
    if not is_sharded(module.policy):
        average_gradients(params, module.trainer.world_size)  # under DDP: the mean over ranks
    norm = torch.nn.utils.clip_grad_norm_(params, module.hparams.max_grad_norm)
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if math.isfinite(norm):
        optimizer.step()
        module.optimizer_steps += 1
    else:
        module.skipped_steps += 1
    optimizer.zero_grad(set_to_none=True)
    return norm


def grouped_passes(module, rows: int, steps: int) -> bool:
    """Whether the forwards of a pass take the rows in rollout order (whole prompt groups, each prompt run once:
    `llm_pg.modules.logprobs`) rather than by micro-batch of the shuffled split.

    When a pass is one optimizer step over micro-batches of equal size (and prefix sharing is on), the step is a
    sum over rows whatever rows run together, once each row's token means are taken over its own micro-batch of the
    split (`losses.split_token_counts`, `losses.token_mean_share`): the policy term is a mean over rows, and the KL term
    and the logged token means divide each row's token sum by its micro-batch's token count. The shuffled split
    is still drawn, so the step is the course's, float rounding apart.
    """
    hp = module.hparams
    return hp.share_prompt_prefix and steps == 1 and rows % hp.minibatch_size == 0


def length_sorted(module, rollout: RolloutBatch) -> bool:
    """Whether a grouped pass's forwards take rows by length (`group_by_length`) rather than whole prompt groups:
    when prefix sharing cannot apply to a forward that builds a graph (reentrant gradient checkpointing, dropout
    without `share_prompt_dropout`), grouping by prompt saves nothing, and rows of similar length waste the least
    padding (`logprobs.packed_layout`)."""
    hp = module.hparams
    return hp.group_by_length and not prefix_sharing_in_graph(
        module.policy, hp.share_prompt_prefix, hp.share_prompt_dropout
    )


def forward_rows(rollout: RolloutBatch, minibatch_size: int, by_length: bool) -> list[Tensor]:
    """The rows of each forward of a grouped pass: rollout order, or by total real tokens, longest first."""
    order = torch.arange(len(rollout))
    if by_length:
        order = torch.sort(rollout.attention_mask.sum(1).cpu(), descending=True, stable=True).indices
    return [order[start : start + minibatch_size] for start in range(0, len(rollout), minibatch_size)]


def _step_tokens(module, rollout: RolloutBatch, group: list[Tensor]) -> float:
    """Completion tokens of the step's micro-batches (`token_mean`), summed over ranks under DDP."""
    tokens = float(sum(int(rollout.completion_mask[index].sum()) for index in group))
    if module.trainer.world_size > 1:
        tokens = _all_reduce(tokens, torch.distributed.ReduceOp.SUM, module.device)
    return max(tokens, 1.0)


def run_update(module, rollout: RolloutBatch, shuffle: torch.Generator) -> tuple[dict[str, float], list[float], float]:
    """Train on `rollout`; returns the per-micro-batch means of the loss stats, each step's gradient norm, and the
    largest ratio seen. A rollout with no rows makes no optimizer step."""
    hp = module.hparams
    optimizer = module.optimizers()
    token_mean = hp.loss_aggregation == "token_mean"
    bonus = hp.entropy_coef > 0  # the entropy then carries its gradient
    world = module.trainer.world_size
    old_from_first_pass = module.needs_pi_old and rollout.old_logp is None
    if old_from_first_pass:
        rollout.old_logp = torch.zeros(rollout.completion_mask.shape, device=rollout.input_ids.device)  # [N, C]
    steps = steps_per_pass(len(rollout), hp.minibatch_size, hp.grad_accum_steps)
    if old_from_first_pass and steps > 1:  # a later micro-batch of the first pass would see weights already stepped
        raise RuntimeError(
            "the rollout has no old_logp, and a pass makes several optimizer steps: compute pi_old first"
        )
    totals: dict[str, float] = {}
    ratio_max, grad_norms, micro_count = 0.0, [], 0
    grouped = grouped_passes(module, len(rollout), steps)
    by_length = grouped and length_sorted(module, rollout)
    for epoch in range(module.epochs):
        order = torch.randperm(len(rollout), generator=shuffle)  # the split: which rows share a micro-batch
        micro = [order[start : start + hp.minibatch_size] for start in range(0, len(rollout), hp.minibatch_size)]
        if grouped:  # the same step, computed over forwards of whole prompt groups
            rollout.split_tokens = split_token_counts(rollout.completion_mask, micro)
            micro = forward_rows(rollout, hp.minibatch_size, by_length)
        for step in range(steps):
            group = micro[step * hp.grad_accum_steps : (step + 1) * hp.grad_accum_steps]
            num_tokens = _step_tokens(module, rollout, group) if token_mean else None
            for index in group:
                part = rollout.select(index).trimmed()
                logp, entropy = module.completion_logprobs(module.policy, part, True, bonus)  # [b, w]
                if old_from_first_pass and epoch == 0:
                    part.old_logp = logp.detach()
                    rollout.old_logp[index.to(logp.device), : logp.shape[1]] = part.old_logp
                loss, stats = module.loss(logp, part, num_tokens)
                if bonus:  # loss - entropy_coef * tokmean(H)
                    mask, aggregation = part.completion_mask, hp.loss_aggregation
                    term = entropy_bonus(entropy, mask, hp.entropy_coef, aggregation, num_tokens, part.split_tokens)
                    loss, stats["entropy_bonus"], entropy = loss - term, term.detach(), entropy.detach()
                with backward_sync_off(module.trainer):  # gradients are averaged once, per step
                    # Default: divide by the micro-batches actually accumulated, so a short last group is a mean too.
                    module.manual_backward(loss * world if token_mean else loss / len(group))
                entropy = token_mean_share(entropy, part.completion_mask, part.split_tokens)
                stats = {"loss": loss.detach(), "entropy": entropy, **stats}
                if token_mean:  # log the step's objective, not this micro-batch's (or this rank's) share of it
                    share = len(group) * world  # sync_dist averages over ranks: undo the per-rank token share too
                    stats["loss"], stats["policy_loss"] = stats["loss"] * share, stats["policy_loss"] * share
                    if bonus:
                        stats["entropy_bonus"] = stats["entropy_bonus"] * share
                ratio_max = max(ratio_max, float(stats.pop("ratio_max", 1.0)))
                for name, value in stats.items():
                    totals[name] = totals.get(name, 0.0) + float(value)
                micro_count += 1
            grad_norms.append(clipped_step(module, optimizer))
    return {name: value / max(micro_count, 1) for name, value in totals.items()}, grad_norms, ratio_max
