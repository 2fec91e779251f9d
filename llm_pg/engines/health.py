"""How far the rollout engine's sampler is from the trainer's pi_old, and the importance weight that corrects for it.

An engine that reports its own log-prob of every sampled token (vLLM: `RolloutBatch.sampled_logp`) can be compared
with the trainer's pi_old of the same tokens (`old_logp`). The two differ by float rounding when the engine holds
the trainer's weights (below 4e-6 in float32 on the CPU; bf16 kernels on a GPU: a token mean near 1e-2 and a max
above 0.1 are normal, docs/runs.md), and by more when it samples from stale or rounded weights. Truncated importance
sampling (`correction: {mode: token_truncate, max: C}`, docs/algorithms.md) weights each token's policy-gradient
term by `min(exp(old_logp - sampler_logp), C)`; `correction.mode` chooses among four such corrections (per token or per
sequence, truncated or masked: `llm_pg.core.correction.sampler_is_weight`). With the HF engine the sampler is the policy
itself: `sampler_logp = old_logp` and the weight is exactly 1.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from llm_pg.core.correction import SEQUENCE_MODES, TRUNCATE_MODES, SamplerCorrection, sampler_logp, sampler_weight
from llm_pg.core.losses import masked_mean
from llm_pg.core.rollout import RolloutBatch

MISMATCH_QUANTILE = 0.99
TREND_WINDOW = 20  # iterations the mismatch trend looks back over
TREND_FACTOR = 2.0  # newer half's mean over the older half's that counts as a rise
TREND_FLOOR = 1e-3  # a newer-half mean below this never warns: float32 noise (1e-7) doubling is no drift


def logprob_mismatch(rollout: RolloutBatch, old_logp: Tensor | None = None) -> dict[str, float]:
    """`rollout/logprob_mismatch_{mean,p99,max}`: `|sampled_logp - old_logp|` over completion tokens (the token
    mean, the 99th percentile and the max), where the engine reported its own log-probs and pi_old is known (after
    the update, when it comes from the first pass: `old_logp`, default `rollout.old_logp`). Empty otherwise (HF)."""
    old_logp = rollout.old_logp if old_logp is None else old_logp
    if rollout.sampled_logp is None or old_logp is None or not rollout.completion_mask.any():
        return {}
    gap = (rollout.sampled_logp.to(old_logp.device) - old_logp).abs()  # [N, C]
    tokens = gap[rollout.completion_mask].float()  # [T]
    return {
        "rollout/logprob_mismatch_mean": masked_mean(gap, rollout.completion_mask).item(),
        "rollout/logprob_mismatch_p99": torch.quantile(tokens, MISMATCH_QUANTILE).item(),
        "rollout/logprob_mismatch_max": tokens.max().item(),
    }


def tis_metrics(
    rollout: RolloutBatch, correction: SamplerCorrection | None, old_logp: Tensor | None = None
) -> dict[str, float]:
    """With a correction against the sampler and pi_old known: `rollout/tis_weight_mean`, the mean weight (over
    completion tokens in the token modes, over completions in the sequence modes), and the share of those tokens or
    completions whose weight a bound changed: `rollout/tis_clipped_frac` (truncate modes) or `rollout/tis_masked_frac`
    (mask modes: the weight is 0). `old_logp`: pi_old, default `rollout.old_logp`."""
    old_logp = rollout.old_logp if old_logp is None else old_logp
    weight = sampler_weight(rollout, correction, old_logp)
    if weight is None or not rollout.completion_mask.any():
        return {}
    mask = rollout.completion_mask
    diff = (old_logp - sampler_logp(rollout, old_logp)) * mask  # [N, C]
    if correction.mode in SEQUENCE_MODES:
        diff, mask = diff.sum(-1, keepdim=True), mask.any(-1, keepdim=True)  # [N, 1]
    outside = diff > math.log(correction.high)
    if correction.low is not None:
        outside |= diff < math.log(correction.low)
    kind = "clipped" if correction.mode in TRUNCATE_MODES else "masked"
    return {
        "rollout/tis_weight_mean": masked_mean(weight, mask).item(),
        f"rollout/tis_{kind}_frac": masked_mean(outside.float(), mask).item(),
    }


class MismatchTrend:
    """Warns when `rollout/logprob_mismatch_mean` rises steadily: over the last `window` iterations, the newer
    half's average is more than `factor` times the older half's (and above `floor`). A steady rise means the sampler
    drifts away from the trainer (a weight push that loses updates, a stale engine), unlike the flat bf16 rounding
    level. After a warning the window starts over, so a drift warns once per window, not every iteration. The
    window is not checkpointed: after a resume it fills again."""

    def __init__(self, window: int = TREND_WINDOW, factor: float = TREND_FACTOR, floor: float = TREND_FLOOR) -> None:
        self.window, self.factor, self.floor = window, factor, floor
        self.means: deque[float] = deque(maxlen=window)

    def update(self, mean: float | None) -> str | None:
        """Record one iteration's mean (None: no figure this iteration); returns the warning text, or None."""
        if mean is None:
            return None
        self.means.append(mean)
        if len(self.means) < self.window:
            return None
        half = self.window // 2
        older, newer = list(self.means)[:half], list(self.means)[-half:]
        old_mean, new_mean = sum(older) / len(older), sum(newer) / len(newer)
        if new_mean < self.floor or new_mean <= self.factor * old_mean:
            return None
        self.means.clear()
        return (
            f"rollout/logprob_mismatch_mean rose from {old_mean:.2g} to {new_mean:.2g} over the last {self.window} "
            "iterations: the rollout engine samples from weights further and further from the trainer's (see "
            "docs/runs.md, 'Is the sampler in sync?'); model.init_args.correction (mode: token_truncate, max: 2.0, "
            "say) corrects the update for it"
        )


class SamplerHealth:
    """The `rollout/` figures of one iteration's rollout (mismatch and TIS), and the mismatch trend's warning
    (`warn`, e.g. Lightning's `rank_zero_warn`)."""

    def __init__(self, correction: SamplerCorrection | None, warn: Callable[[str], None]) -> None:
        self.correction = correction
        self.warn = warn
        self.trend = MismatchTrend()

    def __call__(self, rollout: RolloutBatch, old_logp: Tensor | None = None) -> dict[str, float]:
        """The figures of `rollout` against pi_old (`old_logp`, the update's; default `rollout.old_logp`): none
        when there is nothing to compare (the sampler is the policy and no correction is set: the module then does
        not call it)."""
        metrics = {**logprob_mismatch(rollout, old_logp), **tis_metrics(rollout, self.correction, old_logp)}
        message = self.trend.update(metrics.get("rollout/logprob_mismatch_mean"))
        if message:
            self.warn(message)
        return metrics
