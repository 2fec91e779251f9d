"""The algorithm variants as configuration (`model.init_args` keys), through the real training step on a random
two-layer model, and the rollout-side options on hand-built rollouts."""

import csv
import dataclasses
import json
import logging
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, fit
from transformers import AutoModelForCausalLM

import llm_pg.modules.update as update
from llm_pg.callbacks.rollout import apply_variants
from llm_pg.callbacks.sharded_eval import pass_at_k
from llm_pg.core.advantages import group_advantages, unsettled_rows
from llm_pg.core.objectives import ClippedSurrogate, Objective, SequenceMean
from llm_pg.core.rollout import RolloutBatch, concat_rollouts
from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.modules import GRPOModule, ReinforceModule, logprobs

VARIED = ["--data.task=test_variants.VariedTask", "--data.task.init_args.eval_size=4"]


def _reward(completion: str) -> float:
    """A reward that differs between almost any two completions: a hash of the text in [0, 1)."""
    return (sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 9973) / 9973


class VariedTask(Task):
    """Rewards that differ within every group, except for prompts marked `settle`, whose completions all earn 1.3:
    `none`, `even` (stream indices 0, 2, 4, ...), `all`, or `third` (every index not a multiple of 3)."""

    name = "varied"
    components = ("value",)

    def __init__(self, settle: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        self.settle = settle

    def train_example(self, index: int, seed: int) -> Example:
        settled = {"all": True, "even": index % 2 == 0, "third": index % 3 != 0}.get(self.settle, False)
        return Example(prompt=f"Say something {seed}:{index}", answer="settled" if settled else "")

    def build_eval_set(self) -> list[Example]:
        return [Example(prompt=f"Say something {i}", answer="") for i in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        value = 1.3 if example.answer == "settled" else _reward(completion)
        return Score(total=value, correct=value > 0.5, components={"value": value})


def _rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


def _train_rows(run_dir) -> list[dict]:
    volatile = ("time/", "memory/")
    rows = [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in _rows(run_dir) if "train/reward" in r]
    return sorted(rows, key=lambda r: r["step"])


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def _record_losses(monkeypatch) -> list[RolloutBatch]:
    """The rows of every micro-batch an objective sees."""
    seen = []
    original = Objective.__call__

    def recording(self, logp, entropy, micro):
        seen.append(micro.rows)
        return original(self, logp, entropy, micro)

    monkeypatch.setattr(Objective, "__call__", recording)
    return seen


# ---- filter_zero_std_groups -----------------------------------------------------------------------------------


def test_filter_changes_nothing_when_no_group_is_settled(tmp_path, random_model_dir):
    runs = {}
    for flag in ("false", "true"):
        cli = fit(tmp_path / flag, random_model_dir, "--model.init_args.iterations=2", *VARIED,
                  f"--model.init_args.filter_zero_std_groups={flag}")  # fmt: skip
        runs[flag] = (_weights(cli.model), _train_rows(tmp_path / flag / "run"))
    (plain, plain_rows), (filtered, filtered_rows) = runs["false"], runs["true"]
    assert all(r["train/frac_zero_std_groups"] == 0.0 for r in plain_rows)  # the premise: no settled group
    assert all(torch.equal(plain[n], filtered[n]) for n in plain)
    assert [r["train/filtered_groups"] for r in filtered_rows] == [0.0, 0.0]
    assert [(r["train/sampling_rounds"], r["train/prompts_drawn"], r["train/groups_kept"]) for r in filtered_rows] == [
        (1.0, 2.0, 2.0)
    ] * 2
    added = ("train/filtered_groups", "train/sampling_rounds", "train/prompts_drawn", "train/groups_kept")
    assert [{k: v for k, v in r.items() if k not in added} for r in filtered_rows] == plain_rows


def test_filter_drops_settled_groups_from_the_update(tmp_path, random_model_dir, monkeypatch):
    seen = _record_losses(monkeypatch)
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", "--model.init_args.filter_zero_std_groups=true",
        *VARIED, "--data.task.init_args.settle=even", "--model.init_args.kl_coef=0")  # fmt: skip
    rows = _train_rows(tmp_path / "run")
    filtered = [r["train/filtered_groups"] for r in rows]
    assert filtered == [r["train/frac_zero_std_groups"] * 2 for r in rows]  # 2 prompts per step
    assert 0 < sum(filtered) < 6, filtered  # this seed's batches mix settled and unsettled groups
    # Each iteration: 2 epochs over the 4 rows of every unsettled group; none of them is a settled 1.3.
    assert sum(len(part) for part in seen) == sum(2 * 4 * (2 - f) for f in filtered)
    assert all(float(r) != pytest.approx(1.3) for part in seen for r in part.rewards)
    for part in seen:  # advantages of the rows kept are those of their own group, as without the filter
        assert part.advantages.abs().sum() > 0


def test_filter_with_every_group_settled_makes_no_step(tmp_path, random_model_dir, caplog):
    with caplog.at_level(logging.INFO):
        cli = fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *VARIED,
                  "--data.task.init_args.settle=all", "--model.init_args.filter_zero_std_groups=true")  # fmt: skip
    module = cli.model
    assert module.iteration == 2 and module.optimizer_steps == 0  # the iterations count; no step was made
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    assert all(torch.equal(p, initial[n]) for n, p in module.policy.state_dict().items())
    rows = _train_rows(tmp_path / "run")
    assert [r["train/filtered_groups"] for r in rows] == [2.0, 2.0]
    assert [r["train/optimizer_steps"] for r in rows] == [0.0, 0.0]
    assert sum("every group was settled" in r.getMessage() for r in caplog.records) == 2


# ---- dynamic sampling's refill (max_sampling_rounds) -------------------------------------------------------------

THIRD = [*VARIED, "--data.task.init_args.settle=third", "--model.init_args.filter_zero_std_groups=true"]


def _trained_indices(run_dir) -> list[list[int]]:
    """The stream indices of the prompts each iteration trained on, from generations.jsonl (every kept row)."""
    by_iteration: dict[int, list[int]] = {}
    for line in (run_dir / "generations.jsonl").read_text().splitlines():
        row = json.loads(line)
        index = int(row["prompt"].rsplit(":", 1)[1])
        if index not in by_iteration.setdefault(row["iteration"], []):
            by_iteration[row["iteration"]].append(index)
    return [by_iteration[k] for k in sorted(by_iteration)]


@pytest.mark.slow
def test_refill_trains_every_iteration_on_prompts_per_step_groups_and_resumes_bitwise(tmp_path, random_model_dir):
    # 2 prompts per batch; only stream indices 0, 3, 6, ... have reward spread, so batches hold 1, 1, 0, 1, 1, 0, ...
    # groups worth training on: iteration 1 samples batches 0-1, iteration 2 batches 2-4, and so on.
    common = ["--model.init_args.iterations=4", "--model.init_args.max_sampling_rounds=3", *THIRD]
    straight = fit(tmp_path / "straight", random_model_dir, *common)
    rows = _train_rows(tmp_path / "straight" / "run")
    assert [r["train/sampling_rounds"] for r in rows] == [2.0, 3.0, 3.0, 3.0]
    assert [r["train/prompts_drawn"] for r in rows] == [4.0, 6.0, 6.0, 6.0]
    assert [r["train/groups_kept"] for r in rows] == [2.0] * 4
    assert [r["train/filtered_groups"] for r in rows] == [2.0, 4.0, 4.0, 4.0]
    assert _trained_indices(tmp_path / "straight" / "run") == [[0, 3], [6, 9], [12, 15], [18, 21]]
    assert straight.datamodule.next_batch == 11  # every batch drawn counts: 2 + 3 + 3 + 3
    assert straight.model.optimizer_steps == 4 * 2 * 2  # 16 rows a pass, 2 micro-batches of 2 per step, 2 epochs

    # Killed in iteration 4's rollout after iteration 3 (last.ckpt holds iteration 2): the resume replays 3 and 4.
    stopper = "--trainer.callbacks+={'class_path': 'test_run_safety.Crash', 'init_args': {'at': 3}}"
    sparse = [*common, "--checkpoint.last_every_n_iterations=2"]
    with pytest.raises(RuntimeError):
        fit(tmp_path / "killed", random_model_dir, *sparse, stopper)
    resumed = fit(tmp_path / "killed", random_model_dir, *sparse, "--ckpt_path=last")
    assert resumed.model.iteration == 4 and resumed.datamodule.next_batch == 11
    for name, weight in straight.model.policy.state_dict().items():
        assert torch.equal(weight, resumed.model.policy.state_dict()[name]), name
    assert _train_rows(tmp_path / "killed" / "run") == rows
    assert (tmp_path / "killed" / "run" / "generations.jsonl").read_text() == (
        tmp_path / "straight" / "run" / "generations.jsonl"
    ).read_text()


def test_refill_stops_at_the_round_limit_and_trains_on_what_there_is(tmp_path, random_model_dir):
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", "--model.init_args.max_sampling_rounds=2", *THIRD)
    rows = _train_rows(tmp_path / "run")
    assert [r["train/sampling_rounds"] for r in rows] == [2.0] * 3
    assert [r["train/groups_kept"] for r in rows] == [2.0, 1.0, 1.0]  # batches 2-3 and 4-5 hold one group each
    assert _trained_indices(tmp_path / "run") == [[0, 3], [6], [9]]


def test_refill_keeps_the_first_groups_with_spread_when_a_round_brings_more():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.5, 0.0, 3.0, 1.0])  # groups of 2: settled, 3 spread, ...
    keep, settled = unsettled_rows(rewards, 2, limit=2)
    assert keep.tolist() == [2, 3, 6, 7] and settled == 2
    keep, settled = unsettled_rows(rewards, 2)
    assert keep.tolist() == [2, 3, 6, 7, 8, 9] and settled == 2


def test_concatenated_rounds_pad_prompts_left_and_completions_right():
    a, _ = _rollout([1.0, 0.0], [True, False])
    b = RolloutBatch(
        input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]]),
        completion_mask=torch.tensor([[True, True]]),
        rewards=torch.tensor([0.5]),
        advantages=torch.zeros(1),
        prompt_len=4,
        texts=["b"],
        prompt_index=[1],
    )
    both = concat_rollouts([a, b], pad_id=0)
    assert both.prompt_len == 4 and both.input_ids.shape == (3, 7)
    assert both.input_ids[0].tolist() == [0, 0, *a.input_ids[0].tolist()]  # prompt of 2 padded to 4 on the left
    assert both.input_ids[2].tolist() == [5, 6, 7, 8, 9, 10, 0]  # completion of 2 padded to 3 on the right
    assert both.attention_mask[:, :2].tolist() == [[0, 0], [0, 0], [1, 1]]
    assert both.completion_mask[2].tolist() == [True, True, False]
    assert torch.equal(both.completion_ids[:2], a.completion_ids)  # every completion still starts at prompt_len
    assert both.rewards.tolist() == [1.0, 0.0, 0.5] and both.texts == [*a.texts, "b"]
    assert concat_rollouts([a], pad_id=0) is a
    with pytest.raises(ValueError, match="old_logp is set in some parts and not in others"):
        concat_rollouts([a, dataclasses.replace(b, old_logp=torch.zeros(1, 2))], pad_id=0)


# ---- mask_truncated, pi_old from the first pass, token_mean -----------------------------------------------------


def test_mask_truncated_zeroes_the_rows_without_eos(tmp_path, eos_model_dir, monkeypatch):
    seen = _record_losses(monkeypatch)
    fit(tmp_path, eos_model_dir, "--model.init_args.iterations=1", "--model.init_args.max_new_tokens=3",
        "--model.init_args.mask_truncated=true", *VARIED)  # fmt: skip
    (row,) = _train_rows(tmp_path / "run")
    masked = 0
    for part in seen[: len(seen) // 2]:  # the first epoch sees every row once
        no_eos = part.attention_mask[:, part.prompt_len :].sum(1) == part.completion_ids.shape[1]
        no_eos &= ~torch.isin(part.completion_ids, torch.tensor([1, 2, 3, 256, 257, 258, 259])).any(1)
        assert not part.completion_mask[no_eos].any()
        masked += int((part.completion_mask.sum(1) == 0).sum())
    assert row["train/masked_truncated"] == masked == pytest.approx(8 * row["train/truncated_frac"])
    assert 0 < masked < 8  # some rows end with an EOS, some do not


def _count_old_passes(monkeypatch) -> list[bool]:
    calls = []
    original = logprobs.LogProbs.no_grad

    def counting(self, rollout, reference=False):
        calls.append(reference)
        return original(self, rollout, reference)

    monkeypatch.setattr(logprobs.LogProbs, "no_grad", counting)
    return calls


@pytest.mark.parametrize("share", ["false", "true"])
def test_first_pass_gives_pi_old_exactly_without_dropout(tmp_path, random_model_dir, monkeypatch, share):
    # One optimizer step per pass (8 rows = minibatch 2 x accumulation 4), no dropout: pi_old comes from the first
    # pass. With trimming and prefix sharing off the metrics equal those of the separate no-grad pass bit for bit;
    # with sharing on, the no-grad pass runs 2 prompts per forward and a micro-batch 1, which rounds differently.
    monkeypatch.setattr(RolloutBatch, "trimmed", lambda self: self)
    one_step = ["--model.init_args.iterations=2", "--model.init_args.grad_accum_steps=4", *VARIED]
    one_step.append(f"--model.init_args.speed.share_prompt_prefix={share}")
    calls = _count_old_passes(monkeypatch)
    fit(tmp_path / "reuse", random_model_dir, *one_step)
    assert calls.count(False) == 0 and calls.count(True) == 2  # reference passes only
    monkeypatch.setattr(GRPOModule, "pi_old_from_first_pass", property(lambda self: False))
    fit(tmp_path / "separate", random_model_dir, *one_step)
    assert calls.count(False) == 2
    reuse, separate = _train_rows(tmp_path / "reuse" / "run"), _train_rows(tmp_path / "separate" / "run")
    if share == "false":
        assert reuse == separate
    else:
        assert reuse[0].keys() == separate[0].keys()
        for a, b in zip(reuse, separate, strict=True):
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(("switch", "old_passes"), [("false", 1), ("true", 0)])
def test_lora_dropout_keeps_the_separate_pass_unless_switched(
    tmp_path, random_model_dir, monkeypatch, switch, old_passes
):
    calls = _count_old_passes(monkeypatch)
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--model.init_args.grad_accum_steps=4",
        "--model.init_args.lora.r=4", "--model.init_args.lora.dropout=0.1",
        f"--model.init_args.speed.reuse_first_pass_logp={switch}", *VARIED)  # fmt: skip
    assert calls.count(False) == old_passes


def test_several_steps_per_pass_keep_the_separate_pass(tmp_path, random_model_dir, monkeypatch):
    calls = _count_old_passes(monkeypatch)  # SMALL: minibatch 2 x accumulation 2 over 8 rows: 2 steps per pass
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", *VARIED)
    assert calls.count(False) == 1


def _step_gradients(monkeypatch) -> list[torch.Tensor]:
    grads = []
    original = update.clipped_step

    def recording(context, optimizer):
        grads.append(torch.cat([p.grad.reshape(-1) for p in context.policy.parameters() if p.grad is not None]))
        return original(context, optimizer)

    monkeypatch.setattr(update, "clipped_step", recording)
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "reinforce"])
def test_token_mean_under_accumulation_equals_one_micro_batch(tmp_path, eos_model_dir, monkeypatch, algorithm):
    # One optimizer step over the same 8 rows (same seed: same rollout) of varied lengths, split 4 x 2 rows or taken as
    # one micro-batch of 8: with token_mean both are the mean over the step's tokens, so the
    # gradients agree (float32 here: the tiny configs' dtype; the loss-level float64 check is in test_losses.py).
    grads = _step_gradients(monkeypatch)
    config = f"configs/tiny/format_copy_{algorithm}.yaml"
    common = ["--model.init_args.iterations=1", "--model.init_args.kl_coef=0.1", *VARIED]
    if algorithm == "grpo":
        common.append("--model.init_args.ppo_epochs=1")
    splits = {"split": ("2", "4"), "whole": ("8", "1")}
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        for name, (rows, accum) in splits.items():
            split = [f"--model.init_args.minibatch_size={rows}", f"--model.init_args.grad_accum_steps={accum}"]
            aggregate = f"--model.init_args.objective.init_args.aggregation={aggregation}"
            fit(tmp_path / f"{aggregation}_{name}", eos_model_dir, *common, *split, aggregate, config=config)
    token_split, token_whole, seq_split, seq_whole = grads
    torch.testing.assert_close(token_split, token_whole, rtol=1e-4, atol=1e-7)
    # The check has teeth: the lengths vary, so the course's reduction (a mean of per-row means) is another objective.
    # (At this first step the policy equals the reference, so the KL term's gradient is 0 in both.)
    assert not torch.allclose(token_whole, seq_whole, rtol=1e-3)
    torch.testing.assert_close(seq_split, seq_whole, rtol=1e-4, atol=1e-7)  # equal-sized micro-batches: a mean too


# ---- rollout-side options on a hand-built rollout ----------------------------------------------------------------


def _rollout(rewards: list[float], eos_rows: list[bool]) -> tuple[RolloutBatch, list[Score]]:
    n = len(rewards)
    completion = torch.full((n, 3), 65)
    completion[torch.tensor(eos_rows), 1] = 2  # EOS id 2 ends these rows at their second token
    return (
        RolloutBatch(
            input_ids=torch.cat([torch.full((n, 2), 70), completion], dim=1),
            attention_mask=torch.ones(n, 5, dtype=torch.long),
            completion_mask=torch.ones(n, 3, dtype=torch.bool),
            rewards=torch.tensor(rewards),
            advantages=torch.zeros(n),
            prompt_len=2,
            texts=[str(r) for r in rewards],
            prompt_index=[i // 2 for i in range(n)],
        ),
        [Score(total=r, correct=r > 1, components={}) for r in rewards],
    )


def _hp(**changes) -> SimpleNamespace:
    hp = dict(group_size=2, advantage="grpo", adv_clip=5.0, filter_zero_std_groups=False, mask_truncated=False)
    return SimpleNamespace(**(hp | changes))


def test_apply_variants_estimators_then_clip():
    rollout, scores = _rollout([1.3, 0.2, 0.1, 0.1, 1.1, 0.0], [True] * 6)
    out, _, metrics = apply_variants(rollout, scores, _hp(advantage="rloo"), eos=[2])
    # rloo, G = 2: r minus the other reward: (1.1, -1.1), (0, 0), (1.1, -1.1).
    torch.testing.assert_close(out.advantages, torch.tensor([1.1, -1.1, 0.0, 0.0, 1.1, -1.1]))
    # Only the advantage scale is logged when no option is on: mean |A| = 4 x 1.1 / 6.
    assert metrics == pytest.approx({"train/advantage_abs_mean": 4 * 1.1 / 6})
    out, _, _ = apply_variants(rollout, scores, _hp(advantage="dr_grpo", adv_clip=0.5), eos=[2])
    # dr_grpo: r - mean = (0.55, -0.55), 0, (0.55, -0.55), then clipped to +-0.5.
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.5, -0.5]))
    out, _, _ = apply_variants(rollout, scores, _hp(), eos=[2])
    torch.testing.assert_close(out.advantages, group_advantages(rollout.rewards, 2))


def test_apply_variants_filter_and_mask_truncated():
    rollout, scores = _rollout([1.3, 0.2, 0.1, 0.1, 1.1, 0.0], [True, False, True, True, False, False])
    out, kept, metrics = apply_variants(rollout, scores, _hp(filter_zero_std_groups=True, mask_truncated=True), [2])
    assert out.texts == ["1.3", "0.2", "1.1", "0.0"] and [s.total for s in kept] == [1.3, 0.2, 1.1, 0.0]
    # Of the rows kept; each kept group is (r - mean) / (std + eps) = +-0.55 / (0.55 + 1e-6).
    expected = {"train/filtered_groups": 1.0, "train/masked_truncated": 3.0}
    expected["train/advantage_abs_mean"] = 0.55 / 0.550001
    assert metrics == pytest.approx(expected)
    assert out.completion_mask.tolist() == [[True] * 3, [False] * 3, [False] * 3, [False] * 3]
    assert out.attention_mask.sum() == 20  # the forward still sees every token


def test_trimmed_cuts_padding_columns_only():
    rollout, _ = _rollout([1.0, 0.0], [True, True])
    rollout.attention_mask[:, 4] = 0  # both completions end at their second token
    rollout = dataclasses.replace(rollout, old_logp=torch.arange(6.0).view(2, 3))
    trimmed = rollout.trimmed()
    assert trimmed.input_ids.shape == (2, 4) and trimmed.completion_mask.shape == (2, 2)
    assert trimmed.old_logp.tolist() == [[0.0, 1.0], [3.0, 4.0]] and trimmed.rewards is rollout.rewards


# ---- pass@k, settings ----------------------------------------------------------------------------------------------


def _pass_at_k_product(n: int, c: int, k: int) -> float:
    """Chen et al.'s numerically stable form: 1 - prod_{i = n-c+1}^{n} (1 - k / i)."""
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@pytest.mark.parametrize(
    ("n", "c", "k", "by_hand"),
    [
        (5, 1, 1, 0.2),  # one of five
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (16, 4, 8, 1 - 495 / 12870),  # 1 - C(12,8)/C(16,8)
        (4, 0, 2, 0.0),
        (4, 3, 2, 1.0),  # only one wrong sample: any two include a correct one
        (8, 8, 8, 1.0),
    ],
)
def test_pass_at_k_table(n, c, k, by_hand):
    assert pass_at_k(n, c, k) == pytest.approx(by_hand, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_product(n, c, k), abs=1e-12)


def test_eval_samples_log_pass_at_1_and_k(tmp_path, random_model_dir):
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--model.init_args.evaluation.samples=4", *VARIED)
    evals = [r for r in _rows(tmp_path / "run") if "eval/exact_match" in r]
    assert len(evals) == 2
    for r in evals:  # 4 prompts x 4 samples: pass@1 in steps of 1/16, pass@4 in steps of 1/4, pass@4 >= pass@1
        assert (r["eval/pass_at_1"] * 16) == pytest.approx(round(r["eval/pass_at_1"] * 16))
        assert (r["eval/pass_at_k"] * 4) == pytest.approx(round(r["eval/pass_at_k"] * 4))
        assert r["eval/pass_at_1"] <= r["eval/pass_at_k"] <= 1.0
    assert any(r["eval/pass_at_1"] > 0 for r in evals)


class CountingTask(VariedTask):
    """VariedTask counting how often each eval completion is scored (eval prompts have no `:`)."""

    eval_scores = 0

    def score(self, completion: str, example: Example) -> Score:
        if ":" not in example.prompt:
            CountingTask.eval_scores += 1
        return super().score(completion, example)


def test_an_evaluation_scores_each_completion_once_and_the_file_and_metrics_agree(tmp_path, random_model_dir):
    # 2 evaluations (iteration 0 and the end) of 4 greedy completions, plus 4 x 3 sampled ones each: 2 * (4 + 12)
    # calls; the metrics, the eval file and pass@k all use those scores (before, the greedy ones were scored 3 times).
    CountingTask.eval_scores = 0
    task = ["--data.task=test_variants.CountingTask", "--data.task.init_args.eval_size=4"]
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--model.init_args.evaluation.samples=3", *task)
    assert CountingTask.eval_scores == 2 * (4 + 12)
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval" / "iter_00001.jsonl").read_text().splitlines()]
    final = [r for r in _rows(tmp_path / "run") if "eval/exact_match" in r][-1]
    assert final["eval/reward"] == pytest.approx(sum(r["reward"] for r in rows) / 4, abs=1e-6)
    assert final["eval/exact_match"] == pytest.approx(sum(r["correct"] for r in rows) / 4, abs=1e-6)
    assert [r["reward"] for r in rows] == [_reward(r["completion"]) for r in rows]


def test_reinforce_takes_no_grpo_key(capsys, monkeypatch, tmp_path):
    # Not in its signature (so not in its --help); set in a REINFORCE config, one line names the key and the fix.
    import inspect

    from llm_pg.cli.entry import main

    key = "ppo_epochs"
    assert key not in inspect.signature(ReinforceModule).parameters and key in inspect.signature(GRPOModule).parameters
    assert key not in ReinforceModule(model_name_or_path="tiny").hparams
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    config = f"--config={ROOT / 'configs/tiny/format_copy_reinforce.yaml'}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", config, f"--runs_root={tmp_path}", f"--model.init_args.{key}=1"])
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and f"Option '{key}' is not accepted" in line
    assert f"model.{key} is a GRPOModule key" in line and "use llm_pg.modules.GRPOModule" in line


def test_switching_a_grpo_config_to_reinforce_drops_ppo_epochs_and_keeps_the_named_objective(
    tmp_path, random_model_dir
):
    # An objective named before the switch (here its clip_eps_high, which makes GRPO's default ClippedSurrogate
    # explicit) is kept: REINFORCE then clips with it (one pass of one optimizer step: rho = 1 and the gradient is the
    # sequence mean's); `objective: sequence_mean` is the course's. Without either, the switch trains SequenceMean
    # (tests/test_spelling.py).
    for name, objective in (("named", []), ("course", ["--model.init_args.objective=sequence_mean"])):
        cli = fit(
            tmp_path / name,
            random_model_dir,
            "--model.init_args.iterations=1",
            "--model.init_args.objective.init_args.clip_eps_high=0.28",
            "--model.class_path=llm_pg.modules.ReinforceModule",
            *objective,
            *VARIED,
        )
        assert type(cli.model) is ReinforceModule and "ppo_epochs" not in cli.model.hparams and cli.model.epochs == 1
        assert type(cli.model.objective) is (ClippedSurrogate if name == "named" else SequenceMean)
    assert cli.model.objective.aggregation == "seq_mean_token_mean"


def test_reinforce_takes_the_estimator_and_aggregation_keys():
    objective = partial(SequenceMean, aggregation="token_mean")
    module = ReinforceModule(model_name_or_path="tiny", advantage="rloo", objective=objective)
    assert module.hparams.advantage == "rloo" and module.objective.aggregation == "token_mean"


def test_core_variant_functions_on_hand_built_tensors():
    from llm_pg.core.advantages import clipped_advantages, truncated_rows, unsettled_rows

    # Rows 0-1 hold EOS (2) somewhere, row 2 never does: only row 2 is truncated.
    ids = torch.tensor([[5, 2, 0], [2, 7, 7], [5, 6, 7]])
    assert truncated_rows(ids, [2]).tolist() == [False, False, True]
    assert truncated_rows(ids, [6, 2]).tolist() == [False, False, False]
    # G = 2: groups (1, 1) and (0.5, 0.5) are settled; only the middle group (0, 1) is kept, whole and in order.
    keep, settled = unsettled_rows(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert keep.tolist() == [2, 3] and settled == 2 and keep.device.type == "cpu"
    # dr_grpo on (0, 1): r - mean = (-0.5, 0.5); the clip at 0.25 halves both.
    torch.testing.assert_close(
        clipped_advantages(torch.tensor([0.0, 1.0]), 2, "dr_grpo", 0.25), torch.tensor([-0.25, 0.25])
    )
