"""The per-iteration metrics of issue 21 on a hand-built rollout: completion lengths, truncation, reward spread per
component, mean |advantage|, tokens per second, the two sides of the clip, and the GPU peak memory."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from llm_pg.callbacks.rollout import RolloutCallback, Variants, apply_variants, rollout_metrics
from llm_pg.core.losses import grpo_loss, reinforce_loss
from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.batches import PromptBatch, ScoredRollout
from llm_pg.data.tasks.base import Score

EOS = 2
COMPLETIONS = [  # [N=6, C=4], two groups of three; 0 pads after the EOS
    [5, 6, 2, 0],  # 3 tokens, ends with EOS
    [5, 6, 7, 8],  # 4, no EOS: truncated
    [2, 0, 0, 0],  # 1
    [5, 2, 0, 0],  # 2
    [5, 6, 7, 2],  # 4, EOS as the last token: not truncated
    [9, 9, 9, 9],  # 4, truncated
]
# format_copy's components: correct 1.0, tags 0.2, clean 0.1; the second group is settled (1.3 each)
COMPONENTS = [(1.0, 0.2, 0.1), (0.0, 0.2, 0.0), (0.0, 0.2, 0.1), (1.0, 0.2, 0.1), (1.0, 0.2, 0.1), (1.0, 0.2, 0.1)]


def scores() -> list[Score]:
    return [
        Score(total=sum(c), correct=c[0] == 1.0, components={"correct": c[0], "tags": c[1], "clean": c[2]})
        for c in COMPONENTS
    ]


def rollout() -> RolloutBatch:
    completion = torch.tensor(COMPLETIONS)
    mask = torch.zeros_like(completion, dtype=torch.bool)
    for i, length in enumerate([3, 4, 1, 2, 4, 4]):
        mask[i, :length] = True
    prompt = torch.full((6, 2), 4)
    return RolloutBatch(
        input_ids=torch.cat([prompt, completion], 1),
        attention_mask=torch.cat([torch.ones_like(prompt), mask.long()], 1),
        completion_mask=mask,
        rewards=torch.tensor([sum(c) for c in COMPONENTS], dtype=torch.float32),
        advantages=torch.zeros(6),
        prompt_len=2,
        texts=[""] * 6,
        prompt_index=[0, 0, 0, 1, 1, 1],
    )


def test_lengths_truncation_reward_spread_and_tokens_per_second():
    m = rollout_metrics(rollout(), scores(), group_size=3, eos=[EOS], sampling_seconds=1.5)
    assert m["train/completion_len"] == pytest.approx(18 / 6)
    assert m["train/completion_len_min"] == 1 and m["train/completion_len_max"] == 4
    assert m["train/truncated_frac"] == pytest.approx(2 / 6)  # rows 1 and 5 hold no EOS
    assert m["time/tokens_per_s"] == pytest.approx(18 / 1.5)  # completion tokens over sampling seconds
    totals = [1.3, 0.2, 0.3, 1.3, 1.3, 1.3]
    assert m["train/reward"] == pytest.approx(sum(totals) / 6)
    assert m["train/reward_std"] == pytest.approx(statistics.pstdev(totals), rel=1e-6)
    assert m["train/reward_correct"] == pytest.approx(4 / 6)
    assert m["train/reward_correct_std"] == pytest.approx(math.sqrt(4 / 6 * 2 / 6))  # a 0/1 column: sqrt(p(1-p))
    assert m["train/reward_tags_std"] == pytest.approx(0.0, abs=1e-12)
    assert m["train/reward_clean_std"] == pytest.approx(statistics.pstdev([0.1, 0, 0.1, 0.1, 0.1, 0.1]))
    assert m["train/frac_zero_std_groups"] == 0.5
    assert "time/tokens_per_s" not in rollout_metrics(rollout(), scores(), 3, [EOS])


def hp(**changes) -> Variants:
    base = dict(filter_zero_std_groups=False, group_size=3, advantage="grpo", adv_clip=5.0, mask_truncated=False)
    return Variants(**(base | changes))


def test_advantage_abs_mean_is_over_the_rows_the_update_sees():
    # Group 1: rewards 1.3, 0.2, 0.3, mean 0.6, deviations 0.7, -0.4, -0.3, population std sqrt(0.74 / 3).
    std = math.sqrt(0.74 / 3) + 1e-6
    _, _, m = apply_variants(rollout(), scores(), hp(), [EOS])
    assert m["train/advantage_abs_mean"] == pytest.approx(1.4 / std / 6, rel=1e-5)  # group 2 is settled: 0
    _, _, m = apply_variants(rollout(), scores(), hp(filter_zero_std_groups=True), [EOS])
    assert m["train/advantage_abs_mean"] == pytest.approx(1.4 / std / 3, rel=1e-5)  # only group 1 is left
    _, _, m = apply_variants(rollout(), scores(), hp(adv_clip=1.0), [EOS])
    assert m["train/advantage_abs_mean"] == pytest.approx((1.0 + 0.4 / std + 0.3 / std) / 6, rel=1e-5)


def clip_inputs():
    rho = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.5, 0.9]])  # [2, 3]
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return rho.log(), torch.zeros(2, 3), mask, torch.tensor([1.0, -1.0])


def test_clip_fraction_splits_into_its_low_and_high_sides():
    logp, old, mask, adv = clip_inputs()
    # A > 0 row: only rho 1.5 > 1.2 is clipped (high; 0.5 with A > 0 keeps its gradient). A < 0 row: only 0.5 < 0.8
    # (low; 1.5 with A < 0 keeps it). 5 completion tokens.
    _, stats = grpo_loss(logp, old, mask, adv, clip_eps=0.2)
    assert float(stats["clip_fraction_high"]) == pytest.approx(1 / 5)
    assert float(stats["clip_fraction_low"]) == pytest.approx(1 / 5)
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 5)
    _, stats = grpo_loss(logp, old, mask, adv, clip_eps=0.2, clip_eps_high=0.6)  # 1.5 < 1.6: no high clip
    assert float(stats["clip_fraction_high"]) == 0 and float(stats["clip_fraction"]) == pytest.approx(1 / 5)
    # Micro-batch weighting as clip_fraction's: each row's count over its micro-batch's tokens (3 and 4).
    _, stats = grpo_loss(logp, old, mask, adv, clip_eps=0.2, split_tokens=torch.tensor([3.0, 4.0]))
    assert float(stats["clip_fraction_high"]) == pytest.approx(1 / 3)
    assert float(stats["clip_fraction_low"]) == pytest.approx(1 / 4)
    assert float(stats["clip_fraction"]) == pytest.approx(1 / 3 + 1 / 4)


def test_reinforce_logs_no_clip():
    logp, _, mask, adv = clip_inputs()
    _, stats = reinforce_loss(logp, mask, adv)
    assert not any(k.startswith("clip_fraction") for k in stats)


def test_peak_memory_on_a_gpu_only(monkeypatch):
    logged, resets = [], []
    module = SimpleNamespace(
        device=torch.device("cuda", 0), log=lambda name, value, **kw: logged.append((name, value, kw))
    )
    trainer = SimpleNamespace(world_size=2)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30 + 2**29)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    RolloutCallback().on_train_batch_end(trainer, module, None, PromptBatch(0, []), 0)
    [(name, value, kw)] = logged
    assert name == "memory/peak_gb" and value == 3.5 and kw["reduce_fx"] == "max" and kw["sync_dist"]
    assert resets == [module.device]  # the next iteration's peak starts here
    logged.clear()
    cpu = SimpleNamespace(device=torch.device("cpu"), log=None)
    RolloutCallback().on_train_batch_end(trainer, cpu, None, PromptBatch(0, []), 0)
    assert logged == []


def test_the_rollout_callback_moves_the_data_cursor_past_the_batches_its_rollout_used():
    # Its one owner: the callback reads `next_batch` before the rollout and moves it once the iteration is trained,
    # past every batch the rollout drew (here 3: a refill used stream batches 2 and 3).
    from llm_pg.data.datamodule import PromptGroupDataModule
    from llm_pg.data.tasks import FormatCopyTask

    datamodule = PromptGroupDataModule(FormatCopyTask(), prompts_per_step=2)
    datamodule.next_batch = 2
    trainer = SimpleNamespace(datamodule=datamodule, world_size=1)
    module = SimpleNamespace(device=torch.device("cpu"))
    batch = PromptBatch(2, [], ScoredRollout(rollout(), scores(), last_batch=3))
    RolloutCallback().on_train_batch_end(trainer, module, None, batch, 0)
    assert datamodule.next_batch == 4 and datamodule.state_dict()["next_batch"] == 4
