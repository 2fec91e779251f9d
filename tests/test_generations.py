"""The sampled-generations table: whole prompt groups up to `log_generations.rows`, with the gold answer, reward
components, correct, advantage, length and truncation; the same rows in generations.jsonl and the W&B table."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from test_metrics import EOS, rollout, scores

from llm_pg.callbacks.evaluation import EvalCallback
from llm_pg.callbacks.generations import GenerationsCallback, table_rows
from llm_pg.callbacks.sharded_eval import Evaluation
from llm_pg.data.batches import PromptBatch, ScoredRollout
from llm_pg.data.tasks.base import Example
from llm_pg.modules.settings import check_settings

EXAMPLES = [Example("Copy: 41", "41"), Example("Copy: -7", "-7")]


def filled_rollout():
    texts = [f"text {i}" for i in range(6)]
    return dataclasses.replace(rollout(), advantages=torch.tensor([1.3, -0.4, -0.9, 0.0, 0.0, 0.0]), texts=texts)


@pytest.mark.parametrize(("max_rows", "rows"), [(24, 6), (6, 6), (5, 3), (4, 3), (1, 3)])
def test_whole_groups_up_to_the_row_count_and_one_group_at_least(max_rows, rows):
    _, table = table_rows(3, filled_rollout(), scores(), EXAMPLES, [EOS], group_size=3, max_rows=max_rows)
    assert len(table) == rows


def test_columns_hold_answer_components_correct_length_and_truncation():
    columns, table = table_rows(3, filled_rollout(), scores(), EXAMPLES, [EOS], group_size=3, max_rows=24)
    assert columns == [
        "iteration", "prompt", "answer", "completion", "reward", "reward_correct", "reward_tags", "reward_clean",
        "correct", "advantage", "length", "truncated",
    ]  # fmt: skip
    rows = [dict(zip(columns, row, strict=True)) for row in table]
    assert rows[0] == {
        "iteration": 3, "prompt": "Copy: 41", "answer": "41", "completion": "text 0", "reward": pytest.approx(1.3),
        "reward_correct": 1.0, "reward_tags": 0.2, "reward_clean": 0.1, "correct": True,
        "advantage": pytest.approx(1.3), "length": 3, "truncated": False,
    }  # fmt: skip
    assert [r["length"] for r in rows] == [3, 4, 1, 2, 4, 4]
    assert [r["truncated"] for r in rows] == [False, True, False, False, False, True]  # rows 1 and 5: no EOS
    assert [r["answer"] for r in rows] == ["41"] * 3 + ["-7"] * 3
    assert [r["correct"] for r in rows] == [True, False, False, True, True, True]


def test_length_counts_the_sampled_tokens_even_when_mask_truncated_zeroed_the_mask():
    batch = filled_rollout()
    zeroed = batch.completion_mask & torch.tensor([[True], [False], [True], [True], [True], [False]])
    batch = dataclasses.replace(batch, completion_mask=zeroed)
    columns, table = table_rows(0, batch, scores(), EXAMPLES, [EOS], group_size=3, max_rows=24)
    assert [row[columns.index("length")] for row in table] == [3, 4, 1, 2, 4, 4]


class FakeWandb(WandbLogger):
    def __init__(self, log_dir):
        self.tables, self._dir = [], log_dir

    @property
    def log_dir(self):
        return self._dir

    def log_table(self, key, columns=None, data=None, step=None, **kwargs):
        self.tables.append((key, columns, data, step))

    def log_metrics(self, metrics, step=None):
        pass

    def save(self):
        pass


def test_the_callback_writes_the_jsonl_and_the_wandb_table_keeping_the_iteration_field(tmp_path, monkeypatch):
    logger = FakeWandb(str(tmp_path))
    trainer = SimpleNamespace(loggers=[logger], default_root_dir=str(tmp_path))
    module = SimpleNamespace(iteration=6, policy=None, tokenizer=None)
    callback = GenerationsCallback(every=5, rows=4, group_size=3)
    monkeypatch.setattr("llm_pg.callbacks.generations.eos_token_ids", lambda policy, tokenizer: [EOS])
    batch = PromptBatch(0, EXAMPLES, ScoredRollout(filled_rollout(), scores(), examples=EXAMPLES))
    callback.on_train_batch_end(trainer, module, None, batch, 0)  # iteration 6 sampled: 6 = 1 + 5
    lines = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(row["iteration"] == 6 for row in lines)  # runs.logs.trim_logs reads `iteration`
    module.iteration = 5  # not 1 + a multiple of 5: nothing more is written
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 3
    [(key, columns, data, step)] = logger.tables
    assert key == "generations" and step == 6 and [dict(zip(columns, row, strict=True)) for row in data] == lines
    module.iteration = 7  # iteration 6: not a multiple of 5
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    assert len(logger.tables) == 1


def test_eval_completions_go_to_wandb_as_a_table(tmp_path, monkeypatch):
    logger = FakeWandb(str(tmp_path))
    task = SimpleNamespace(
        eval_examples=EXAMPLES,
        score=lambda completion, example: scores()[0 if example.answer in completion else 1],
    )
    trainer = SimpleNamespace(loggers=[logger], datamodule=SimpleNamespace(task=task), is_global_zero=True)
    module = SimpleNamespace(iteration=10, policy=None, latest_eval={}, engine=None, eval_context=lambda data: None)
    completions = ["<answer>41</answer>", "7"]
    scored = [task.score(c, x) for c, x in zip(completions, EXAMPLES, strict=True)]
    monkeypatch.setattr(
        "llm_pg.callbacks.evaluation.evaluate",
        lambda context, engine, examples, iteration: Evaluation({"exact_match": 0.5}, completions, scored),
    )
    EvalCallback()._evaluate(trainer, module)
    [(key, columns, data, step)] = logger.tables
    assert key == "eval_completions" and step == 10
    assert columns == ["iteration", "prompt", "answer", "completion", "reward", "correct"]
    assert data == [[10, "Copy: 41", "41", "<answer>41</answer>", pytest.approx(1.3), True],
                    [10, "Copy: -7", "-7", "7", pytest.approx(0.2), False]]  # fmt: skip
    written = [json.loads(line) for line in (tmp_path / "eval" / "iter_00010.jsonl").read_text().splitlines()]
    assert [[10, *row.values()] for row in written] == data


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "24"])
def test_log_generations_rows_is_validated_in_one_line(value):
    from llm_pg.modules import GRPOModule

    with pytest.raises(ValueError, match=r"^model\.log_generations\.rows must be an integer >= 1, got .*; rows per"):
        GRPOModule(log_generations={"rows": value})
    assert check_settings  # the constructor runs llm_pg.modules.settings.check_settings
