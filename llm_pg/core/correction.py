"""Corrections of the policy term for the rollout engine's sampler, pure tensor math: the importance weight of pi_old
against the sampler (`sampler_weight`, in one of four modes: `SamplerCorrection`; TIS and MIS) and DeepSeek-V3.2's
off-policy sequence mask (`off_policy_keep`). With HF the sampler is the policy itself and every weight is 1.
The objectives apply them (`llm_pg.core.objectives.Objective.policy_weight`); `llm_pg.engines.health` logs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from llm_pg.core.losses import masked_mean
from llm_pg.core.rollout import RolloutBatch

# Importance correction against the rollout engine's sampler, named as TRL's `vllm_importance_sampling_mode`
SamplerIsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

SAMPLER_IS_MODES = get_args(SamplerIsMode)
SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")  # one weight per completion; the others, one per token
TRUNCATE_MODES = ("token_truncate", "sequence_truncate")  # clamp the weight; the others set it to 0 outside


def sampler_is_weight(
    old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str, high: float, low: float | None = None
) -> Tensor:
    """Importance weights of pi_old against the rollout engine's sampler, no grad, in one of four modes (TRL 1.16's
    `vllm_importance_sampling_mode`; verl's rollout-correction presets): with `d_t = log pi_old(y_t) - log
    pi_sampler(y_t)` on completion tokens (0 elsewhere),

        token_*:    w_t = exp(d_t)                       `[B, C]`, one weight per token
        sequence_*: w   = exp(sum_t d_t), the product    `[B, 1]`, one weight per completion
        *_truncate: w clamped to `[low, high]` (TIS, Yao et al., 2025; `low` None: no lower bound)
        *_mask:     w where `low <= w <= high`, else 0 (MIS: the token or sequence leaves the policy term)

    `sampler_logp` is the engine's own log-prob of each token it sampled, `old_logp` the trainer's pi_old of it.
    A sequence's product may overflow to inf: truncation then gives `high` and masking 0, never inf or NaN."""
    diff = (old_logp - sampler_logp) * mask  # [B, C]: 0 on padding
    if mode in SEQUENCE_MODES:
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    weight = torch.exp(diff).detach()
    if mode in TRUNCATE_MODES:
        return weight.clamp(min=low, max=high)
    outside = weight > high
    if low is not None:
        outside |= weight < low
    return weight.masked_fill(outside, 0.0)


def off_policy_keep(advantages: Tensor, logp: Tensor, sampler_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `off_policy_mask_threshold`): `[B, 1]`, 0 for a completion
    whose advantage is negative and whose mean per-token `log pi_sampler - log pi_theta` (pi_theta detached) exceeds
    `threshold`, else 1. Such a sequence was sampled by a policy that liked it much more than the current one does,
    and pushing it further down mostly adds variance."""
    gap = masked_mean(sampler_logp - logp.detach(), mask, dim=1)  # [B]
    drop = (advantages < 0) & (gap > threshold)
    return (~drop).to(logp.dtype).unsqueeze(1)


@dataclass(frozen=True)
class SamplerCorrection:
    """How the policy term is corrected for the rollout engine's sampler (`losses.sampler_is_weight`): a mode of
    `SAMPLER_IS_MODES` and its bounds (the config's `correction` group; `mode: token_truncate, max: C` is TIS)."""

    mode: str
    high: float
    low: float | None = None


def sampler_weight(
    rollout: RolloutBatch, correction: SamplerCorrection | None, old_logp: Tensor | None = None
) -> Tensor | None:
    """`[b, C]` (token modes) or `[b, 1]` (sequence modes) importance weights of a (micro-)batch against its sampler,
    or None when there is no correction (`correction` None) or pi_old is unknown (REINFORCE with HF: weight 1).
    `old_logp` `[b, C]`: pi_old when the update has it rather than the rollout (from its first pass; default:
    `rollout.old_logp`). Without engine log-probs (HF) the sampler is pi_old itself and every weight is exactly 1."""
    old_logp = rollout.old_logp if old_logp is None else old_logp
    if correction is None or old_logp is None:
        return None
    return sampler_is_weight(
        old_logp,
        sampler_logp(rollout, old_logp),
        rollout.completion_mask,
        correction.mode,
        correction.high,
        correction.low,
    )


def sampler_logp(rollout: RolloutBatch, old_logp: Tensor | None = None) -> Tensor | None:
    """`[b, C]` the sampler's log-probs of the sampled tokens: the engine's own (vLLM), else pi_old (`old_logp`,
    default `rollout.old_logp`: HF samples with the policy itself), else None (REINFORCE with HF)."""
    old_logp = rollout.old_logp if old_logp is None else old_logp
    if rollout.sampled_logp is None:
        return old_logp
    return rollout.sampled_logp.to(old_logp.device if old_logp is not None else rollout.sampled_logp.device)
