"""The objectives as components (`llm_pg.core.objectives`): each class's loss equals its plain function's (the ones
the course-parity tests check), the base class adds the same KL, entropy bonus and sampler weights to every one,
and the metric names are the ones `LossOutput.metrics` spells out."""

import pytest
import torch

from llm_pg.core.correction import SamplerCorrection
from llm_pg.core.losses import cispo_loss, entropy_bonus, grpo_loss, reinforce_loss, token_mean_share
from llm_pg.core.objectives import CISPO, GSPO, OBJECTIVES, ClippedSurrogate, LossTerms, Objective, SequenceMean
from llm_pg.core.rollout import MicroBatch, RolloutBatch


def _micro(split: bool = False, sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor, MicroBatch]:
    """6 rows of unequal lengths, pi_old and pi_ref near the policy (some ratios clip), entropies with a gradient."""
    torch.manual_seed(0)
    logp = (torch.randn(6, 5) - 2).requires_grad_()
    entropy = (torch.rand(6, 5) + 0.5).requires_grad_()
    mask = torch.arange(5) < torch.tensor([5, 2, 4, 3, 5, 1]).unsqueeze(1)
    rows = RolloutBatch(
        input_ids=torch.zeros(6, 7, dtype=torch.long),
        attention_mask=torch.ones(6, 7, dtype=torch.long),
        completion_mask=mask,
        rewards=torch.zeros(6),
        advantages=torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3]),
        ref_logp=logp.detach() + 0.3 * torch.randn(6, 5),
        sampled_logp=logp.detach() + 0.2 * torch.randn(6, 5) if sampled else None,
        prompt_len=2,
    )
    old = logp.detach() + 0.4 * torch.randn(6, 5)
    counts = torch.tensor([7.0, 7.0, 8.0, 8.0, 6.0, 6.0]) if split else None
    return logp, entropy, MicroBatch(rows, old, counts, None)


@pytest.mark.parametrize("split", [False, True])
def test_each_objective_is_its_function_with_the_shared_kl(split):
    # `split`: the token means over each row's micro-batch of the update's split (its grouped forwards).
    logp, entropy, micro = _micro(split)
    rows, terms, counts = micro.rows, LossTerms(kl_coef=0.05, clip_eps=0.2), {"split_tokens": micro.split_tokens}
    args = (logp, micro.old_logp, rows.completion_mask, rows.advantages, rows.ref_logp)
    cases = [
        (ClippedSurrogate(terms, clip_eps_high=0.28), grpo_loss(*args, 0.2, 0.05, 0.28, **counts)),
        (GSPO(terms), grpo_loss(*args, 0.2, 0.05, ratio_level="sequence", **counts)),
        (CISPO(terms, clip_eps_high=0.3), cispo_loss(*args, clip_eps_high=0.3, kl_coef=0.05, **counts)),
        (CISPO(terms), cispo_loss(*args, clip_eps_high=0.2, kl_coef=0.05, **counts)),  # the cap: clip_eps
        (
            SequenceMean(terms),
            reinforce_loss(logp, rows.completion_mask, rows.advantages, rows.ref_logp, 0.05, **counts),
        ),
    ]
    for objective, (loss, stats) in cases:
        out = objective(logp, entropy, micro)
        torch.testing.assert_close(out.loss, loss)
        assert float(out.policy_loss) == pytest.approx(float(stats["policy_loss"]))
        assert float(out.kl) == pytest.approx(float(stats["kl"])) and float(out.kl) > 1e-3
        share = token_mean_share(entropy, rows.completion_mask, micro.split_tokens)
        assert float(out.entropy) == pytest.approx(float(share))
        if "clip_fraction" in stats:
            assert float(out.ratio.clip_fraction) == pytest.approx(float(stats["clip_fraction"]))
            assert float(out.ratio.ratio_max) == pytest.approx(float(stats["ratio_max"]))
        else:
            assert out.ratio is None and not type(objective).needs_old_logp


def test_the_entropy_bonus_and_its_gradient_belong_to_the_objective():
    logp, entropy, micro = _micro()
    plain = ClippedSurrogate(LossTerms(kl_coef=0.05))(logp, entropy, micro)
    bonus = ClippedSurrogate(LossTerms(kl_coef=0.05), entropy_coef=0.01)(logp, entropy, micro)
    expected = entropy_bonus(entropy, micro.rows.completion_mask, 0.01)
    torch.testing.assert_close(bonus.loss, plain.loss - expected)
    assert plain.entropy_bonus is None and float(bonus.entropy_bonus) == pytest.approx(float(expected))
    bonus.loss.backward()
    assert entropy.grad is not None and entropy.grad[micro.rows.completion_mask].abs().min() > 0


def test_metric_names_are_spelled_out_and_token_mean_shares_scale_the_loss_terms():
    logp, entropy, micro = _micro()
    out = ClippedSurrogate(LossTerms(kl_coef=0.05), entropy_coef=0.01)(logp, entropy, micro)
    metrics = out.metrics()
    assert set(metrics) == {
        "train/loss", "train/policy_loss", "train/kl", "train/entropy", "train/entropy_bonus",
        "train/clip_fraction", "train/clip_fraction_low", "train/clip_fraction_high", "train/ratio_mean",
    }  # fmt: skip
    scaled = out.metrics(share=4.0)
    for name in ("train/loss", "train/policy_loss", "train/entropy_bonus"):
        assert float(scaled[name]) == pytest.approx(4 * float(metrics[name]))
    assert float(scaled["train/kl"]) == float(metrics["train/kl"])
    assert set(SequenceMean(LossTerms())(logp, entropy, micro).metrics()) == {
        "train/loss",
        "train/policy_loss",
        "train/kl",
        "train/entropy",
    }


def test_the_sampler_weights_and_the_off_policy_mask_apply_to_every_objective():
    logp, entropy, micro = _micro(sampled=True)
    tis = SamplerCorrection("token_truncate", 1.1)
    for cls in (ClippedSurrogate, CISPO, SequenceMean):
        plain = cls(LossTerms())(logp, entropy, micro)
        corrected = cls(LossTerms(correction=tis))(logp, entropy, micro)
        assert float((plain.policy_loss - corrected.policy_loss).abs()) > 1e-4, cls.__name__
        masked = cls(LossTerms(off_policy_threshold=-10.0))(logp, entropy, micro)  # every negative-advantage row leaves
        assert float(masked.off_policy_masked_frac) == pytest.approx(0.5)


def test_short_names_map_to_the_classes():
    assert {"clip": ClippedSurrogate, "gspo": GSPO, "cispo": CISPO, "sequence_mean": SequenceMean} == OBJECTIVES
    assert all(issubclass(cls, Objective) for cls in OBJECTIVES.values())
    with pytest.raises(TypeError):
        Objective(LossTerms())  # abstract: a loss defines its policy term
