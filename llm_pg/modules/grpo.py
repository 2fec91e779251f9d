"""GRPO: the clipped surrogate over reused rollouts, with a KL penalty to a frozen reference.

Objective, minimised for `ppo_epochs` passes over each rollout (defaults: the course's):

    rho_i^t = pi_theta(y_i^t) / pi_old(y_i^t)
    loss = -mean_i( seqmean_i( min(rho A_i, clip(rho, 1-clip_eps, 1+clip_eps) A_i) ) ) + kl_coef * tokmean(e^D - D - 1)

Variants (docs/algorithms.md): the `objective` group (`clip_eps_high`, DAPO's clip-higher: the upper bound
1 + clip_eps_high; `gspo`: one length-normalised ratio per completion; `cispo`: `-sg(min(rho, 1 + clip_eps_high))
A_i logp`, a clipped and detached weight instead of a clipped surrogate; `aggregation`), and the base module's
`advantage`, `filter_zero_std_groups`, `mask_truncated`.

Departures from the paper (Shao et al., 2024): advantages are clipped to +-adv_clip; pi_old and pi_ref
log-probs are computed once per rollout, at `logprob_temperature` like pi_theta (default 1.0: the raw
logits, as in the course, although sampling may run at another T), so the first micro-batch has rho = 1;
the KL term is a token mean over each micro-batch rather than a per-sequence mean. With `correction: {mode:
token_truncate, max: C}` each token's surrogate is also weighted by `min(pi_old / pi_sampler, C)` (truncated
importance sampling against the rollout engine; off by default, as in the course); `correction.mode` picks among
four such corrections, and `correction.off_policy_mask_threshold` drops far off-policy completions with negative
advantages (`Objective.policy_weight`).

pi_old without a separate pass: when one optimizer step covers a whole pass (the course's configs), no weight
changes before every row's first forward, so pi_old is the detached log-prob of the first pass, exactly when
the policy has no dropout. With dropout (LoRA's 0.05 in the course's configs) the first pass's log-probs are
those of a dropout-perturbed policy, not of the sampling policy (eval mode): the separate no-grad pass is kept
unless `speed.reuse_first_pass_logp: true` trades that exactness for one forward pass fewer per iteration.
"""

from __future__ import annotations

from llm_pg.core.objectives import ClippedSurrogate, ObjectiveFactory
from llm_pg.modules.base import PolicyGradientModule
from llm_pg.modules.settings import check_grpo_settings


class GRPOModule(PolicyGradientModule):
    """GRPO. Takes every `PolicyGradientModule` argument plus:

    Args:
        ppo_epochs: passes over each rollout.
        objective: GRPO's default is the course's clipped surrogate (`clip`); `gspo` and `cispo` are the other
            objectives with a ratio. `sequence_mean` has none and is refused: reusing a rollout needs a ratio.
    """

    def __init__(self, *args, ppo_epochs: int = 2, objective: ObjectiveFactory = ClippedSurrogate, **kwargs) -> None:
        check_grpo_settings(ppo_epochs)
        super().__init__(*args, objective=objective, **kwargs)
        self.save_hyperparameters(ignore=["objective"])
        self.record_objective()
        if not self.needs_pi_old:
            raise ValueError(
                f"model.objective={type(self.objective).__name__} has no ratio, and GRPO reuses each rollout for "
                "ppo_epochs passes: use an objective with a ratio (clip, gspo, cispo), or "
                "llm_pg.modules.ReinforceModule"
            )

    @property
    def epochs(self) -> int:
        return self.hparams.ppo_epochs
