"""The policy objectives as components, pure tensor math: one class per loss, built on the policy terms of
`llm_pg.core.losses`.

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
(docs/algorithms.md, "Add a loss here"). `llm_pg.core.losses.grpo_loss`, `cispo_loss` and `reinforce_loss` are the
same objectives with the KL term, as plain functions (the fixed core API; the course-parity tests compare them
with the course's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from llm_pg.core.correction import SamplerCorrection, off_policy_keep, sampler_logp, sampler_weight
from llm_pg.core.losses import (
    LossAggregation,
    RatioLevel,
    RatioStats,
    Reduction,
    cispo_term,
    clipped_term,
    entropy_bonus,
    kl_term,
    reinforce_term,
    token_mean_share,
)
from llm_pg.core.rollout import MicroBatch


@dataclass(frozen=True)
class LossTerms:
    """What an objective takes from the module's settings rather than from its own (`objective.init_args`): the
    course's `kl_coef` and `clip_eps`, the completion budget and the correction against the sampler.

    Args:
        kl_coef: weight of the KL penalty `tokmean(e^D - D - 1)`, `D = log pi_ref - log pi_theta` (0: none).
        clip_eps: the ratio's clip range `[1 - clip_eps, 1 + clip_eps]` of an objective with a ratio.
        max_new_tokens: the divisor of `seq_mean_token_sum_norm`.
        correction: the importance correction against the rollout engine's sampler (None: off).
        off_policy_threshold: DeepSeek-V3.2's off-policy sequence mask (None: off).
    """

    kl_coef: float = 0.0
    clip_eps: float = 0.2
    max_new_tokens: int | None = None
    correction: SamplerCorrection | None = None
    off_policy_threshold: float | None = None


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
    """A policy objective with the terms every one shares. The config chooses it by class (`objective: {class_path:
    ..., init_args: ...}`, or a short name of `OBJECTIVES`) and gives the fields after `terms`; the module supplies
    `terms` (`LossTerms`) from its own keys.

    Args:
        terms: the module's settings an objective reads (`LossTerms`).
        aggregation: how per-token terms reduce to the loss: `seq_mean_token_mean` (the course) | `token_mean` |
            `seq_mean_token_sum_norm` (`losses.aggregate`).
        entropy_coef: the loss subtracts `entropy_coef` times the token mean of the sampled positions' next-token
            entropy (with its gradient), logged as `train/entropy_bonus` (0: off, the course).
    """

    terms: LossTerms
    aggregation: LossAggregation = "seq_mean_token_mean"
    entropy_coef: float = 0.0
    # Whether the policy term reads pi_old (a ratio). The update then provides it: a no-grad pass before, or its
    # own first pass (`llm_pg.modules.update`).
    needs_old_logp: ClassVar[bool] = True

    @abstractmethod
    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats | None]:
        """The policy term of `micro` (a scalar with grad) from its log-probs `logp` `[b, w]`, each token's term
        multiplied by `weight` (`[b, w]` or `[b, 1]`; None: 1), and its ratio statistics (None without a ratio)."""

    def reduction(self, micro: MicroBatch) -> Reduction:
        """How `micro`'s policy term reduces: this objective's aggregation over the update's token counts."""
        return Reduction(self.aggregation, self.terms.max_new_tokens, micro.num_tokens, micro.split_tokens)

    def policy_weight(self, logp: Tensor, micro: MicroBatch) -> tuple[Tensor | None, Tensor | None]:
        """The weights of `micro`'s policy term (None: 1): the correction against the sampler times the off-policy
        sequence mask, and the share of rows the mask drops (None when it is off)."""
        rows, terms = micro.rows, self.terms
        weight = None if terms.correction is None else sampler_weight(rows, terms.correction, micro.old_logp)
        if terms.off_policy_threshold is None:
            return weight, None
        sampler = sampler_logp(rows, micro.old_logp)
        sampler = logp.detach() if sampler is None else sampler
        keep = off_policy_keep(rows.advantages, logp, sampler, rows.completion_mask, terms.off_policy_threshold)
        return (keep if weight is None else weight * keep), 1.0 - keep.mean()

    def __call__(self, logp: Tensor, entropy: Tensor | None, micro: MicroBatch) -> LossOutput:
        """`micro`'s `LossOutput` from its log-probs `logp` `[b, w]` and token entropies `entropy` `[b, w]` (with
        their gradient when `entropy_coef` > 0)."""
        rows, split = micro.rows, micro.split_tokens
        mask = rows.completion_mask
        weight, masked_frac = self.policy_weight(logp, micro)
        policy_loss, ratio = self.policy_term(logp, micro, weight)
        kl_coef = self.terms.kl_coef
        kl_loss, kl = kl_term(logp, rows.ref_logp, mask, kl_coef, self.aggregation, micro.num_tokens, split)
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
    with the module's `clip_eps`.

    Args:
        clip_eps_high: the upper clip `1 + clip_eps_high` (DAPO's clip-higher); null: `clip_eps`.
    """

    clip_eps_high: float | None = None
    ratio_level: ClassVar[RatioLevel] = "token"  # one ratio per token

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats]:
        rows, reduce = micro.rows, self.reduction(micro)
        return clipped_term(
            logp, micro.old_logp, rows.completion_mask, rows.advantages, reduce, self.terms.clip_eps,
            self.clip_eps_high, self.ratio_level, weight,
        )  # fmt: skip


@dataclass(frozen=True)
class GSPO(ClippedSurrogate):
    """GSPO (Zheng et al., 2025): the clipped surrogate over one length-normalised ratio per completion,
    `rho_i = exp(seqmean_i(logp - old_logp))`."""

    ratio_level: ClassVar[RatioLevel] = "sequence"


@dataclass(frozen=True)
class CISPO(Objective):
    """CISPO (MiniMax-M1, 2025): each token's `A * logp` weighted by its detached ratio capped at `1 + clip_eps_high`
    (no lower bound).

    Args:
        clip_eps_high: the cap's `clip_eps_high`; null: the module's `clip_eps`.
        ratio_level: `token` (one ratio per token) or `sequence` (GSPO's, one per completion).
    """

    clip_eps_high: float | None = None
    ratio_level: RatioLevel = "token"

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, RatioStats]:
        rows, reduce = micro.rows, self.reduction(micro)
        high = self.terms.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return cispo_term(
            logp, micro.old_logp, rows.completion_mask, rows.advantages, reduce, high, self.ratio_level, weight
        )


@dataclass(frozen=True)
class SequenceMean(Objective):
    """GR-REINFORCE's policy term (the course): `-mean_i(A_i * seqmean_i(logp))` under the default aggregation; no
    ratio, so no pi_old."""

    needs_old_logp: ClassVar[bool] = False

    def policy_term(self, logp: Tensor, micro: MicroBatch, weight: Tensor | None) -> tuple[Tensor, None]:
        rows = micro.rows
        return reinforce_term(logp, rows.completion_mask, rows.advantages, self.reduction(micro), weight), None


# Short names for the objectives (`objective: cispo` in a config): each maps to its class.
OBJECTIVES: dict[str, type[Objective]] = {
    "clip": ClippedSurrogate,
    "gspo": GSPO,
    "cispo": CISPO,
    "sequence_mean": SequenceMean,
}

# What the config's `objective` key holds: an objective's class with its own settings, given `LossTerms` by the module
# (jsonargparse's callable form: `class_path` and `init_args` without `terms`).
ObjectiveFactory = Callable[[LossTerms], Objective]
