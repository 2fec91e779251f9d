"""PromptGroupDataModule: batch layout, DDP rank split, resume from state_dict and from a checkpoint."""

import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from llm_pg.data.batches import PromptBatch
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.data.tasks import ArithTask, FormatCopyTask


def first_batches(datamodule: PromptGroupDataModule, count: int) -> list[PromptBatch]:
    iterator = iter(datamodule.train_dataloader())
    return [next(iterator) for _ in range(count)]


def test_batches_hold_prompts_per_step_examples_from_the_stream():
    task = FormatCopyTask()
    datamodule = PromptGroupDataModule(task, prompts_per_step=3, seed=7)
    batches = first_batches(datamodule, 4)
    assert [b.index for b in batches] == [0, 1, 2, 3]
    assert batches[2].examples == [task.train_example(6 + j, seed=7) for j in range(3)]
    assert datamodule.next_batch == 0  # yielding does not count as consuming


def test_resume_from_state_dict_gives_the_same_next_batch():
    task = ArithTask()
    uninterrupted = first_batches(PromptGroupDataModule(task, prompts_per_step=4, seed=1), 6)
    interrupted = PromptGroupDataModule(task, prompts_per_step=4, seed=1)
    first_batches(interrupted, 4)  # one batch fetched ahead of the three used
    for k in range(3):
        interrupted.mark_consumed(k)
    state = interrupted.state_dict()
    assert state == {"next_batch": 3, "seed": 1, "prompts_per_step": 4}
    resumed = PromptGroupDataModule(task, prompts_per_step=4, seed=1)
    resumed.load_state_dict(state)
    assert first_batches(resumed, 3) == uninterrupted[3:]


def test_ranks_get_disjoint_prompts():
    task = FormatCopyTask(low=0, high=10**9)  # a wide range, so distinct stream indices give distinct prompts
    seen = []
    for rank in range(2):
        datamodule = PromptGroupDataModule(task, prompts_per_step=4, seed=0)
        datamodule.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        batches = first_batches(datamodule, 3)
        seen.append([e.prompt for b in batches for e in b.examples])
    assert not set(seen[0]) & set(seen[1])
    assert seen[0][:4] == [task.train_example(j, seed=0).prompt for j in range(4)]
    assert seen[1][:4] == [task.train_example(4 + j, seed=0).prompt for j in range(4)]


def test_val_dataloader_serves_the_eval_set_in_lists():
    task = FormatCopyTask(eval_size=10)
    batches = list(PromptGroupDataModule(task, validate_batch_size=4).val_dataloader())
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [e for b in batches for e in b] == task.eval_examples


def test_run_seed_reaches_the_task_eval_set():
    """format_copy's eval set is the course's: drawn with the run's seed + 123 unless eval_seed is given."""
    task = FormatCopyTask()
    assert [e.answer for e in task.eval_examples[:2]] == ["-4143", "-615"]  # unbound: seed 0, eval seed 123
    PromptGroupDataModule(task, seed=5)
    assert [e.answer for e in task.eval_examples[:2]] == ["-1123", "1646"]  # eval seed 128 (course's values)
    pinned = FormatCopyTask(eval_seed=123)
    PromptGroupDataModule(pinned, seed=5)
    assert [e.answer for e in pinned.eval_examples[:2]] == ["-4143", "-615"]


@pytest.mark.parametrize(("key", "value"), [("prompts_per_step", 0), ("validate_batch_size", 0)])
def test_invalid_arguments_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"{key} must be >= 1"):
        PromptGroupDataModule(FormatCopyTask(), **{key: value})


class RecordingModule(L.LightningModule):
    """Trains a dummy parameter and records which prompt batches it used."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.used: list[tuple[int, list[str]]] = []
        self.validated: list[str] = []

    def training_step(self, batch, batch_idx):
        self.used.append((batch.index, [e.prompt for e in batch.examples]))
        self.trainer.datamodule.mark_consumed(batch.index)
        return (self.weight - 1.0) ** 2

    def validation_step(self, batch, batch_idx):
        self.validated.extend(e.prompt for e in batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_trainer(root, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def fit(max_steps: int, root, ckpt_path=None) -> tuple[RecordingModule, L.Trainer]:
    trainer = make_trainer(root, max_steps=max_steps, limit_val_batches=0)
    module = RecordingModule()
    trainer.fit(module, PromptGroupDataModule(ArithTask(), prompts_per_step=2, seed=3), ckpt_path=ckpt_path)
    return module, trainer


def test_checkpoint_resume_replays_the_uninterrupted_stream(tmp_path):
    full, _ = fit(5, tmp_path)
    first, trainer = fit(3, tmp_path)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    resumed, _ = fit(5, tmp_path, ckpt_path=tmp_path / "step3.ckpt")
    assert [k for k, _ in full.used] == [0, 1, 2, 3, 4]
    assert first.used + resumed.used == full.used


def test_lightning_validation_gets_the_whole_eval_set(tmp_path):
    module, task = RecordingModule(), ArithTask(eval_size=5)
    make_trainer(tmp_path).validate(module, PromptGroupDataModule(task, validate_batch_size=2), verbose=False)
    assert module.validated == [e.prompt for e in task.eval_examples]


def test_reward_settings_are_one_line_errors_and_only_user_code_is_isolated(tmp_path):
    from conftest import DigitTask

    from llm_pg.data.isolation import TaskScorer
    from llm_pg.data.tasks import DatasetTask

    with pytest.raises(ValueError, match=r"^data\.reward_timeout must be > 0 seconds, got 0; e\.g\. 30$"):
        PromptGroupDataModule(FormatCopyTask(), reward_timeout=0)
    with pytest.raises(ValueError, match=r"^data\.reward_workers must be an integer >= 0 or null, got -1; "):
        PromptGroupDataModule(FormatCopyTask(), reward_workers=-1)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "p", "answer": "1"}\n' * 4)
    (tmp_path / "own_rewards.py").write_text("def score(completion, example):\n    return 0.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        builtin = DatasetTask(data_files=str(tmp_path / "rows.jsonl"), rewards=["answer_tag"], eval_size=1)
        own = DatasetTask(data_files=str(tmp_path / "rows.jsonl"), rewards=["answer_tag", "own_rewards:score"])
    finally:
        sys.path.remove(str(tmp_path))
    isolated = {
        name: TaskScorer(task, workers=2).isolated
        for name, task in [
            ("format_copy", FormatCopyTask()),
            ("builtin", builtin),
            ("own", own),
            ("digits", DigitTask()),
        ]
    }
    assert isolated == {"format_copy": False, "builtin": False, "own": True, "digits": True}
    assert not TaskScorer(DigitTask(), workers=0).isolated
