"""The rollout-side options of the RL math, as pure functions of a rollout's tensors (docs/algorithms.md, "Variants").

Which groups the update keeps (`unsettled_rows`: DAPO's dynamic sampling; the rollout callback runs its refill
rounds), the advantages it trains on (`clipped_advantages`: an estimator of `losses.advantages`, then clipped), which
rows have no EOS (`truncated_rows`: DAPO's overlong filtering masks them), and the truncated importance weight against
the sampler (`tis_weight`). The rollout callback applies the first three in that order (`llm_pg.callbacks.rollout`); the
modules' losses take the fourth.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llm_pg.core.losses import advantages, settled_groups, truncated_is_weight
from llm_pg.core.rollout import RolloutBatch


def truncated_rows(completion_ids: Tensor, eos_token_ids: Sequence[int]) -> Tensor:
    """`[N]` bool: the rows whose completion holds no EOS token at all (they reached `max_new_tokens`)."""
    eos = torch.tensor(list(eos_token_ids), device=completion_ids.device)
    return ~torch.isin(completion_ids, eos).any(1)


def unsettled_rows(rewards: Tensor, group_size: int, limit: int | None = None) -> tuple[Tensor, int]:
    """`(index [M], settled)`: the rows of every group whose rewards are not all equal, whole groups in rollout order
    (a CPU long tensor, for `RolloutBatch.select`), at most the first `limit` such groups (None: all), and the number
    of settled groups left out."""
    settled = settled_groups(rewards, group_size)  # [N/G]
    spread = ~settled
    if limit is not None:
        spread &= spread.cumsum(0) <= limit  # the first `limit` groups with spread
    keep = spread.repeat_interleave(group_size).nonzero().view(-1).cpu()
    return keep, int(settled.sum())


def clipped_advantages(rewards: Tensor, group_size: int, estimator: str, clip: float) -> Tensor:
    """`[N]` the estimator's advantages (`losses.advantages`: grpo, dr_grpo, rloo, reinforce_pp), clamped to
    `[-clip, clip]`."""
    return advantages(rewards, group_size, estimator).clamp(-clip, clip)


def tis_weight(rollout: RolloutBatch, cap: float | None) -> Tensor | None:
    """`[b, C]` truncated importance weights `min(exp(old_logp - sampler_logp), cap)` of a (micro-)batch, or None
    when TIS is off (`cap` None) or pi_old is unknown (REINFORCE with HF: no weight, i.e. 1). Without engine
    log-probs (HF) the sampler is pi_old itself and every weight is exactly 1."""
    if cap is None or rollout.old_logp is None:
        return None
    sampler = rollout.old_logp if rollout.sampled_logp is None else rollout.sampled_logp.to(rollout.old_logp.device)
    return truncated_is_weight(rollout.old_logp, sampler, cap)
