"""GRPO: the clipped surrogate over reused rollouts, with a KL penalty to a frozen reference.

Objective, minimised for `ppo_epochs` passes over each rollout (defaults: the course's):

    rho_i^t = pi_theta(y_i^t) / pi_old(y_i^t)
    loss = -mean_i( seqmean_i( min(rho A_i, clip(rho, 1-clip_eps, 1+clip_eps) A_i) ) ) + kl_coef * tokmean(e^D - D - 1)

Variants (docs/algorithms.md): `clip_eps_high` (DAPO's clip-higher: the upper bound 1 + clip_eps_high),
`ratio_level: sequence` (GSPO: one length-normalised ratio per completion), `policy_loss: cispo` (CISPO:
`-sg(min(rho, 1 + clip_eps_high)) A_i logp`, a clipped and detached weight instead of a clipped surrogate), and the
base module's `advantage`,
`loss_aggregation`, `filter_zero_std_groups`, `mask_truncated`.

Departures from the paper (Shao et al., 2024): advantages are clipped to +-adv_clip; pi_old and pi_ref
log-probs are computed once per rollout, at `logprob_temperature` like pi_theta (default 1.0: the raw
logits, as in the course, although sampling may run at another T), so the first micro-batch has rho = 1;
the KL term is a token mean over each micro-batch rather than a per-sequence mean. With `tis_cap: C` each token's
surrogate is also weighted by `min(pi_old / pi_sampler, C)` (truncated importance sampling against the rollout
engine; off by default, as in the course); `sampler_is_mode` picks among four such corrections, and
`off_policy_mask_threshold` drops far off-policy completions with negative advantages (`policy_weight`).

pi_old without a separate pass: when one optimizer step covers a whole pass (the course's configs), no weight
changes before every row's first forward, so pi_old is the detached log-prob of the first pass, exactly when
the policy has no dropout. With dropout (LoRA's 0.05 in the course's configs) the first pass's log-probs are
those of a dropout-perturbed policy, not of the sampling policy (eval mode): the separate no-grad pass is kept
unless `reuse_first_pass_logp: true` trades that exactness for one forward pass fewer per iteration.
"""

from __future__ import annotations

from llm_pg.core.losses import RatioLevel
from llm_pg.core.objectives import CISPO, ClippedSurrogate, Objective, PolicyLoss
from llm_pg.modules.base import PolicyGradientModule
from llm_pg.modules.logprobs import has_dropout
from llm_pg.modules.settings import check_grpo_settings
from llm_pg.modules.update import steps_per_pass


class GRPOModule(PolicyGradientModule):
    """GRPO. Takes every `PolicyGradientModule` argument plus:

    Args:
        ppo_epochs: passes over each rollout.
        clip_eps: the ratio's lower clip `1 - clip_eps` (and upper, unless `clip_eps_high` is set).
        clip_eps_high: the upper clip `1 + clip_eps_high` (DAPO); null: `clip_eps`.
        ratio_level: `token` (course) or `sequence` (GSPO).
        reuse_first_pass_logp: take pi_old from the first pass even when the policy has dropout.
        policy_loss: `clip` (GRPO's clipped surrogate, the course) or `cispo` (MiniMax-M1's CISPO: each token's
            `A * logp` weighted by the detached ratio capped at `1 + clip_eps_high`, or `1 + clip_eps` when that is
            null; `clip_eps` sets no lower bound there). See docs/algorithms.md, "CISPO".
    """

    def __init__(
        self,
        *args,
        ppo_epochs: int = 2,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        ratio_level: RatioLevel = "token",
        reuse_first_pass_logp: bool = False,
        policy_loss: PolicyLoss = "clip",
        **kwargs,
    ) -> None:
        check_grpo_settings(ppo_epochs, clip_eps, clip_eps_high, ratio_level, reuse_first_pass_logp, policy_loss)
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()

    @property
    def epochs(self) -> int:
        return self.hparams.ppo_epochs

    @property
    def needs_pi_old(self) -> bool:
        return True

    @property
    def pi_old_from_first_pass(self) -> bool:
        """pi_old from the first pass: one optimizer step per pass, and no dropout unless the switch allows it."""
        hp = self.hparams
        rows = hp.prompts_per_step * hp.group_size
        if steps_per_pass(rows, hp.minibatch_size, hp.grad_accum_steps) != 1:
            return False
        return hp.reuse_first_pass_logp or not has_dropout(self.policy)

    @property
    def objective(self) -> Objective:
        """The clipped surrogate (`policy_loss: clip`; GSPO's sequence ratio with `ratio_level: sequence`) or CISPO,
        whose weight's bound is `1 + clip_eps_high`, else `1 + clip_eps`."""
        hp = self.hparams
        if hp.policy_loss == "cispo":
            high = hp.clip_eps if hp.clip_eps_high is None else hp.clip_eps_high
            return CISPO(**self.objective_terms(), clip_eps_high=high, ratio_level=hp.ratio_level)
        return ClippedSurrogate(
            **self.objective_terms(), clip_eps=hp.clip_eps, clip_eps_high=hp.clip_eps_high, ratio_level=hp.ratio_level
        )
