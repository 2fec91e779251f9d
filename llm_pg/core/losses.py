"""The RL loss as pure tensor math (no Lightning, no models, no I/O): token log-probs and entropy, the completion
mask, the KL estimate, masked and token means, the aggregation of per-token terms, and the policy terms and losses
built on them (`reinforce_loss`, `grpo_loss`, `cispo_loss`: the fixed core API, with `group_advantages` and
`advantages`, which live in `llm_pg.core.advantages` and are named here too). The objectives as components are
`llm_pg.core.objectives`.

Shapes: `B` rows (prompts x group_size completions, group-contiguous), `L` tokens of prompt plus
completion, `C` completion tokens, `V` vocabulary. Log-probs, masks and reference log-probs enter
the losses in completion space `[B, C]`. See docs/algorithms.md for the derivations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from llm_pg.core import advantages as _advantages


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


LossAggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS = get_args(LossAggregation)


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


def kl_term(
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


# ---- the policy losses (the fixed core API's `grpo_loss` and `reinforce_loss`, and CISPO) --------------------------

RatioLevel = Literal["token", "sequence"]  # the course's per-token ratio, or GSPO's per-sequence one

RATIO_LEVELS = get_args(RatioLevel)


@dataclass(frozen=True)
class RatioStats:
    """What a ratio-based policy term logs, detached: the share of completion tokens whose gradient the clip removes
    (`clip_fraction` = `clip_fraction_low` + `clip_fraction_high`), the token mean of the ratio and its largest value
    (over ranks the largest, not the mean)."""

    clip_fraction: Tensor
    clip_fraction_low: Tensor
    clip_fraction_high: Tensor
    ratio_mean: Tensor
    ratio_max: Tensor

    def as_dict(self) -> dict[str, Tensor]:
        return {
            "clip_fraction": self.clip_fraction,
            "clip_fraction_low": self.clip_fraction_low,
            "clip_fraction_high": self.clip_fraction_high,
            "ratio_max": self.ratio_max,
            "ratio_mean": self.ratio_mean,
        }


@dataclass(frozen=True)
class Reduction:
    """How a policy term's per-token values reduce to one number: the aggregation `mode` (`losses.aggregate`;
    `max_new_tokens` for `seq_mean_token_sum_norm`), the step's completion tokens (`num_tokens`, `token_mean`) and
    each row's micro-batch tokens when the update regroups rows (`split_tokens` `[B]`, `losses.token_mean_share`)."""

    mode: str = "seq_mean_token_mean"
    max_new_tokens: int | None = None
    num_tokens: float | Tensor | None = None
    split_tokens: Tensor | None = None

    def __call__(self, values: Tensor, mask: Tensor) -> Tensor:
        return aggregate(values, mask, self.mode, self.max_new_tokens, self.num_tokens)


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, ratio_level: str = "token") -> Tensor:
    """`[B, C]` `rho_it = exp(logp_it - old_logp_it)` (`token`), or GSPO's `rho_i = exp(seqmean_i(logp - old_logp))`
    broadcast over row i's tokens (`sequence`); log-ratios clamped to +-20."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # [B, C]
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(logp)  # [B, C], one per row
    elif ratio_level != "token":
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    return torch.exp(log_ratio)


def _ratio_stats(rho: Tensor, low: Tensor, high: Tensor, mask: Tensor, split_tokens: Tensor | None) -> RatioStats:
    """`RatioStats` of the ratio `rho` `[B, C]`, with `low`/`high` `[B, C]` bool the tokens clipped at each bound."""
    rho_kept = rho.detach()[mask]
    return RatioStats(
        clip_fraction=token_mean_share((high | low).float(), mask, split_tokens),
        clip_fraction_low=token_mean_share(low.float(), mask, split_tokens),
        clip_fraction_high=token_mean_share(high.float(), mask, split_tokens),
        ratio_mean=token_mean_share(rho.detach(), mask, split_tokens),
        ratio_max=rho_kept.max() if rho_kept.numel() else rho.new_ones(()),
    )


def reinforce_term(
    logp: Tensor, mask: Tensor, advantages: Tensor, reduce: Reduction, is_weight: Tensor | None = None
) -> Tensor:
    """GR-REINFORCE's policy term `-reduce(A_i * w_it * logp_it)`; with the default aggregation
    `-mean_i(A_i * seqmean_i(logp))`, computed in the course's order of operations."""
    if is_weight is not None:
        logp = is_weight * logp
    if reduce.mode == "seq_mean_token_mean":
        return -(advantages * masked_mean(logp, mask, dim=1)).mean()
    return -reduce(advantages.unsqueeze(1) * logp, mask)


def clipped_term(
    logp: Tensor, old_logp: Tensor, mask: Tensor, advantages: Tensor, reduce: Reduction, clip_eps: float = 0.2,
    clip_eps_high: float | None = None, ratio_level: str = "token", is_weight: Tensor | None = None,
) -> tuple[Tensor, RatioStats]:  # fmt: skip
    """The clipped surrogate's policy term `-reduce(w * min(rho A, clip(rho, 1-eps, 1+eps_high) A))` and its
    `RatioStats`: `clip_fraction_low` counts tokens with rho < 1 - eps and A < 0, `clip_fraction_high` rho > 1 +
    eps_high and A > 0 (`eps_high` = `clip_eps_high`, DAPO's clip-higher; default `clip_eps`)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    rho = importance_ratio(logp, old_logp, mask, ratio_level)
    adv = advantages.unsqueeze(1)  # [B, 1]
    surrogate = torch.minimum(rho * adv, rho.clamp(1.0 - clip_eps, 1.0 + high) * adv)
    if is_weight is not None:
        surrogate = is_weight * surrogate
    policy_loss = -reduce(surrogate, mask)
    clipped_high = (rho > 1.0 + high) & (adv > 0)  # [B, C]: the ratio rose past the upper clip on a good row
    clipped_low = (rho < 1.0 - clip_eps) & (adv < 0)  # fell past the lower clip on a bad row
    return policy_loss, _ratio_stats(rho, clipped_low, clipped_high, mask, reduce.split_tokens)


def cispo_term(
    logp: Tensor, old_logp: Tensor, mask: Tensor, advantages: Tensor, reduce: Reduction, clip_eps_high: float = 0.2,
    ratio_level: str = "token", is_weight: Tensor | None = None,
) -> tuple[Tensor, RatioStats]:  # fmt: skip
    """CISPO's policy term `-reduce(w * sg(min(rho, 1 + clip_eps_high)) * A_i * logp_it)` and its `RatioStats`:
    `clip_fraction` = `clip_fraction_high`, the tokens whose weight the bound caps on a row with A > 0 (TRL's
    `cispo_clip_ratio`); `clip_fraction_low` 0 (no lower bound)."""
    rho = importance_ratio(logp, old_logp, mask, ratio_level)
    adv = advantages.unsqueeze(1)  # [B, 1]
    weight = rho.clamp(max=1.0 + clip_eps_high).detach()
    per_token = weight * adv * logp
    if is_weight is not None:
        per_token = is_weight * per_token
    policy_loss = -reduce(per_token, mask)
    capped = (rho > 1.0 + clip_eps_high) & (adv > 0)  # [B, C]
    return policy_loss, _ratio_stats(rho, torch.zeros_like(capped), capped, mask, reduce.split_tokens)


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
    """GR-REINFORCE: `loss = -aggregate(A_i * logp_it) + kl_coef * tokmean(approx_kl)` (`reinforce_term` plus
    `kl_term`; the KL term unweighted by `is_weight`).

    Args:
        logp: `[B, C]` log pi_theta of the sampled completion tokens (with grad).
        mask: `[B, C]` completion mask.
        advantages: `[B]`.
        ref_logp: `[B, C]` log pi_ref, or None for no KL term.
        aggregation, max_new_tokens, num_tokens: see `aggregate`.
        split_tokens: `[B]`, see `token_mean_share` (None: this micro-batch's token means).
        is_weight: `[B, C]` or `[B, 1]` weights (`sampler_is_weight`, times `off_policy_keep`) multiplying each
            token's policy-gradient term. None: weight 1 (the course).

    Returns:
        The scalar loss and detached stats `policy_loss`, `kl`.
    """
    reduce = Reduction(aggregation, max_new_tokens, num_tokens, split_tokens)
    policy_loss = reinforce_term(logp, mask, advantages, reduce, is_weight)
    kl_loss, kl = kl_term(logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    return policy_loss + kl_loss, {"policy_loss": policy_loss.detach(), "kl": kl.detach()}


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
    """GRPO's clipped surrogate plus the KL penalty (`clipped_term` plus `kl_term`):

    `loss = -aggregate(min(rho*A_i, clip(rho, 1-eps, 1+eps_high)*A_i)) + kl_coef * tokmean(approx_kl)`, with
    `rho_it = exp(logp_it - old_logp_it)` (`ratio_level="token"`, default) or the GSPO sequence ratio
    `rho_i = exp(seqmean_i(logp - old_logp))` broadcast over row i's tokens (`"sequence"`; Zheng et al. 2025).

    Args:
        logp, old_logp: `[B, C]` log-probs under the current and the sampling policy.
        mask: `[B, C]`; advantages: `[B]`; ref_logp: `[B, C]` or None.
        aggregation, max_new_tokens, num_tokens: see `aggregate`.
        split_tokens: `[B]`, see `token_mean_share` (None: this micro-batch's token means).
        is_weight: `[B, C]` or `[B, 1]` weights multiplying each token's clipped surrogate; the KL term is not
            weighted. None: weight 1 (the course).

    Returns:
        The scalar loss and detached stats `policy_loss`, `kl` and those of `RatioStats`.
    """
    reduce = Reduction(aggregation, max_new_tokens, num_tokens, split_tokens)
    policy_loss, ratio = clipped_term(
        logp, old_logp, mask, advantages, reduce, clip_eps, clip_eps_high, ratio_level, is_weight
    )
    kl_loss, kl = kl_term(logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    return policy_loss + kl_loss, {"policy_loss": policy_loss.detach(), "kl": kl.detach(), **ratio.as_dict()}


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
    """CISPO (MiniMax-M1, 2025) plus the KL penalty (`cispo_term` plus `kl_term`):

    `loss = -aggregate(sg(min(rho, 1 + clip_eps_high)) * A_i * logp_it) + kl_coef * tokmean(approx_kl)`.

    Unlike the clipped surrogate, a token whose ratio passed the bound still has a gradient (through `logp`), at a
    capped weight. TRL 1.16's `loss_type="cispo"` with `epsilon_high = 1 + clip_eps_high` and the `token_mean`
    aggregation is the same loss. Arguments and stats as `grpo_loss`.
    """
    reduce = Reduction(aggregation, max_new_tokens, num_tokens, split_tokens)
    policy_loss, ratio = cispo_term(logp, old_logp, mask, advantages, reduce, clip_eps_high, ratio_level, is_weight)
    kl_loss, kl = kl_term(logp, ref_logp, mask, kl_coef, aggregation, num_tokens, split_tokens)
    return policy_loss + kl_loss, {"policy_loss": policy_loss.detach(), "kl": kl.detach(), **ratio.as_dict()}


# The fixed core API (shared/design.md) names the advantage estimators here too; they live with the rest of the
# rollout-side math in `llm_pg.core.advantages`.
group_advantages = _advantages.group_advantages
advantages = _advantages.advantages
