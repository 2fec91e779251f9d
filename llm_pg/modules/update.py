"""The update of one RL iteration: `epochs` shuffled passes over a rollout in micro-batches, accumulated into
clipped optimizer steps. `PolicyGradientModule.training_step` calls `run_update` with the fit's `UpdateContext`
(built once by the module: its settings, the policy, the log-prob function, the objective and the backward); the
loss of each micro-batch is the objective's (`llm_pg.core.objectives`).

Per pass the rows are shuffled (seeded generator), cut into micro-batches of `minibatch_size` rows, and every
`grad_accum_steps` micro-batches make one optimizer step. When a pass is one step over equal micro-batches, the
forwards take whole prompt groups instead (each prompt run once) and the loss weighs every row as its micro-batch
of the shuffled split would (`grouped_passes`): the same step. Where prefix sharing cannot apply to those forwards
(reentrant gradient checkpointing, dropout without `speed.share_prompt_dropout`), they take rows of similar length
instead (`speed.group_by_length`, `forward_rows`).
Each micro-batch is trimmed to its longest completion first (`RolloutBatch.trimmed`): the columns cut are padding,
masked everywhere, so the loss is unchanged.

Scaling of each micro-batch's loss before its backward:
- `seq_mean_token_mean`, `seq_mean_token_sum_norm`: divided by the micro-batches of the step, so the step's
  gradient is the mean of the micro-batch gradients (the course).
- `token_mean`: the loss is already a token sum over the step's token count (`num_tokens`, the global count under
  DDP, where the gradient average over ranks is undone by a factor `world_size`), so the step's objective is one
  mean over every completion token of the step, whatever the split into micro-batches and ranks.

pi_old from the first pass: when one optimizer step covers a whole pass (`PolicyGradientModule.pi_old_from_first_pass`),
no weight changes before every row's first forward, so the detached log-probs of the first pass are pi_old; the
rollout then arrives without `old_logp` and this loop keeps it in its own state (`UpdateState.old_logp`), never in
the rollout, which is immutable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from llm_pg.core.losses import split_token_counts
from llm_pg.core.objectives import Objective
from llm_pg.core.rollout import MicroBatch, RolloutBatch
from llm_pg.modules.distributed import average_gradients
from llm_pg.modules.logprobs import LogProbs


@dataclass(frozen=True)
class UpdateContext:
    """What the update of every iteration of a fit needs, built once by the module (`PolicyGradientModule.update`).

    Args:
        policy: the trained model.
        logprobs: how its completion log-probs are computed.
        objective: the loss of a micro-batch.
        epochs: passes over each rollout (GRPO's `ppo_epochs`; 1 for REINFORCE).
        minibatch_size: rows per micro-batch of the shuffled split.
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: the gradient-norm clip of each step.
        grouped: a pass that is one optimizer step over equal micro-batches may run its forwards over whole prompt
            groups (`speed.share_prompt_prefix`; `grouped_passes`).
        by_length: such forwards take rows of similar length instead of whole groups (`forward_rows`).
        world_size: data-parallel ranks (token counts and gradients are reduced over them).
        sharded: the policy is sharded by FSDP2 (its backward already averages the gradient).
        backward: the backward of a loss (Lightning's `manual_backward`).
        no_sync: a context in which a backward does not all-reduce (DDP's reducer off; else nothing).
    """

    policy: torch.nn.Module
    logprobs: LogProbs
    objective: Objective
    epochs: int
    minibatch_size: int
    grad_accum_steps: int
    max_grad_norm: float
    grouped: bool
    by_length: bool
    world_size: int = 1
    sharded: bool = False
    backward: Callable[[Tensor], None] = Tensor.backward
    no_sync: Callable[[], AbstractContextManager] = nullcontext


@dataclass
class UpdateState:
    """What one update derives for itself, never written back into the rollout: pi_old of every row `[N, C]`
    (the rollout's, or taken from the first pass), the metric sums over micro-batches, the largest ratio, and each
    step's gradient norm."""

    old_logp: Tensor | None
    totals: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 0
    ratio_max: float = 0.0
    grad_norms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class UpdateResult:
    """What an update reports: the per-micro-batch means of the objective's metrics, each step's gradient norm (a
    non-finite one: the step was skipped), the steps taken and skipped, the largest ratio, and pi_old `[N, C]` (the
    sampler-health figures compare the engine's log-probs with it)."""

    metrics: dict[str, float]
    grad_norms: list[float]
    steps_taken: int
    steps_skipped: int
    ratio_max: float
    old_logp: Tensor | None


def _all_reduce(value: float, op: torch.distributed.ReduceOp, device: torch.device) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=op)
    return float(tensor)


def steps_per_pass(rows: int, minibatch_size: int, grad_accum_steps: int) -> int:
    """Optimizer steps of one pass over `rows` rows: `ceil(ceil(rows / minibatch_size) / grad_accum_steps)`."""
    return math.ceil(math.ceil(rows / minibatch_size) / grad_accum_steps)


def clipped_step(context: UpdateContext, optimizer) -> float:
    """Average the accumulated gradient over ranks, clip it and step, or skip when it is not finite; returns the norm.

    Under FSDP2 the backward passes already reduce-scattered the mean gradient into each rank's shard: no
    all-reduce here, and the clip's norm (a DTensor) is the norm of the whole gradient, equal on every rank.
    """
    params = [p for p in context.policy.parameters() if p.requires_grad]
    if not context.sharded and context.world_size > 1:
        average_gradients(params, context.world_size)  # under DDP: the mean over ranks
    norm = torch.nn.utils.clip_grad_norm_(params, context.max_grad_norm)
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def grouped_passes(context: UpdateContext, rows: int, steps: int) -> bool:
    """Whether the forwards of a pass take the rows in rollout order (whole prompt groups, each prompt run once:
    `llm_pg.modules.logprobs`) rather than by micro-batch of the shuffled split.

    When a pass is one optimizer step over micro-batches of equal size (and prefix sharing is on), the step is a
    sum over rows whatever rows run together, once each row's token means are taken over its own micro-batch of the
    split (`losses.split_token_counts`, `losses.token_mean_share`): the policy term is a mean over rows, and the KL term
    and the logged token means divide each row's token sum by its micro-batch's token count. The shuffled split
    is still drawn, so the step is the course's, float rounding apart.
    """
    return context.grouped and steps == 1 and rows % context.minibatch_size == 0


def forward_rows(rollout: RolloutBatch, minibatch_size: int, by_length: bool) -> list[Tensor]:
    """The rows of each forward of a grouped pass: rollout order, or by total real tokens, longest first
    (`speed.group_by_length`: when prefix sharing cannot apply to a forward that builds a graph, rows of similar length
    waste the least padding, `logprobs.packed_layout`)."""
    order = torch.arange(len(rollout))
    if by_length:
        order = torch.sort(rollout.attention_mask.sum(1).cpu(), descending=True, stable=True).indices
    return [order[start : start + minibatch_size] for start in range(0, len(rollout), minibatch_size)]


def _step_tokens(context: UpdateContext, rollout: RolloutBatch, group: list[Tensor]) -> float:
    """Completion tokens of the step's micro-batches (`token_mean`), summed over ranks under DDP."""
    tokens = float(sum(int(rollout.completion_mask[index].sum()) for index in group))
    if context.world_size > 1:
        tokens = _all_reduce(tokens, torch.distributed.ReduceOp.SUM, rollout.input_ids.device)
    return max(tokens, 1.0)


def _micro_step(
    context: UpdateContext, state: UpdateState, rollout: RolloutBatch, index: Tensor, split: Tensor | None,
    num_tokens: float | None, first_pass: bool, share: float,
) -> None:  # fmt: skip
    """One micro-batch: its forward, loss and backward (into the accumulated gradient), and its metrics into
    `state`. On the first pass of an update that takes pi_old from it, the detached log-probs become pi_old."""
    part = rollout.select(index).trimmed()
    objective = context.objective
    logp, entropy = context.logprobs(context.policy, part, True, objective.entropy_coef > 0)  # [b, w]
    if first_pass:
        old = logp.detach()
        state.old_logp[index.to(logp.device), : logp.shape[1]] = old
    else:
        old = None if state.old_logp is None else state.old_logp[index.to(logp.device), : logp.shape[1]]
    micro = MicroBatch(part, old, None if split is None else split[index.to(split.device)], num_tokens)
    out = objective(logp, entropy, micro)
    with context.no_sync():  # gradients are averaged once, per step
        context.backward(out.loss * context.world_size if num_tokens is not None else out.loss / share)
    state.ratio_max = max(state.ratio_max, float(out.ratio.ratio_max) if out.ratio is not None else 1.0)
    for name, value in out.metrics(share * context.world_size if num_tokens is not None else 1.0).items():
        state.totals[name] = state.totals.get(name, 0.0) + float(value)
    state.micro_batches += 1


def run_update(context: UpdateContext, rollout: RolloutBatch, optimizer, shuffle: torch.Generator) -> UpdateResult:
    """Train on `rollout` (`context.epochs` shuffled passes); returns the `UpdateResult`. Under the objective's
    `token_mean` aggregation each step's completion tokens are counted first. A rollout with no rows makes no
    optimizer step."""
    token_mean = context.objective.aggregation == "token_mean"
    needs_old = context.objective.needs_old_logp
    old_from_first_pass = needs_old and rollout.old_logp is None
    old = torch.zeros(rollout.completion_mask.shape, device=rollout.input_ids.device) if old_from_first_pass else None
    state = UpdateState(old if old_from_first_pass else rollout.old_logp)  # [N, C]
    steps = steps_per_pass(len(rollout), context.minibatch_size, context.grad_accum_steps)
    if old_from_first_pass and steps > 1:  # a later micro-batch of the first pass would see weights already stepped
        raise RuntimeError(
            "the rollout has no old_logp, and a pass makes several optimizer steps: compute pi_old first"
        )
    grouped = grouped_passes(context, len(rollout), steps)
    size, accumulate = context.minibatch_size, context.grad_accum_steps
    for epoch in range(context.epochs):
        order = torch.randperm(len(rollout), generator=shuffle)  # the split: which rows share a micro-batch
        micro = [order[start : start + size] for start in range(0, len(rollout), size)]
        split = None
        if grouped:  # the same step, computed over forwards of whole prompt groups
            split = split_token_counts(rollout.completion_mask, micro)
            micro = forward_rows(rollout, size, context.by_length)
        for step in range(steps):
            group = micro[step * accumulate : (step + 1) * accumulate]
            num_tokens = _step_tokens(context, rollout, group) if token_mean else None
            for index in group:
                # Default: divide by the micro-batches actually accumulated, so a short last group is a mean too.
                _micro_step(context, state, rollout, index, split, num_tokens, old_from_first_pass and epoch == 0,
                            len(group))  # fmt: skip
            state.grad_norms.append(clipped_step(context, optimizer))
    taken = sum(math.isfinite(g) for g in state.grad_norms)
    return UpdateResult(
        metrics={name: value / max(state.micro_batches, 1) for name, value in state.totals.items()},
        grad_norms=state.grad_norms,
        steps_taken=taken,
        steps_skipped=len(state.grad_norms) - taken,
        ratio_max=state.ratio_max,
        old_logp=state.old_logp,
    )
