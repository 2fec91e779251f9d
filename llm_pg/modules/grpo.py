"""GRPO: the clipped surrogate over reused rollouts, with a KL penalty to a frozen reference.

Objective, minimised for `ppo_epochs` passes over each rollout:

    rho_i^t = pi_theta(y_i^t) / pi_old(y_i^t)
    loss = -mean_i( seqmean_i( min(rho A_i, clip(rho, 1-clip_eps, 1+clip_eps) A_i) ) ) + kl_coef * tokmean(e^D - D - 1)

Departures from the paper (Shao et al., 2024): advantages are clipped to +-adv_clip; pi_old and pi_ref
log-probs are computed once per rollout at the sampling temperature (so the first micro-batch has
rho = 1 exactly); the KL term is a token mean over each micro-batch rather than a per-sequence mean.
"""

from __future__ import annotations

from torch import Tensor

from llm_pg.losses import grpo_loss
from llm_pg.modules.base import PolicyGradientModule
from llm_pg.rollout import RolloutBatch


class GRPOModule(PolicyGradientModule):
    """GRPO. Takes every `PolicyGradientModule` argument plus `ppo_epochs` and `clip_eps`."""

    def __init__(self, *args, ppo_epochs: int = 2, clip_eps: float = 0.2, **kwargs) -> None:
        if ppo_epochs < 1:
            raise ValueError(f"model.ppo_epochs must be >= 1, got {ppo_epochs}")
        if not 0 < clip_eps < 1:
            raise ValueError(f"model.clip_eps must be in (0, 1), got {clip_eps}")
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()

    @property
    def epochs(self) -> int:
        return self.hparams.ppo_epochs

    @property
    def needs_old_logp(self) -> bool:
        return True

    def loss(self, logp: Tensor, rollout: RolloutBatch) -> tuple[Tensor, dict[str, Tensor]]:
        hp = self.hparams
        return grpo_loss(
            logp,
            rollout.old_logp,
            rollout.completion_mask,
            rollout.advantages,
            rollout.ref_logp,
            clip_eps=hp.clip_eps,
            kl_coef=hp.kl_coef,
        )
