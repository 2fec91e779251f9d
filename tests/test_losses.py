"""The RL math, on tensors small enough to check with a pencil."""

import math

import pytest
import torch

from llm_pg.core.advantages import advantages, group_advantages, settled_groups
from llm_pg.core.losses import (
    aggregate,
    approx_kl,
    completion_mask,
    grpo_loss,
    masked_mean,
    reinforce_loss,
    token_logprobs,
)

# ---- token_logprobs ---------------------------------------------------------------------------------


def test_logits_at_t_score_token_t_plus_1():
    # Vocabulary of 3. At t=0 the logits favour token 2, at t=1 token 0. input_ids = [0, 2, 0].
    # Right answer: out[0] = log p_0(2) = log softmax([0, 0, ln 8])[2] = ln(8/10);
    #               out[1] = log p_1(0) = log softmax([ln 4, 0, 0])[0] = ln(4/6).
    # Off by one (scoring token t with logits t) would give log p_0(0) = ln(1/10) and log p_1(2) = ln(1/6).
    logits = torch.tensor([[[0.0, 0.0, math.log(8)], [math.log(4), 0.0, 0.0], [0.0, 0.0, 0.0]]])
    out = token_logprobs(logits, torch.tensor([[0, 2, 0]]))
    assert out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.8), math.log(4 / 6)]]))


def test_temperature_divides_logits_before_softmax():
    # logits [ln 4, 0] at T=2 become [ln 2, 0]: p(token 0) = 2/3 (not (4/5) ** (1/2) or anything else).
    logits = torch.tensor([[[math.log(4), 0.0], [0.0, 0.0]]])
    out = token_logprobs(logits, torch.tensor([[1, 0]]), temperature=2.0)
    torch.testing.assert_close(out, torch.tensor([[math.log(2 / 3)]]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.tensor([[1, 0]]), temperature=0.0)


def test_bf16_logits_give_float32_logprobs_close_to_float64():
    gen = torch.Generator().manual_seed(0)
    logits64 = torch.randn(3, 7, 500, generator=gen, dtype=torch.float64) * 4
    ids = torch.randint(0, 500, (3, 7), generator=gen)
    logits_bf16 = logits64.to(torch.bfloat16)
    # The reference is the float64 computation on the same (bf16-rounded) logits.
    expected = torch.log_softmax(logits_bf16.double()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = token_logprobs(logits_bf16, ids, temperature=0.7)
    expected_t = torch.log_softmax(logits_bf16.double()[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert out.dtype == torch.float32
    assert (out.double() - expected_t).abs().max() < 1e-2
    assert (token_logprobs(logits_bf16, ids).double() - expected).abs().max() < 1e-2


def test_token_logprobs_gradient_matches_log_softmax():
    logits = torch.randn(2, 4, 6, requires_grad=True)
    ids = torch.randint(0, 6, (2, 4))
    token_logprobs(logits, ids, temperature=1.3).sum().backward()
    reference = logits.detach().clone().requires_grad_(True)
    torch.log_softmax(reference[:, :-1] / 1.3, -1).gather(-1, ids[:, 1:, None]).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)


# ---- completion_mask --------------------------------------------------------------------------------


def test_completion_mask_pad_equals_eos():
    # EOS = pad = 9: the first 9 is kept, the padding 9s after it are not.
    ids = torch.tensor([[5, 6, 9, 9, 9], [5, 9, 9, 9, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, 9), expected)


def test_completion_mask_several_eos_ids_and_truncation():
    ids = torch.tensor([[1, 7, 2, 8], [1, 2, 3, 4], [8, 1, 7, 2]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, [7, 8]), expected)
    assert torch.equal(completion_mask(ids, (7, 8)), expected)


# ---- approx_kl --------------------------------------------------------------------------------------


def test_approx_kl_nonnegative_and_zero_when_equal():
    logp = torch.linspace(-8, 0, 50)
    ref = torch.linspace(0, -8, 50)
    assert (approx_kl(logp, ref) >= 0).all()
    assert approx_kl(logp, logp).abs().max() == 0
    # d = ln 2: 2 - ln 2 - 1 = 0.30685...
    torch.testing.assert_close(approx_kl(torch.tensor(0.0), torch.tensor(math.log(2))), torch.tensor(1 - math.log(2)))


def test_approx_kl_sample_mean_matches_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])  # pi_theta, which samples the tokens
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])  # pi_ref
    exact = (p * (p / q).log()).sum()  # KL(p || q) = 0.1835...
    gen = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = approx_kl(p.log()[tokens], q.log()[tokens]).mean()
    # The per-token estimator has std ~0.25 here, so the standard error of 200k samples is ~6e-4; 5e-3 is ~8 SE.
    assert abs(estimate - exact) < 5e-3
    # It is not the naive log-ratio estimator's per-token value, which can be negative.
    assert (p.log()[tokens] - q.log()[tokens]).min() < 0


# ---- group_advantages -------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # Group 1: [1, 3] -> mean 2, population std 1 -> [-1, 1]. Group 2: all equal -> zeros, no NaN.
    adv = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), group_size=2, eps=0.0 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert not torch.isnan(adv).any()
    torch.testing.assert_close(
        group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2, normalize_std=False), torch.tensor([-1.0, 1.0, 0, 0])
    )


# The rewards the tasks really produce: format_copy 1.3 / 1.2 / 0.3 / 0.2 / 0.1, math_hard 1.1 / 0.1. In float32
# their group mean is off by ~1e-7 for some group sizes, which divided by std + eps (eps 1e-6) used to become
# advantages of about +-0.1 for a group that carries no signal at all.
TASK_REWARDS = [1.3, 1.2, 1.1, 0.3, 0.2, 0.1]


@pytest.mark.parametrize("group_size", [4, 6, 8])
@pytest.mark.parametrize("value", TASK_REWARDS)
def test_settled_group_gets_exactly_zero_advantage(value, group_size):
    rewards = torch.full((group_size,), value)  # float32, as the rollout builds them
    assert group_advantages(rewards, group_size).tolist() == [0.0] * group_size
    assert group_advantages(rewards, group_size, normalize_std=False).tolist() == [0.0] * group_size
    assert settled_groups(rewards, group_size).tolist() == [True]


@pytest.mark.parametrize("group_size", [4, 6, 8])
def test_settled_groups_mixed_with_informative_ones(group_size):
    # Group 0 settled at 1.3, group 1 informative (one 1.3 among 0.3s), group 2 settled at 0.2,
    # group 3 informative (half 1.2, half 0.1).
    half = group_size // 2
    groups = [
        [1.3] * group_size,
        [1.3] + [0.3] * (group_size - 1),
        [0.2] * group_size,
        [1.2] * half + [0.1] * half,
    ]
    rewards = torch.tensor([r for g in groups for r in g])
    adv = group_advantages(rewards, group_size).view(4, group_size)
    assert adv[0].tolist() == [0.0] * group_size and adv[2].tolist() == [0.0] * group_size
    assert settled_groups(rewards, group_size).tolist() == [True, False, True, False]
    # Group 1 by hand: one reward 1.0 above the others; mean m = 0.3 + 1/G, population std
    # s = sqrt((G-1)/G^2) = sqrt(G-1)/G, so A_0 = (1 - 1/G) / s = sqrt(G-1) and A_j = -(1/G) / s = -1/sqrt(G-1).
    root = (group_size - 1) ** 0.5
    expected = torch.tensor([root] + [-1 / root] * (group_size - 1))
    torch.testing.assert_close(adv[1], expected, atol=1e-5, rtol=0)
    # Group 3 by hand: two values 1.1 apart, half each: mean in the middle, std 0.55, so A = +-1.
    torch.testing.assert_close(adv[3], torch.tensor([1.0] * half + [-1.0] * half), atol=1e-5, rtol=0)


def test_nearly_equal_rewards_are_not_settled():
    # A real difference far above float noise stays signal: [0.5, 0.5001] is not a settled group.
    rewards = torch.tensor([0.5, 0.5001])
    assert settled_groups(rewards, 2).tolist() == [False]
    # std 5e-5 against eps 1e-6: A = +-5e-5 / (5e-5 + 1e-6) = +-0.980
    torch.testing.assert_close(group_advantages(rewards, 2), torch.tensor([-0.9804, 0.9804]), atol=1e-3, rtol=0)


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3)


def test_masked_mean_empty_row_is_zero():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(1.5))


# ---- losses -----------------------------------------------------------------------------------------


def test_reinforce_loss_by_hand():
    # Row 0: seqmean logp = (-1 - 3)/2 = -2, A = 1. Row 1: seqmean = -4 (one token), A = -0.5.
    # loss = -mean(1 * -2, -0.5 * -4) = -mean(-2, 2) = 0.
    logp = torch.tensor([[-1.0, -3.0, -7.0], [-4.0, -9.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, stats = reinforce_loss(logp, mask, torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(loss, torch.tensor(0.0))
    assert stats["kl"] == 0


def test_grpo_clip_fraction_by_hand():
    # ratios e^{logp - old}: [1.5, 0.5] for A>0 and [1.5, 0.5] for A<0, eps 0.2.
    # Clipped (gradient removed): rho > 1.2 with A > 0 (row 0, tok 0), rho < 0.8 with A < 0 (row 1, tok 1) -> 2/4.
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = grpo_loss(logp, old, mask, torch.tensor([1.0, -1.0]), clip_eps=0.2)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    # Surrogates: row 0 min(1.5, 1.2)=1.2, min(0.5, 0.8)=0.5 -> 0.85; row 1 min(-1.5,-1.2)=-1.5, min(-0.5,-0.8)=-0.8
    # -> -1.15. loss = -mean(0.85, -1.15) = 0.15.
    torch.testing.assert_close(loss, torch.tensor(0.15))
    assert stats["ratio_max"].item() == pytest.approx(1.5)


def _random_rollout(seed: int = 0, rows: int = 4, cols: int = 5):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, cols, generator=gen) * 3).requires_grad_(True)
    ref = -torch.rand(rows, cols, generator=gen) * 3
    mask = torch.ones(rows, cols, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    adv = torch.randn(rows, generator=gen)
    return logp, ref, mask, adv


def test_grpo_on_policy_gradient_equals_reinforce():
    logp, ref, mask, adv = _random_rollout()
    grpo, stats = grpo_loss(logp, logp.detach(), mask, adv, ref_logp=ref, kl_coef=0.1)
    (g_grpo,) = torch.autograd.grad(grpo, logp)
    reinforce, _ = reinforce_loss(logp, mask, adv, ref_logp=ref, kl_coef=0.1)
    (g_reinforce,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(g_grpo, g_reinforce)
    assert stats["clip_fraction"] == 0
    assert stats["ratio_max"].item() == 1.0


@pytest.mark.parametrize("which", ["reinforce", "grpo"])
def test_padding_after_eos_changes_nothing(which):
    logp, ref, mask, adv = _random_rollout(1)
    old = logp.detach() + 0.1

    def loss_and_grad(lp, rf, od, mk):
        lp = lp.detach().requires_grad_(True)
        if which == "reinforce":
            loss, _ = reinforce_loss(lp, mk, adv, ref_logp=rf, kl_coef=0.2)
        else:
            loss, _ = grpo_loss(lp, od, mk, adv, ref_logp=rf, kl_coef=0.2)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss, grad

    base_loss, base_grad = loss_and_grad(logp, ref, old, mask)
    pad = 3  # three more columns of padding with garbage log-probs, masked out
    garbage = torch.full((4, pad), -50.0)
    padded = [torch.cat([t.detach(), garbage], 1) for t in (logp, ref, old)]
    padded_mask = torch.cat([mask, torch.zeros(4, pad, dtype=torch.bool)], 1)
    loss, grad = loss_and_grad(*padded, padded_mask)
    torch.testing.assert_close(loss, base_loss)
    torch.testing.assert_close(grad[:, :-pad], base_grad)
    assert grad[:, -pad:].abs().max() == 0


@pytest.mark.parametrize("ragged", [False, True])
def test_gradient_accumulation_equals_full_batch(ragged):
    logp, ref, mask, adv = _random_rollout(2, rows=6)
    old = logp.detach() - 0.05
    if not ragged:
        mask = torch.ones_like(mask)
    # With equal token counts per micro-batch the KL token-mean decomposes exactly; with ragged masks only the
    # per-row policy term does (the KL is a token mean over each micro-batch), so drop the KL there.
    kl_coef = 0.0 if ragged else 0.1
    full, _ = grpo_loss(logp, old, mask, adv, ref_logp=ref, kl_coef=kl_coef)
    (g_full,) = torch.autograd.grad(full, logp)
    accumulated = torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part, _ = grpo_loss(logp[rows], old[rows], mask[rows], adv[rows], ref_logp=ref[rows], kl_coef=kl_coef)
        accumulated += torch.autograd.grad(part / 3, logp)[0]
    torch.testing.assert_close(accumulated, g_full)
    # Dividing by the number of micro-batches matters: the plain sum is three times too large.
    assert not torch.allclose(accumulated * 3, g_full)


# ---- variants (issue 12): estimators, aggregation, sequence ratio, clip-higher ---------------------------


def test_advantage_estimators_by_hand():
    # One group of 4: r = [1.3, 0.3, 0.3, 0.1]; mean 0.5, r - mean = [0.8, -0.2, -0.2, -0.4].
    # Population std = sqrt((0.64 + 0.04 + 0.04 + 0.16) / 4) = sqrt(0.22) = 0.469042.
    # A second group settled at 1.2 is 0 under every estimator.
    rewards = torch.tensor([1.3, 0.3, 0.3, 0.1, 1.2, 1.2, 1.2, 1.2])
    centered = [0.8, -0.2, -0.2, -0.4]
    expected = {
        "grpo": [c / (0.22**0.5 + 1e-6) for c in centered],
        "dr_grpo": centered,
        # RLOO: 1.3 - mean(0.3, 0.3, 0.1) = 1.3 - 0.2333 = 1.0667 = 4/3 * 0.8; 0.3 - mean(1.3, 0.3, 0.1) = -0.2667.
        "rloo": [1.3 - 0.7 / 3, 0.3 - 1.7 / 3, 0.3 - 1.7 / 3, 0.1 - 1.9 / 3],
        # REINFORCE++: centered over all 8 rows (the settled ones are 0): std = sqrt(0.88 / 8) = 0.331662.
        "reinforce_pp": [c / ((0.88 / 8) ** 0.5 + 1e-6) for c in centered],
    }
    for estimator, first_group in expected.items():
        adv = advantages(rewards, 4, estimator)
        torch.testing.assert_close(adv[:4], torch.tensor(first_group), atol=1e-5, rtol=0, msg=estimator)
        assert adv[4:].tolist() == [0.0] * 4, estimator
    with pytest.raises(ValueError, match="rloo"):
        advantages(rewards, 4, "ppo")


def test_aggregations_by_hand():
    # Row 0: values [1, 2, (9)] with 2 tokens; row 1: [4, (9), (9)] with 1 token.
    values = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # seq_mean_token_mean: mean(1.5, 4) = 2.75. token_mean: (1 + 2 + 4) / 3 = 7/3.
    # seq_mean_token_sum_norm with max_new_tokens 4: mean(3/4, 4/4) = 0.875.
    assert aggregate(values, mask).item() == pytest.approx(2.75)
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate(values, mask, "token_mean", num_tokens=7).item() == pytest.approx(1.0)
    assert aggregate(values, mask, "seq_mean_token_sum_norm", max_new_tokens=4).item() == pytest.approx(0.875)
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(values, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(values, mask, "sum")


def test_reinforce_token_mean_by_hand():
    # Row 0: A = 1, logp [-1, -3]; row 1: A = -0.5, logp [-4]. token_mean of A*logp: (-1 - 3 + 2) / 3 = -2/3.
    logp = torch.tensor([[-1.0, -3.0, -7.0], [-4.0, -9.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, _ = reinforce_loss(logp, mask, torch.tensor([1.0, -0.5]), aggregation="token_mean")
    torch.testing.assert_close(loss, torch.tensor(2 / 3))


def test_clip_eps_high_equal_to_clip_eps_reproduces_the_symmetric_loss_exactly():
    logp, ref, mask, adv = _random_rollout(3)
    old = logp.detach() + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    base, base_stats = grpo_loss(logp, old, mask, adv, ref, clip_eps=0.2, kl_coef=0.05)
    same, same_stats = grpo_loss(logp, old, mask, adv, ref, clip_eps=0.2, kl_coef=0.05, clip_eps_high=0.2)
    assert same.item() == base.item()
    assert same_stats["clip_fraction"].item() == base_stats["clip_fraction"].item()


def test_clip_higher_by_hand():
    # rho = 1.25 with A = +1: clip(1.25, 0.8, 1.2) = 1.2 (clipped), but with eps_high 0.28, clip(1.25, 0.8, 1.28)
    # = 1.25 (kept). Surrogate 1.2 vs 1.25.
    logp = torch.log(torch.tensor([[1.25]]))
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = grpo_loss(logp, old, mask, torch.tensor([1.0]), clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_fraction"].item() == 1.0
    loss, stats = grpo_loss(logp, old, mask, torch.tensor([1.0]), clip_eps=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and stats["clip_fraction"].item() == 0.0


def test_sequence_ratio_by_hand_and_equal_to_token_ratio_for_one_token():
    # Row 0 has log-ratios [log 1.5, log 0.5]: one sequence ratio exp((log 1.5 + log 0.5) / 2) = sqrt(0.75) = 0.866,
    # inside [0.8, 1.2], so with A = 1 the surrogate is 0.866 on both tokens and nothing is clipped.
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_loss(logp, torch.zeros(1, 2), mask, torch.tensor([1.0]), ratio_level="sequence")
    assert loss.item() == pytest.approx(-(0.75**0.5))
    assert stats["clip_fraction"].item() == 0.0
    # With one token per completion the sequence ratio is the token ratio: same loss and same gradient.
    logp, ref, _, adv = _random_rollout(4, rows=4, cols=1)
    old = logp.detach() + torch.tensor([[0.3], [-0.3], [0.05], [-0.5]])
    one = torch.ones(4, 1, dtype=torch.bool)
    token, _ = grpo_loss(logp, old, one, adv, ref, kl_coef=0.1)
    (g_token,) = torch.autograd.grad(token, logp)
    sequence, _ = grpo_loss(logp, old, one, adv, ref, kl_coef=0.1, ratio_level="sequence")
    (g_sequence,) = torch.autograd.grad(sequence, logp)
    torch.testing.assert_close(sequence, token)
    torch.testing.assert_close(g_sequence, g_token)


def test_token_mean_under_accumulation_equals_one_big_micro_batch():
    # float64: the step's gradient with token_mean is the mean over every token of the step, whichever way the
    # rows are split into micro-batches, when each micro-batch divides by the step's token count.
    logp, ref, mask, adv = _random_rollout(5, rows=6, cols=5)
    logp = logp.detach().double().requires_grad_(True)
    ref, old = ref.double(), logp.detach() - 0.1
    step_tokens = mask.sum()
    full, _ = grpo_loss(logp, old, mask, adv.double(), aggregation="token_mean")
    (g_full,) = torch.autograd.grad(full, logp)
    g_acc = torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):  # uneven micro-batches with uneven token counts
        part = logp[rows].detach().requires_grad_(True)
        loss, _ = grpo_loss(
            part, old[rows], mask[rows], adv[rows].double(), aggregation="token_mean", num_tokens=step_tokens
        )
        (g_part,) = torch.autograd.grad(loss, part)
        g_acc[rows] = g_part
    torch.testing.assert_close(g_acc, g_full, rtol=1e-12, atol=1e-12)


def test_token_mean_kl_term_is_a_share_of_the_step_token_mean():
    # Three completion tokens, D = log pi_ref - log pi_theta = (ln 2, 0, 0): k3 = (2 - ln 2 - 1, 0, 0). Advantages 0,
    # so the loss is the KL term alone: kl_coef * (1 - ln 2) / 6 with the step's 6 tokens, while the logged `kl` stays
    # this micro-batch's token mean (1 - ln 2) / 3. Without num_tokens the term is the course's tokmean.
    logp = torch.zeros(2, 2)
    ref = torch.tensor([[math.log(2.0), 0.0], [0.0, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    zero = torch.zeros(2)
    for loss_fn in (reinforce_loss, lambda *a, **k: grpo_loss(a[0], a[0], *a[1:], **k)):
        loss, stats = loss_fn(logp, mask, zero, ref, kl_coef=0.1, aggregation="token_mean", num_tokens=6)
        assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)) / 6)
        assert stats["kl"].item() == pytest.approx((1 - math.log(2)) / 3)
        loss, _ = loss_fn(logp, mask, zero, ref, kl_coef=0.1, aggregation="token_mean")
        assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)) / 3)


def test_the_fixed_core_api_is_importable_from_core_losses():
    # ../shared/design.md fixes these names in `llm_pg.core.losses` (tests outside the project import them there),
    # wherever the code keeps them; group_advantages is the same function as `llm_pg.core.advantages`'.
    import llm_pg.core.losses as losses
    from llm_pg.core import advantages as by_idea

    names = ["token_logprobs", "completion_mask", "approx_kl", "group_advantages", "masked_mean", "reinforce_loss",
             "grpo_loss", "advantages", "aggregate"]  # fmt: skip
    assert all(callable(getattr(losses, name, None)) for name in names), [n for n in names if not hasattr(losses, n)]
    assert losses.group_advantages is by_idea.group_advantages and losses.advantages is by_idea.advantages
    rewards = torch.tensor([1.3, 0.2, 0.3, 1.0, 1.0, 1.0])
    expected = torch.tensor([0.7, -0.4, -0.3, 0.0, 0.0, 0.0]) / (math.sqrt(0.74 / 3) + 1e-6)
    torch.testing.assert_close(losses.advantages(rewards, 3, "grpo"), expected)
