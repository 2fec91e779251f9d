"""GR-REINFORCE: group-normalised REINFORCE with a KL penalty to a frozen reference.

Objective, minimised once per rollout (one on-policy pass; defaults: the course's):

    loss = -mean_i( A_i * seqmean_i(log pi_theta(y_i)) ) + kl_coef * tokmean(e^D - D - 1),
    A_i = clip((r_i - mean_group(r)) / (std_group(r) + eps), -adv_clip, adv_clip),  D = log pi_ref - log pi_theta

Variants (docs/algorithms.md): the base module's `advantage` (dr_grpo, rloo, reinforce_pp), `loss_aggregation`
(token_mean, seq_mean_token_sum_norm), `filter_zero_std_groups` and `mask_truncated`.

Departures from textbook REINFORCE (Williams, 1992): the baseline is the group mean and the scale the
group std (as in GRPO, Shao et al., 2024); log-probs are averaged over each completion's tokens, not
summed; log-probs are taken at `logprob_temperature` (default 1.0, the raw logits, as in the course,
whatever the sampling temperature; null: the sampling temperature). With `tis_cap: C` each token's term is
weighted by `min(pi_old / pi_sampler, C)` (truncated importance sampling against the rollout engine; off by
default, as in the course); `sampler_is_mode` and `off_policy_mask_threshold` as in GRPO (`policy_weight`).
"""

from __future__ import annotations

from llm_pg.core.objectives import Objective, SequenceMean
from llm_pg.modules.base import PolicyGradientModule


class ReinforceModule(PolicyGradientModule):
    """GR-REINFORCE. Takes every `PolicyGradientModule` argument and no other: the GRPO keys (`ppo_epochs`,
    `clip_eps`, `clip_eps_high`, `ratio_level`, `reuse_first_pass_logp`, `policy_loss`) are not in its help, a
    config that switches its class to this one drops them, and one that sets them here is refused naming the key
    (`llm_pg.modules.settings.grpo_key_hint`)."""

    @property
    def epochs(self) -> int:
        return 1

    @property
    def objective(self) -> Objective:
        """GR-REINFORCE's sequence-mean policy term (`llm_pg.core.objectives.SequenceMean`)."""
        return SequenceMean(**self.objective_terms())
