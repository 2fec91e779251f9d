"""The rollout-side options of the RL math, as pure functions of a rollout's tensors (docs/algorithms.md, "Variants").

Which groups the update keeps (`unsettled_rows`: DAPO's dynamic sampling; the rollout callback runs its refill
rounds), the advantages it trains on (`clipped_advantages`: an estimator of `losses.advantages`, then clipped), which
rows have no EOS (`truncated_rows`: DAPO's overlong filtering masks them), and the importance weight against the
rollout engine's sampler (`sampler_weight`, in one of four modes: `SamplerCorrection`). The rollout callback applies
the first three in that order (`llm_pg.callbacks.rollout`); the modules' losses take the fourth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llm_pg.core.losses import advantages, sampler_is_weight, settled_groups
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


@dataclass(frozen=True)
class SamplerCorrection:
    """How the policy term is corrected for the rollout engine's sampler (`losses.sampler_is_weight`): a mode of
    `losses.SAMPLER_IS_MODES` and its bounds. `tis_cap: C` is `SamplerCorrection("token_truncate", C)`."""

    mode: str
    high: float
    low: float | None = None


def sampler_weight(rollout: RolloutBatch, correction: SamplerCorrection | None) -> Tensor | None:
    """`[b, C]` (token modes) or `[b, 1]` (sequence modes) importance weights of a (micro-)batch against its sampler,
    or None when there is no correction (`correction` None) or pi_old is unknown (REINFORCE with HF: weight 1).
    Without engine log-probs (HF) the sampler is pi_old itself and every weight is exactly 1."""
    if correction is None or rollout.old_logp is None:
        return None
    return sampler_is_weight(
        rollout.old_logp,
        sampler_logp(rollout),
        rollout.completion_mask,
        correction.mode,
        correction.high,
        correction.low,
    )


def sampler_logp(rollout: RolloutBatch) -> Tensor | None:
    """`[b, C]` the sampler's log-probs of the sampled tokens: the engine's own (vLLM), else pi_old (HF samples with
    the policy itself), else None (REINFORCE with HF)."""
    if rollout.sampled_logp is None:
        return rollout.old_logp
    device = rollout.old_logp.device if rollout.old_logp is not None else rollout.sampled_logp.device
    return rollout.sampled_logp.to(device)
