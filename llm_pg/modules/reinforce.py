"""GR-REINFORCE: group-normalised REINFORCE with a KL penalty to a frozen reference.

Objective, minimised once per rollout (one on-policy pass; defaults: the course's):

    loss = -mean_i( A_i * seqmean_i(log pi_theta(y_i)) ) + kl_coef * tokmean(e^D - D - 1),
    A_i = clip((r_i - mean_group(r)) / (std_group(r) + eps), -adv_clip, adv_clip),  D = log pi_ref - log pi_theta

Variants (docs/algorithms.md): the base module's `advantage` (dr_grpo, rloo, reinforce_pp), the objective's
`aggregation` (token_mean, seq_mean_token_sum_norm), `filter_zero_std_groups` and `mask_truncated`; and any objective
with a ratio (`clip`, `gspo`, `cispo`) in place of the sequence mean, which then reads pi_old as GRPO's does: it
clips the later optimizer steps of a pass that takes several.

Departures from textbook REINFORCE (Williams, 1992): the baseline is the group mean and the scale the
group std (as in GRPO, Shao et al., 2024); log-probs are averaged over each completion's tokens, not
summed; log-probs are taken at `logprob_temperature` (default 1.0, the raw logits, as in the course,
whatever the sampling temperature; null: the sampling temperature). With `correction: {mode: token_truncate, max:
C}` each token's term is weighted by `min(pi_old / pi_sampler, C)` (truncated importance sampling against the
rollout engine; off by default, as in the course); the other `correction` keys as in GRPO (`policy_weight`).
"""

from __future__ import annotations

from llm_pg.core.objectives import ObjectiveFactory, SequenceMean
from llm_pg.modules.base import PolicyGradientModule


class ReinforceModule(PolicyGradientModule):
    """GR-REINFORCE: one pass over each rollout, every `PolicyGradientModule` argument.

    Its default objective is the course's sequence mean (`sequence_mean`). `ppo_epochs` is GRPO's alone: a config that
    sets it here is refused naming the key (`llm_pg.modules.settings.grpo_key_hint`).

    Args:
        objective: `sequence_mean` (the course), or an objective with a ratio (`clip`, `gspo`, `cispo`).
    """

    def __init__(self, *args, objective: ObjectiveFactory = SequenceMean, **kwargs) -> None:
        super().__init__(*args, objective=objective, **kwargs)

    @property
    def epochs(self) -> int:
        return 1
