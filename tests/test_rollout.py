import dataclasses

import pytest
import torch

from llm_pg.core.rollout import RolloutBatch


def _batch(n: int = 6, prompt_len: int = 2, completion_len: int = 3) -> RolloutBatch:
    # Every field encodes its row id, so misalignment after slicing is visible.
    rows = torch.arange(n)
    ids = rows[:, None].repeat(1, prompt_len + completion_len)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=(rows[:, None] % 2 == 0).repeat(1, completion_len),
        rewards=rows.float(),
        advantages=rows.float() * 10,
        old_logp=rows[:, None].float().repeat(1, completion_len) * -1,
        ref_logp=rows[:, None].float().repeat(1, completion_len) * -2,
        prompt_len=prompt_len,
        texts=[f"completion {i}" for i in range(n)],
        prompt_index=[i // 2 for i in range(n)],
    )


def _assert_rows(batch: RolloutBatch, rows: list[int]) -> None:
    assert batch.input_ids[:, 0].tolist() == rows
    assert batch.rewards.tolist() == [float(r) for r in rows]
    assert batch.advantages.tolist() == [10.0 * r for r in rows]
    assert batch.old_logp[:, 0].tolist() == [-1.0 * r for r in rows]
    assert batch.ref_logp[:, 0].tolist() == [-2.0 * r for r in rows]
    assert batch.completion_mask[:, 0].tolist() == [r % 2 == 0 for r in rows]
    assert batch.texts == [f"completion {r}" for r in rows]
    assert batch.prompt_index == [r // 2 for r in rows]


def test_select_keeps_every_field_aligned():
    batch = _batch()
    picked = batch.select(torch.tensor([4, 1, 3]))
    _assert_rows(picked, [4, 1, 3])
    assert picked.prompt_len == 2
    assert picked.completion_ids.shape == (3, 3)


def test_minibatches_cover_every_row_once_and_replay_with_seed():
    batch = _batch(n=7)
    first = list(batch.minibatches(3, torch.Generator().manual_seed(5)))
    assert [len(m) for m in first] == [3, 3, 1]  # the last one may be short
    seen = [r for m in first for r in m.input_ids[:, 0].tolist()]
    assert sorted(seen) == list(range(7))
    for m in first:
        _assert_rows(m, m.input_ids[:, 0].tolist())
    again = [r for m in batch.minibatches(3, torch.Generator().manual_seed(5)) for r in m.input_ids[:, 0].tolist()]
    other = [r for m in batch.minibatches(3, torch.Generator().manual_seed(6)) for r in m.input_ids[:, 0].tolist()]
    assert again == seen
    assert other != seen


def test_optional_fields_and_to():
    batch = dataclasses.replace(_batch(), old_logp=None, ref_logp=None)
    moved = batch.to("cpu").select(torch.tensor([0]))
    assert moved.old_logp is None and moved.ref_logp is None
    assert moved.texts == ["completion 0"]


def test_a_built_rollout_is_immutable():
    # The rollout callback builds it complete; the update keeps what it derives in its own state.
    batch = _batch()
    for name, value in [("old_logp", None), ("advantages", torch.zeros(4)), ("completion_mask", None)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(batch, name, value)
    assert batch.old_logp is not None and batch.advantages.tolist() != [0.0] * 4


def test_misaligned_fields_are_rejected():
    with pytest.raises(ValueError, match="rewards has 2 rows"):
        RolloutBatch(
            input_ids=torch.zeros(3, 4, dtype=torch.long),
            attention_mask=torch.ones(3, 4, dtype=torch.long),
            completion_mask=torch.ones(3, 2, dtype=torch.bool),
            rewards=torch.zeros(2),
            advantages=torch.zeros(3),
        )
    with pytest.raises(ValueError, match="minibatch_size"):
        next(_batch().minibatches(0))


def test_frac_zero_std_groups_counts_settled_groups_with_real_reward_values():
    from llm_pg.callbacks.rollout import rollout_metrics
    from llm_pg.core.advantages import group_advantages
    from llm_pg.data.tasks.base import Score

    # Three groups of 6: settled at 1.3 but one reward an ulp above the others (the same total summed in
    # another order), settled at 0.2, informative. The old test `std == 0` missed the first: the same
    # rollout got advantages of about +-2 there, and 1/3 where 2/3 was right.
    ulp_above = torch.nextafter(torch.tensor(1.3), torch.tensor(2.0)).item()
    values = [1.3] * 5 + [ulp_above] + [0.2] * 6 + [1.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    n = len(values)
    ids = torch.zeros(n, 4, dtype=torch.long)
    rollout = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.ones(n, 2, dtype=torch.bool),
        rewards=torch.tensor(values),
        advantages=torch.zeros(n),
        prompt_len=2,
    )
    scores = [Score(total=v, correct=v > 1, components={"correct": float(v > 1)}) for v in values]
    metrics = rollout_metrics(rollout, scores, group_size=6, eos=[1])
    assert metrics["train/frac_zero_std_groups"] == pytest.approx(2 / 3)
    assert group_advantages(rollout.rewards, 6)[:12].tolist() == [0.0] * 12
