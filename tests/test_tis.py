"""Truncated importance sampling against the rollout engine (`correction: {mode: token_truncate, max: C}`) and the
sampler-health figures.

Weights and losses are checked against values worked out by hand; the trainer test shows that TIS under the
HF engine (sampler = pi_old, every weight exactly 1) leaves a run as it was. The stale-sampler test with vLLM is in
tests/test_vllm.py.
"""

import csv
import math

import pytest
import torch
from conftest import fit

from llm_pg.core.correction import SamplerCorrection, sampler_is_weight, sampler_weight
from llm_pg.core.losses import grpo_loss, reinforce_loss
from llm_pg.core.rollout import RolloutBatch
from llm_pg.engines.health import MismatchTrend, SamplerHealth, logprob_mismatch, tis_metrics
from llm_pg.modules import GRPOModule

OLD = torch.tensor([[-1.0, -2.0, -0.5, -0.7]])  # pi_old of four sampled tokens
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5, -0.6]])  # the engine's log-probs of the same tokens
MASK = torch.tensor([[True, True, True, False]])  # the fourth token is padding


def truncated_is_weight(old, sampler, cap):
    return sampler_is_weight(old, sampler, torch.ones_like(old, dtype=torch.bool), "token_truncate", cap)


def tis_weight(rollout, cap):
    return sampler_weight(rollout, None if cap is None else SamplerCorrection("token_truncate", cap))


def test_weight_is_the_ratio_to_the_sampler_truncated_at_the_cap():
    weight = truncated_is_weight(OLD, SAMPLER, cap=1.3)
    # exp(0.5) = 1.6487 -> capped at 1.3; exp(-1) = 0.36788; exp(0) = 1; exp(-0.1) = 0.904837
    torch.testing.assert_close(weight, torch.tensor([[1.3, 0.36788, 1.0, 0.904837]]), rtol=0, atol=1e-5)
    assert not weight.requires_grad
    huge = truncated_is_weight(torch.tensor([0.0]), torch.tensor([-1e4]), cap=2.0)  # exp(1e4) would overflow
    assert huge.item() == pytest.approx(2.0)


def test_grpo_loss_weights_each_tokens_surrogate_and_its_gradient():
    advantage = torch.tensor([1.3])
    logp = OLD.clone().requires_grad_(True)  # rho = 1 on every token: nothing clipped
    weight = truncated_is_weight(OLD, SAMPLER, cap=1.3)
    loss, stats = grpo_loss(logp, OLD, MASK, advantage, is_weight=weight)
    # seqmean over the 3 real tokens of w_t * rho_t * A: -(1.3 + 0.36788 + 1.0) * 1.3 / 3
    assert loss.item() == pytest.approx(-(1.3 + 0.36788 + 1.0) * 1.3 / 3, abs=1e-5)
    loss.backward()
    # d/dlogp_t of -w_t * exp(logp_t - old_t) * A / 3 at rho = 1: -w_t * A / 3; padding gets none
    expected = torch.tensor([[-1.3 * 1.3 / 3, -0.36788 * 1.3 / 3, -1.0 * 1.3 / 3, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-5)
    assert stats["policy_loss"].item() == pytest.approx(loss.item())


def test_grpo_weight_multiplies_the_clipped_surrogate():
    advantage = torch.tensor([1.3])
    logp = OLD + torch.tensor([[0.5, 0.0, 0.0, 0.0]])  # rho_0 = e^0.5 = 1.6487 > 1.2: clipped at 1.2 for A > 0
    weight = torch.tensor([[0.5, 1.0, 2.0, 7.0]])
    loss, _ = grpo_loss(logp, OLD, MASK, advantage, is_weight=weight)
    assert loss.item() == pytest.approx(-(0.5 * 1.2 + 1.0 + 2.0) * 1.3 / 3, abs=1e-6)


def test_reinforce_loss_weights_the_policy_term_not_the_kl_term():
    advantage = torch.tensor([1.3])
    ref = OLD - 0.2  # approx_kl = e^-0.2 + 0.2 - 1 = 0.0187308 per token
    weight = truncated_is_weight(OLD, SAMPLER, cap=1.3)
    logp = OLD.clone().requires_grad_(True)
    loss, stats = reinforce_loss(logp, MASK, advantage, ref_logp=ref, kl_coef=0.1, is_weight=weight)
    policy = -1.3 * (1.3 * -1.0 + 0.36788 * -2.0 + 1.0 * -0.5) / 3  # -A * seqmean(w * logp)
    kl = math.exp(-0.2) + 0.2 - 1
    assert stats["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(policy + 0.1 * kl, abs=1e-5)
    unweighted, _ = reinforce_loss(OLD, MASK, advantage, ref_logp=ref, kl_coef=0.1)
    assert abs(unweighted.item() - loss.item()) > 0.1  # the weights change the value: the check has teeth


def test_no_weight_and_unit_weights_give_the_courses_loss():
    advantage = torch.tensor([1.3])
    logp = OLD + 0.1
    plain, _ = grpo_loss(logp, OLD, MASK, advantage, ref_logp=OLD - 0.2, kl_coef=0.05)
    ones, _ = grpo_loss(logp, OLD, MASK, advantage, ref_logp=OLD - 0.2, kl_coef=0.05, is_weight=torch.ones_like(OLD))
    assert torch.equal(plain, ones)


def _rollout(old_logp, sampled_logp, mask) -> RolloutBatch:
    rows, width = mask.shape
    return RolloutBatch(
        input_ids=torch.zeros(rows, 2 + width, dtype=torch.long),
        attention_mask=torch.ones(rows, 2 + width, dtype=torch.long),
        completion_mask=mask,
        rewards=torch.zeros(rows),
        advantages=torch.zeros(rows),
        old_logp=old_logp,
        sampled_logp=sampled_logp,
        prompt_len=2,
    )


def test_tis_figures_and_the_hf_case():
    rollout = _rollout(OLD, SAMPLER, MASK)
    metrics = tis_metrics(rollout, SamplerCorrection("token_truncate", 1.3))
    assert metrics["rollout/tis_weight_mean"] == pytest.approx((1.3 + 0.36788 + 1.0) / 3, abs=1e-5)
    assert metrics["rollout/tis_clipped_frac"] == pytest.approx(1 / 3)  # only the first token exceeds the cap
    assert tis_metrics(rollout, None) == {} and tis_weight(rollout, None) is None
    hf = _rollout(OLD, None, MASK)  # no engine log-probs: the sampler is pi_old, every weight exactly 1
    assert torch.equal(tis_weight(hf, 2.0), torch.ones_like(OLD))
    unit = {"rollout/tis_weight_mean": 1.0, "rollout/tis_clipped_frac": 0.0}
    assert tis_metrics(hf, SamplerCorrection("token_truncate", 2.0)) == unit
    assert tis_weight(_rollout(None, None, MASK), 2.0) is None  # REINFORCE with HF: no pi_old, no weight


def test_mismatch_reports_mean_p99_and_max_over_completion_tokens():
    gap = torch.linspace(0.001, 0.2, 200).view(2, 100)  # |sampled - old|: 200 tokens, 0.001 .. 0.2
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[1, 90:] = False  # the last 10 are padding (0.1905 .. 0.2): the max is 0.1895
    padded = torch.where(mask, gap, 5.0)  # padding far off: it must be left out of every figure
    metrics = logprob_mismatch(_rollout(torch.zeros(2, 100), -padded, mask))
    kept = gap[mask]
    assert metrics["rollout/logprob_mismatch_max"] == pytest.approx(kept.max().item())
    assert metrics["rollout/logprob_mismatch_mean"] == pytest.approx(kept.mean().item(), rel=1e-5)
    ranked = kept.sort().values  # p99 of 190 values: between the 188th and 189th smallest (linear interpolation)
    assert ranked[187] <= metrics["rollout/logprob_mismatch_p99"] <= ranked[188]
    assert logprob_mismatch(_rollout(OLD, None, MASK)) == {}


def test_trend_warns_on_a_steady_rise_only():
    trend = MismatchTrend(window=10, factor=2.0, floor=1e-3)
    generator = torch.Generator().manual_seed(0)
    flat = 0.012 + 0.004 * torch.rand(40, generator=generator)  # bf16 level with noise: never a warning
    assert all(trend.update(float(m)) is None for m in flat)
    tiny = MismatchTrend(window=10)
    assert all(tiny.update(1e-7 * 1.5**i) is None for i in range(20))  # float32 noise rising (to 2e-4): below the floor
    rising = MismatchTrend(window=10, factor=2.0, floor=1e-3)
    messages = [rising.update(0.01 * 1.3**i) for i in range(10)]  # x1.3 per iteration: x3.7 between halves
    assert messages[:9] == [None] * 9 and "rose from" in messages[9]
    assert rising.update(None) is None and rising.update(0.2) is None  # the window starts over after a warning


def test_sampler_health_warns_through_the_callback():
    warnings = []
    health = SamplerHealth(correction=None, warn=warnings.append)
    health.trend = MismatchTrend(window=4, factor=2.0, floor=1e-3)
    for scale in (0.01, 0.01, 0.05, 0.05):
        metrics = health(_rollout(OLD, OLD - scale, MASK))
        assert metrics["rollout/logprob_mismatch_mean"] == pytest.approx(scale, rel=1e-5)
    assert len(warnings) == 1 and "model.init_args.correction" in warnings[0]


def test_a_cap_below_one_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^model\.correction\.max must be >= 1, got 0\.5; "):
        GRPOModule(correction={"mode": "token_truncate", "max": 0.5})


TIS = ["--model.init_args.correction.mode=token_truncate", "--model.init_args.correction.max=2.0"]


def _logged(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def test_tis_under_hf_leaves_the_run_unchanged(tmp_path, random_model_dir):
    """HF samples with the policy itself, so each weight is exp(0) = 1: the same weights and rewards as the course."""
    digits = ["--data.task=conftest.DigitTask", "--model.init_args.iterations=2", "--model.init_args.lr=1e-2"]
    plain = fit(tmp_path / "plain", random_model_dir, *digits).model
    capped = fit(tmp_path / "tis", random_model_dir, *digits, *TIS).model
    for name, weight in plain.policy.state_dict().items():
        torch.testing.assert_close(capped.policy.state_dict()[name], weight, rtol=0, atol=1e-6)
    moved = max((w - plain.reference.state_dict()[n]).abs().max().item() for n, w in plain.policy.state_dict().items())
    assert moved > 1e-3  # the runs trained: equal weights are not just the initial ones
    rows_plain = [r for r in _logged(tmp_path / "plain" / "run") if "train/reward" in r]
    rows_tis = [r for r in _logged(tmp_path / "tis" / "run") if "train/reward" in r]
    assert [r["train/reward"] for r in rows_plain] == [r["train/reward"] for r in rows_tis]
    assert all(r["rollout/tis_weight_mean"] == 1.0 and r["rollout/tis_clipped_frac"] == 0.0 for r in rows_tis)
    assert all("rollout/tis_weight_mean" not in r for r in rows_plain)
