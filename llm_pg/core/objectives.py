"""The policy objectives, pure tensor math: one class per loss, and the functions they are made of.

An objective turns one micro-batch of the update (`MicroBatch`: rows, pi_old, the step's token counts) and its
policy log-probs into a `LossOutput`: the loss to differentiate and what is logged of it, under metric names
spelled out in `LossOutput.metrics`. The base class `Objective` owns what every objective shares: the KL penalty
to the reference (`kl_coef`, `approx_kl`), the entropy bonus (`entropy_coef`) and the policy term's weights against
the rollout engine's sampler (`llm_pg.core.correction`); a subclass defines the policy term alone.

    ClippedSurrogate   GRPO / PPO: min(rho A, clip(rho, 1-eps, 1+eps_high) A), rho per token (the course)
    GSPO               the clipped surrogate over one length-normalised ratio per completion
    CISPO              REINFORCE with each token's ratio capped and detached as its weight (MiniMax-M1)
    SequenceMean       GR-REINFORCE: -A_i * seqmean_i(logp), no ratio (the course's REINFORCE)

Add a loss here: a subclass of `Objective` with a `policy_term`, its short name in `OBJECTIVES`, and a test
(docs/algorithms.md, "Add a loss here"). The functions `grpo_loss`, `cispo_loss` and `reinforce_loss` are the
same objectives with the KL term, as plain functions (the course-parity tests compare them with the course's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
from torch import Tensor

from llm_pg.core.correction import SamplerCorrection, off_policy_keep, sampler_logp, sampler_weight
from llm_pg.core.losses import aggregate, entropy_bonus, kl_term, masked_mean, token_mean_share
from llm_pg.core.rollout import MicroBatch

RatioLevel = Literal["token", "sequence"]  # the course's per-token ratio, or GSPO's per-sequence one
PolicyLoss = Literal["clip", "cispo"]  # GRPO's clipped surrogate, or CISPO's clipped-weight REINFORCE
RATIO_LEVELS = get_args(RatioLevel)
POLICY_LOSSES = get_args(PolicyLoss)


# ---- the policy terms, as functions -------------------------------------------------------------------------------


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


# ---- the objectives, as components -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossOutput:
    """One micro-batch's loss (`loss`, with its gradient: policy term + KL term - entropy bonus) and what is logged
    of it, detached: the policy term, the KL estimate's token mean, the entropy's token mean, the bonus (None: off),
    the ratio's statistics (None: an objective without a ratio) and the share of rows the off-policy mask drops
    (None: off)."""

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    entropy: Tensor
    entropy_bonus: Tensor | None = None
    ratio: RatioStats | None = None
    off_policy_masked_frac: Tensor | None = None

    def metrics(self, share: float = 1.0) -> dict[str, Tensor]:
        """Metric name -> value, averaged over micro-batches by the update (`train/ratio_max` aside: it is a max).
        `share` multiplies the loss terms (`token_mean`: this micro-batch holds 1/share of the step's objective)."""
        out = {
            "train/loss": self.loss.detach() * share if share != 1.0 else self.loss.detach(),
            "train/policy_loss": self.policy_loss * share if share != 1.0 else self.policy_loss,
            "train/kl": self.kl,
            "train/entropy": self.entropy,
        }
        if self.entropy_bonus is not None:
            out["train/entropy_bonus"] = self.entropy_bonus * share if share != 1.0 else self.entropy_bonus
        if self.ratio is not None:
            out["train/clip_fraction"] = self.ratio.clip_fraction
            out["train/clip_fraction_low"] = self.ratio.clip_fraction_low
            out["train/clip_fraction_high"] = self.ratio.clip_fraction_high
            out["train/ratio_mean"] = self.ratio.ratio_mean
        if self.off_policy_masked_frac is not None:
            out["train/off_policy_masked_frac"] = self.off_policy_masked_frac
        return out


@dataclass(frozen=True)
class Objective(ABC):
    """A policy objective with the terms every one shares.

    Args:
        kl_coef: weight of the KL penalty `tokmean(e^D - D - 1)`, `D = log pi_ref - log pi_theta` (0: none).
        entropy_coef: weight of the entropy bonus subtracted from the loss (0: off).
        aggregation: how per-token terms reduce to the loss (`losses.aggregate`).
        max_new_tokens: the divisor of `seq_mean_token_sum_norm`.
        correction: the importance correction against the rollout engine's sampler (None: off).
        off_policy_threshold: DeepSeek-V3.2's off-policy sequence mask (None: off).
    """

    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str = "seq_mean_token_mean"
    max_new_tokens: int | None = None
    correction: SamplerCorrection | None = None
    off_policy_threshold: float | None = None
    # Whether the policy term reads pi_old (a ratio). The update then provides it: a no-grad pass before, or its
    # own first pass (`llm_pg.modules.update`).
    needs_old_logp: ClassVar[bool] = True

    @abstractmethod
    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats | None]:
        """The policy term of `micro` (a scalar with grad) from its log-probs `logp` `[b, w]`, each token's term
        multiplied by `weight` (`[b, w]` or `[b, 1]`; None: 1), and its ratio statistics (None without a ratio)."""

    def reduction(self, micro: MicroBatch) -> Reduction:
        """How `micro`'s policy term reduces: this objective's aggregation over the update's token counts."""
        return Reduction(self.aggregation, self.max_new_tokens, micro.num_tokens, micro.split_tokens)

    def policy_weight(self, logp: Tensor, micro: MicroBatch) -> tuple[Tensor | None, Tensor | None]:
        """The weights of `micro`'s policy term (None: 1): the correction against the sampler times the off-policy
        sequence mask, and the share of rows the mask drops (None when it is off)."""
        rows = micro.rows
        weight = None if self.correction is None else sampler_weight(rows, self.correction, micro.old_logp)
        if self.off_policy_threshold is None:
            return weight, None
        sampler = sampler_logp(rows, micro.old_logp)
        sampler = logp.detach() if sampler is None else sampler
        keep = off_policy_keep(rows.advantages, logp, sampler, rows.completion_mask, self.off_policy_threshold)
        return (keep if weight is None else weight * keep), 1.0 - keep.mean()

    def __call__(self, logp: Tensor, entropy: Tensor | None, micro: MicroBatch) -> LossOutput:
        """`micro`'s `LossOutput` from its log-probs `logp` `[b, w]` and token entropies `entropy` `[b, w]` (with
        their gradient when `entropy_coef` > 0)."""
        rows, split = micro.rows, micro.split_tokens
        mask = rows.completion_mask
        weight, masked_frac = self.policy_weight(logp, micro)
        policy_loss, ratio = self.policy_term(logp, micro, weight)
        kl_loss, kl = kl_term(logp, rows.ref_logp, mask, self.kl_coef, self.aggregation, micro.num_tokens, split)
        loss, bonus = policy_loss + kl_loss, None
        if self.entropy_coef > 0:  # loss - entropy_coef * tokmean(H)
            bonus = entropy_bonus(entropy, mask, self.entropy_coef, self.aggregation, micro.num_tokens, split)
            loss, bonus, entropy = loss - bonus, bonus.detach(), entropy.detach()
        return LossOutput(
            loss=loss,
            policy_loss=policy_loss.detach(),
            kl=kl.detach(),
            entropy=token_mean_share(entropy.detach(), mask, split),
            entropy_bonus=bonus,
            ratio=ratio,
            off_policy_masked_frac=masked_frac,
        )


@dataclass(frozen=True)
class ClippedSurrogate(Objective):
    """GRPO's clipped surrogate (the course): `min(rho A, clip(rho, 1 - clip_eps, 1 + clip_eps_high) A)` per token,
    `rho` per token (`ratio_level: token`) or per completion (`sequence`: GSPO). `clip_eps_high` None: `clip_eps`."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    ratio_level: str = "token"

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats]:
        rows, reduce = micro.rows, self.reduction(micro)
        return clipped_term(
            logp, micro.old_logp, rows.completion_mask, rows.advantages, reduce, self.clip_eps, self.clip_eps_high,
            self.ratio_level, weight,
        )  # fmt: skip


@dataclass(frozen=True)
class GSPO(ClippedSurrogate):
    """GSPO (Zheng et al., 2025): the clipped surrogate over one length-normalised ratio per completion,
    `rho_i = exp(seqmean_i(logp - old_logp))`."""

    ratio_level: str = "sequence"


@dataclass(frozen=True)
class CISPO(Objective):
    """CISPO (MiniMax-M1, 2025): each token's `A * logp` weighted by its detached ratio capped at
    `1 + clip_eps_high` (no lower bound); `ratio_level` as `ClippedSurrogate`'s."""

    clip_eps_high: float = 0.2
    ratio_level: str = "token"

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats]:
        rows, reduce = micro.rows, self.reduction(micro)
        return cispo_term(
            logp, micro.old_logp, rows.completion_mask, rows.advantages, reduce, self.clip_eps_high, self.ratio_level,
            weight,
        )  # fmt: skip


@dataclass(frozen=True)
class SequenceMean(Objective):
    """GR-REINFORCE's policy term (the course): `-mean_i(A_i * seqmean_i(logp))` under the default aggregation; no
    ratio, so no pi_old."""

    needs_old_logp: ClassVar[bool] = False

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, None]:
        rows = micro.rows
        return reinforce_term(logp, rows.completion_mask, rows.advantages, self.reduction(micro), weight), None


# Short names for the objectives (`policy_loss` in the config): each maps to its class.
OBJECTIVES: dict[str, type[Objective]] = {
    "clip": ClippedSurrogate,
    "gspo": GSPO,
    "cispo": CISPO,
    "sequence_mean": SequenceMean,
}
