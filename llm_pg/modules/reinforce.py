"""GR-REINFORCE: group-normalised REINFORCE with a KL penalty to a frozen reference.

Objective, minimised once per rollout (one on-policy pass):

    loss = -mean_i( A_i * seqmean_i(log pi_theta(y_i)) ) + kl_coef * tokmean(e^D - D - 1),
    A_i = clip((r_i - mean_group(r)) / (std_group(r) + eps), -adv_clip, adv_clip),  D = log pi_ref - log pi_theta

Departures from textbook REINFORCE (Williams, 1992): the baseline is the group mean and the scale the
group std (as in GRPO, Shao et al., 2024); log-probs are averaged over each completion's tokens, not
summed; log-probs are taken at the sampling temperature.
"""

from __future__ import annotations

from torch import Tensor

from llm_pg.losses import reinforce_loss
from llm_pg.modules.base import PolicyGradientModule
from llm_pg.rollout import RolloutBatch


class ReinforceModule(PolicyGradientModule):
    """GR-REINFORCE. Takes every `PolicyGradientModule` argument; `ppo_epochs` must stay 1 (on-policy)."""

    def __init__(self, *args, ppo_epochs: int = 1, **kwargs) -> None:
        if ppo_epochs != 1:
            raise ValueError(
                f"model.ppo_epochs={ppo_epochs}: REINFORCE makes one on-policy pass per rollout; remove ppo_epochs "
                "or use llm_pg.modules.GRPOModule to reuse rollouts with a clipped ratio"
            )
        super().__init__(*args, **kwargs)

    @property
    def epochs(self) -> int:
        return 1

    def loss(self, logp: Tensor, rollout: RolloutBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return reinforce_loss(
            logp, rollout.completion_mask, rollout.advantages, rollout.ref_logp, kl_coef=self.hparams.kl_coef
        )
