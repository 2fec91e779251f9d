"""Which rollout rows train, and with what advantage: group normalisation and its estimators, settled groups,
DAPO's dynamic sampling and overlong shaping, as pure functions of a rollout's tensors (docs/algorithms.md,
"Variants"). The rollout callback applies them in this order: the overlong reward term (`overlong_penalty`), the
groups kept (`unsettled_rows`), the advantages (`clipped_advantages`: an estimator of `advantages`, then clipped),
and the truncated rows masked (`truncated_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]  # the estimators of `advantages`

ADVANTAGE_ESTIMATORS = get_args(Advantage)

SETTLED_RTOL = 1e-6  # rewards closer than this (relative to max(1, |r|)) are "equal": float noise, not signal


def settled_groups(rewards: Tensor, group_size: int) -> Tensor:
    """`[N/G]` bool: True for each contiguous group whose rewards are all equal up to float noise.

    Such a group carries no learning signal: its advantages are exactly 0 (`group_advantages`), it counts in
    `train/frac_zero_std_groups`. "Equal" is `max - min <= SETTLED_RTOL * max(1, max |r|)`, a test that
    rounding cannot fail: six rewards of 1.3 have a float32 mean that is off by ~1e-7, whose std, divided by
    `std + eps` with eps 1e-6, would otherwise become advantages of +-0.1.
    """
    grouped = rewards.detach().double().view(-1, group_size)  # [N/G, G]
    spread = grouped.amax(dim=1) - grouped.amin(dim=1)
    scale = grouped.abs().amax(dim=1).clamp(min=1.0)
    return spread <= SETTLED_RTOL * scale


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """Group-normalised advantages `A = (r - mean_g) / (std_g + eps)` over contiguous groups.

    Args:
        rewards: `[N]`, rows `i*G .. i*G+G-1` are the completions of prompt i.
        group_size: G >= 2.
        normalize_std: divide by the population std (`unbiased=False`); if False, `r - mean` only.

    Returns:
        `[N]` float32. A settled group (all rewards equal up to float noise, `settled_groups`) gets exactly 0
        for any reward values. Mean and std are computed in float64, so a group that differs by a little
        (0.1 vs 0.2) is not distorted by float32 rounding either.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalise within a group, got {group_size}")
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)  # [N/G, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    centered = torch.where(settled_groups(rewards, group_size).unsqueeze(1), 0.0, centered)
    return centered.float().view(-1)


def advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-completion advantages `[N]` from rewards `[N]` (contiguous groups of `group_size`).

    - `grpo` (course default; Shao et al. 2024): `(r - mean_g) / (std_g + eps)`, `group_advantages`.
    - `dr_grpo` (Liu et al. 2025, "Understanding R1-Zero-like training"): `r - mean_g`, no std division.
    - `rloo` (Ahmadian et al. 2024): `r - mean of the other G-1 rewards` = `G / (G-1) * (r - mean_g)`.
    - `reinforce_pp` (Hu 2025, REINFORCE++ with a group baseline): `c = r - mean_g`, then
      `c / (std over all N of c + eps)` (population std of the whole batch).
    Settled groups get exactly 0 under every estimator.
    """
    if estimator == "grpo":
        return group_advantages(rewards, group_size, eps)
    centered = group_advantages(rewards, group_size, normalize_std=False)  # [N], settled groups exactly 0
    if estimator == "dr_grpo":
        return centered
    if estimator == "rloo":
        return centered * (group_size / (group_size - 1))
    if estimator == "reinforce_pp":
        return (centered.double() / (centered.double().std(unbiased=False) + eps)).float()
    raise ValueError(f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), a reward term `[N]` from completion lengths `[N]`
    (tokens up to and including EOS): 0 up to `max_new_tokens - buffer` tokens, then falling linearly to `-penalty`
    at `max_new_tokens`: `min(0, -(L - (max_new_tokens - buffer)) / buffer * penalty)` (verl's `overlong_buffer`)."""
    if buffer < 1:
        raise ValueError(f"overlong buffer must be >= 1 token, got {buffer}")
    exceed = lengths.double() - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0).to(torch.float32)


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
