"""The RL update as pure tensor math: no Lightning, no models, no I/O.

Shapes: `B` rows (prompts x group_size completions, group-contiguous), `L` tokens of prompt plus
completion, `C` completion tokens, `V` vocabulary. Log-probs, masks and reference log-probs enter
the losses in completion space `[B, C]`. See docs/algorithms.md for the derivations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each next token: `out[:, t] = log_softmax(logits[:, t] / T)[input_ids[:, t+1]]`.

    Args:
        logits: `[B, L, V]` in any float dtype; position t scores the token at t+1.
        input_ids: `[B, L]`.
        temperature: divides the logits before the softmax (the sampling temperature).

    Returns:
        `[B, L-1]` float32 (`target_logprobs` of the shifted pair).
    """
    return target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """`out[:, t] = log_softmax(logits[:, t] / T)[targets[:, t]]`, `[B, L]` float32, for `[B, L, V]` logits.

    Computed as gathered logit minus logsumexp: no `[B, L, V]` log-softmax is materialised, and bf16/fp16 logits
    are upcast one row at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets = targets.unsqueeze(-1)  # [B, L, 1]
    if logits.dtype in (torch.float32, torch.float64):
        scaled = logits / temperature if temperature != 1.0 else logits
        return (scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)).float()
    # Low-precision logits: upcast one row at a time, so the float32 copy of [L, V] exists per row only.
    rows = []
    for row_logits, row_targets in zip(logits, targets, strict=True):
        row_logits = row_logits.float() / temperature  # [L, V]
        rows.append(row_logits.gather(-1, row_targets).squeeze(-1) - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of each position's next-token distribution `[B, L]` (float32), no grad; low-precision logits are
    upcast one row at a time."""
    if logits.dtype in (torch.float32, torch.float64):
        logp = torch.log_softmax(logits / temperature, dim=-1)  # [B, L, V]
        return -(logp.exp() * logp).sum(-1).float()
    rows = []
    for row_logits in logits:
        logp = torch.log_softmax(row_logits.float() / temperature, dim=-1)  # [L, V]
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(rows)


def completion_mask(completion_ids: Tensor, eos_token_id: int | Sequence[int]) -> Tensor:
    """True for every completion token up to and including the first EOS; all True without an EOS.

    Args:
        completion_ids: `[B, C]` generated tokens (right-padded, the pad may equal an EOS id).
        eos_token_id: one id or several (e.g. `<|im_end|>` and `<|endoftext|>`).

    Returns:
        `[B, C]` bool. Position t is kept while no EOS occurred strictly before t, so padding after
        the first EOS is masked even when the pad token is that same EOS.
    """
    eos_ids = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    is_eos = torch.isin(completion_ids, eos_ids.to(completion_ids.device)).long()  # [B, C]
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS count strictly before each position
    return eos_before == 0


def approx_kl(logp: Tensor, ref_logp: Tensor, clamp: float = 20.0) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref): `exp(d) - d - 1`, `d = clamp(ref_logp - logp)`.

    Unbiased on tokens sampled from pi_theta and nonnegative for every token (docs/algorithms.md).
    The clamp keeps `exp` finite when the two models disagree wildly.
    """
    d = (ref_logp - logp).clamp(-clamp, clamp)
    return torch.exp(d) - d - 1.0


Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]  # the estimators of `advantages`
LossAggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]  # the course's per-token ratio, or GSPO's per-sequence one
PolicyLoss = Literal["clip", "cispo"]  # GRPO's clipped surrogate, or CISPO's clipped-weight REINFORCE
ADVANTAGE_ESTIMATORS = get_args(Advantage)
LOSS_AGGREGATIONS = get_args(LossAggregation)
RATIO_LEVELS = get_args(RatioLevel)
POLICY_LOSSES = get_args(PolicyLoss)
# Importance correction against the rollout engine's sampler, named as TRL's `vllm_importance_sampling_mode`
SamplerIsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_IS_MODES = get_args(SamplerIsMode)
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


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask` is True; over all elements, or along `dim` (empty rows give 0, not NaN)."""
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def token_mean_share(x: Tensor, mask: Tensor, split_tokens: Tensor | None = None) -> Tensor:
    """These rows' share of a token mean: `masked_mean(x, mask)` over `x` `[B, C]` when the rows are the whole
    micro-batch (`split_tokens` None); or, with `split_tokens` `[B]` (the completion tokens of the micro-batch each
    row belongs to in the update's split), the partial sum `sum_i sum_t m_it x_it / split_tokens_i`. Summed over
    every row of a pass, the second gives the sum of the split's micro-batch means, whichever rows run through the
    model together (`llm_pg.modules.update.grouped_passes`)."""
    if split_tokens is None:
        return masked_mean(x, mask)
    return ((x * mask.to(x.dtype)).sum(1) / split_tokens.to(x.dtype).clamp(min=1.0)).sum()


def split_token_counts(mask: Tensor, micro: list[Tensor]) -> Tensor:
    """`[N]`: for each row, the completion tokens of the micro-batch `micro` puts it in (`mask` `[N, C]`)."""
    tokens = mask.sum(1).float()  # [N]
    counts = torch.empty_like(tokens)
    for index in micro:
        index = index.to(mask.device)
        counts[index] = tokens[index].sum()
    return counts


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


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "seq_mean_token_mean",
    max_new_tokens: int | None = None,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token values `[B, C]` to a scalar over the completion tokens `mask`.

    - `seq_mean_token_mean` (course default): `mean_i( sum_t m_it v_it / |y_i| )`.
    - `token_mean` (DAPO, Yu et al. 2025): `sum_it m_it v_it / num_tokens`, `num_tokens` = the completion
      tokens of the whole optimizer step (default: of this micro-batch), so accumulated micro-batches add up
      to one mean over every token of the step.
    - `seq_mean_token_sum_norm` (Dr. GRPO): `mean_i( sum_t m_it v_it / max_new_tokens )`.
    """
    if mode == "seq_mean_token_mean":
        return masked_mean(values, mask, dim=1).mean()
    if mode == "token_mean":
        total = (values * mask.to(values.dtype)).sum()
        return total / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if mode == "seq_mean_token_sum_norm":
        if max_new_tokens is None:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_new_tokens")
        return ((values * mask.to(values.dtype)).sum(dim=1) / max_new_tokens).mean()
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")


def token_term(
    per_token: Tensor,
    mask: Tensor,
    coef: float,
    aggregation: str = "seq_mean_token_mean",
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A per-token term of the loss, `(coef * tokmean(x), tokmean(x))` for `x` `[B, C]`; `tokmean` is the
    micro-batch's token mean (`token_mean_share`, with `split_tokens` when the update regroups the rows).

    Under `token_mean` the loss term is `coef * sum(x) / num_tokens` instead, so that the whole step's loss is one
    mean over its tokens; the returned statistic stays the micro-batch's token mean. The KL penalty and the entropy
    bonus are such terms.
    """
    mean = token_mean_share(per_token, mask, split_tokens)
    if aggregation == "token_mean":
        return coef * aggregate(per_token, mask, "token_mean", num_tokens=num_tokens), mean
    return coef * mean, mean


def _kl_term(
    logp: Tensor,
    ref_logp: Tensor | None,
    mask: Tensor,
    kl_coef: float,
    aggregation: str = "seq_mean_token_mean",
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`token_term` of `approx_kl(logp, ref_logp)` with `kl_coef`; zeros without a reference."""
    if ref_logp is None:
        zero = logp.new_zeros(())
        return zero, zero
    return token_term(approx_kl(logp, ref_logp), mask, kl_coef, aggregation, num_tokens, split_tokens)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    aggregation: str = "seq_mean_token_mean",
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
) -> Tensor:
    """The entropy bonus `coef * tokmean(H)` (`token_term`), which the loss subtracts: `loss - entropy_bonus`
    raises the entropy of the sampled positions' next-token distributions `H` `[B, C]` (with grad). As TRL's
    `entropy_coef`: the same token mean whatever the policy term's aggregation (up to `token_mean`'s step-wide
    token count)."""
    return token_term(entropy, mask, coef, aggregation, num_tokens, split_tokens)[0]


def differentiable_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`token_entropy` with its gradient: `H = -sum_j p_j log p_j` of `softmax(logits / T)`, `[B, L]` float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, L, V]
    return -(logp.exp() * logp).sum(-1)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), a reward term `[N]` from completion lengths `[N]`
    (tokens up to and including EOS): 0 up to `max_new_tokens - buffer` tokens, then falling linearly to `-penalty`
    at `max_new_tokens`: `min(0, -(L - (max_new_tokens - buffer)) / buffer * penalty)` (verl's `overlong_buffer`)."""
    if buffer < 1:
        raise ValueError(f"overlong buffer must be >= 1 token, got {buffer}")
    exceed = lengths.double() - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0).to(torch.float32)


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
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    weight = torch.exp(diff).detach()
    if mode.endswith("truncate"):
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


def reinforce_loss(
    logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "seq_mean_token_mean",
    max_new_tokens: int | None = None,
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GR-REINFORCE: `loss = -aggregate(A_i * logp_it) + kl_coef * tokmean(approx_kl)`.

    With the default aggregation that is `-mean_i(A_i * seqmean_i(logp))`. Under `token_mean` the KL term is
    `kl_coef * sum(approx_kl) / num_tokens` too (`_kl_term`).

    Args:
        logp: `[B, C]` log pi_theta of the sampled completion tokens (with grad).
        mask: `[B, C]` completion mask.
        advantages: `[B]`.
        ref_logp: `[B, C]` log pi_ref, or None for no KL term.
        aggregation, max_new_tokens, num_tokens: see `aggregate`.
        split_tokens: `[B]`, see `token_mean_share` (None: this micro-batch's token means).
        is_weight: `[B, C]` or `[B, 1]` weights (`sampler_is_weight`, times `off_policy_keep`), multiplying each
            token's policy-gradient term, `A_i * w_it * logp_it`; the KL term is not weighted. None: weight 1 (the
            course).

    Returns:
        The scalar loss and detached stats `policy_loss`, `kl`.
    """
    kl_logp = logp
    if is_weight is not None:
        logp = is_weight * logp
    if aggregation == "seq_mean_token_mean":  # the same value, in the course's order of operations
        policy_loss = -(advantages * masked_mean(logp, mask, dim=1)).mean()
    else:
        policy_loss = -aggregate(advantages.unsqueeze(1) * logp, mask, aggregation, max_new_tokens, num_tokens)
    kl_loss, kl = _kl_term(kl_logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    return policy_loss + kl_loss, {"policy_loss": policy_loss.detach(), "kl": kl.detach()}


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, ratio_level: str = "token") -> Tensor:
    """`[B, C]` `rho_it = exp(logp_it - old_logp_it)` (`token`), or GSPO's `rho_i = exp(seqmean_i(logp - old_logp))`
    broadcast over row i's tokens (`sequence`); log-ratios clamped to +-20."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # [B, C]
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(logp)  # [B, C], one per row
    elif ratio_level != "token":
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    return torch.exp(log_ratio)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    ref_logp: Tensor | None = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    clip_eps_high: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "seq_mean_token_mean",
    max_new_tokens: int | None = None,
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate:

    `loss = -aggregate(min(rho*A_i, clip(rho, 1-eps, 1+eps_high)*A_i)) + kl_coef * tokmean(approx_kl)`, with
    `rho_it = exp(logp_it - old_logp_it)` (`ratio_level="token"`, default) or the GSPO sequence ratio
    `rho_i = exp(seqmean_i(logp - old_logp))` broadcast over row i's tokens (`"sequence"`; Zheng et al. 2025).
    `eps_high = clip_eps_high` (DAPO's clip-higher), default `clip_eps`. Under `token_mean` the KL term is
    `kl_coef * sum(approx_kl) / num_tokens` (`_kl_term`).

    Args:
        logp, old_logp: `[B, C]` log-probs under the current and the sampling policy.
        mask: `[B, C]`; advantages: `[B]`; ref_logp: `[B, C]` or None.
        aggregation, max_new_tokens, num_tokens: see `aggregate`.
        split_tokens: `[B]`, see `token_mean_share` (None: this micro-batch's token means).
        is_weight: `[B, C]` or `[B, 1]` weights (`sampler_is_weight`, times `off_policy_keep`) multiplying each
            token's clipped surrogate, `w_it * min(rho A, clip(rho) A)`; the KL term is not weighted. None: weight 1
            (the course).

    Returns:
        The scalar loss and detached stats `policy_loss`, `kl`, `clip_fraction` (share of completion
        tokens whose gradient the clip removes) = `clip_fraction_low` (rho < 1 - eps and A < 0) +
        `clip_fraction_high` (rho > 1 + eps_high and A > 0), `ratio_max`, `ratio_mean`.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    rho = importance_ratio(logp, old_logp, mask, ratio_level)
    adv = advantages.unsqueeze(1)  # [B, 1]
    surrogate = torch.minimum(rho * adv, rho.clamp(1.0 - clip_eps, 1.0 + high) * adv)
    if is_weight is not None:
        surrogate = is_weight * surrogate
    policy_loss = -aggregate(surrogate, mask, aggregation, max_new_tokens, num_tokens)
    kl_loss, kl = _kl_term(logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    clipped_high = (rho > 1.0 + high) & (adv > 0)  # [B, C]: the ratio rose past the upper clip on a good row
    clipped_low = (rho < 1.0 - clip_eps) & (adv < 0)  # fell past the lower clip on a bad row
    rho_kept = rho.detach()[mask]
    stats = {
        "policy_loss": policy_loss.detach(),
        "kl": kl.detach(),
        "clip_fraction": token_mean_share((clipped_high | clipped_low).float(), mask, split_tokens),
        "clip_fraction_low": token_mean_share(clipped_low.float(), mask, split_tokens),
        "clip_fraction_high": token_mean_share(clipped_high.float(), mask, split_tokens),
        "ratio_max": rho_kept.max() if rho_kept.numel() else rho.new_ones(()),
        "ratio_mean": token_mean_share(rho.detach(), mask, split_tokens),
    }
    return policy_loss + kl_loss, stats


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    ref_logp: Tensor | None = None,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    ratio_level: str = "token",
    aggregation: str = "seq_mean_token_mean",
    max_new_tokens: int | None = None,
    num_tokens: float | Tensor | None = None,
    split_tokens: Tensor | None = None,
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with each token's importance weight clipped and detached,

    `loss = -aggregate(sg(min(rho, 1 + clip_eps_high)) * A_i * logp_it) + kl_coef * tokmean(approx_kl)`,

    `rho` as `importance_ratio`. Unlike the clipped surrogate, a token whose ratio passed the bound still has a
    gradient (through `logp`), at a capped weight. TRL 1.16's `loss_type="cispo"` with
    `epsilon_high = 1 + clip_eps_high` (TRL caps the ratio at `epsilon_high` itself) and the `token_mean`
    aggregation is the same loss. Arguments as `grpo_loss`.

    Returns:
        The scalar loss and detached stats `policy_loss`, `kl`, `clip_fraction` = `clip_fraction_high` (share of
        completion tokens whose weight the bound caps on a row with A > 0, TRL's `cispo_clip_ratio`),
        `clip_fraction_low` (0: no lower bound), `ratio_max`, `ratio_mean`.
    """
    rho = importance_ratio(logp, old_logp, mask, ratio_level)
    adv = advantages.unsqueeze(1)  # [B, 1]
    weight = rho.clamp(max=1.0 + clip_eps_high).detach()
    per_token = weight * adv * logp
    if is_weight is not None:
        per_token = is_weight * per_token
    policy_loss = -aggregate(per_token, mask, aggregation, max_new_tokens, num_tokens)
    kl_loss, kl = _kl_term(logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    capped = (rho > 1.0 + clip_eps_high) & (adv > 0)  # [B, C]
    rho_kept = rho.detach()[mask]
    stats = {
        "policy_loss": policy_loss.detach(),
        "kl": kl.detach(),
        "clip_fraction": token_mean_share(capped.float(), mask, split_tokens),
        "clip_fraction_low": token_mean_share(torch.zeros_like(rho), mask, split_tokens),
        "clip_fraction_high": token_mean_share(capped.float(), mask, split_tokens),
        "ratio_max": rho_kept.max() if rho_kept.numel() else rho.new_ones(()),
        "ratio_mean": token_mean_share(rho.detach(), mask, split_tokens),
    }
    return policy_loss + kl_loss, stats
