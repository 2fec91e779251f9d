"""PromptGroupDataModule: an endless, seeded, resumable stream of prompt batches, and the task's eval set.

Batch `k` on rank `r` of `w` holds the task's train examples at stream indices `(k*w + r)*n + j`,
`j = 0..n-1`, `n = prompts_per_step`: a pure function of `(seed, k, r, w, n)`, so ranks see different
prompts and a resumed run sees exactly the prompts an uninterrupted one would. The expansion of each
prompt to `group_size` completions happens in the rollout, not here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from llm_pg.core.rollout import rank_and_world_size
from llm_pg.data.batches import PromptBatch
from llm_pg.data.isolation import TaskScorer
from llm_pg.data.tasks.base import Example, Task

__all__ = ["PromptGroupDataModule"]


def _keep(item: Any) -> Any:
    """Collate that leaves batches of `Example`s as they are."""
    return item


class PromptStream(IterableDataset):
    """`PromptBatch`es `k = start, start + 1, ...` forever."""

    def __init__(self, task: Task, seed: int, prompts_per_step: int, start: int, rank: int, world_size: int) -> None:
        self.task, self.seed, self.prompts_per_step = task, seed, prompts_per_step
        self.start, self.rank, self.world_size = start, rank, world_size

    def batch(self, k: int) -> PromptBatch:
        first = (k * self.world_size + self.rank) * self.prompts_per_step
        return PromptBatch(k, [self.task.train_example(first + j, self.seed) for j in range(self.prompts_per_step)])

    def __iter__(self) -> Iterator[PromptBatch]:
        k = self.start
        while True:
            yield self.batch(k)
            k += 1


class EvalBatches(IterableDataset):
    """The eval examples in lists of `batch_size`, for `llm-pg validate` (evaluation during fit batches by
    `evaluation.generate_batch_size`). Iterable, so Lightning adds no distributed sampler: every rank sees the whole
    set and `evaluate` shards each batch across ranks itself."""

    def __init__(self, examples: list[Example], batch_size: int) -> None:
        self.examples, self.batch_size = examples, batch_size

    def __iter__(self) -> Iterator[list[Example]]:
        for start in range(0, len(self.examples), self.batch_size):
            yield self.examples[start : start + self.batch_size]


class PromptGroupDataModule(L.LightningDataModule):
    """Seeded prompt batches of `prompts_per_step` examples for training; `task.eval_examples` for eval.

    Resume: the rollout callback calls `mark_consumed(k)` once an iteration has trained on batches up to `k` (one
    per iteration, or several with dynamic sampling's refill: the position counts every batch drawn);
    `state_dict()` saves the next batch index and `load_state_dict()` restores it, so the rollout reads on from
    there. The counter is not advanced when a batch is yielded, because Lightning fetches a batch ahead.

    Args:
        task: the task (`class_path` of a `llm_pg.data.tasks` class or your own `Task`, with its `init_args`).
        prompts_per_step: prompts per RL iteration (each gets `group_size` completions; the course: 8).
        seed: the run's seed (linked from the top-level `seed`).
        validate_batch_size: eval prompts per batch of `llm-pg validate`.
        reward_timeout: seconds one completion's scoring may take when the task runs your code (a `Task` of your
            own, or a `module:function` reward): past it the run stops, naming the row and the line the code was
            stuck at (`llm_pg.data.isolation`). llm_pg's own checkers take milliseconds on any text.
        reward_workers: processes that score a task running your code, each call under `reward_timeout` and
            isolated, so a hang, `sys.exit` or a crash stops the run with one line instead of hanging or ending it
            (null: min(4, CPUs); 0: score in the trainer's process, with neither). llm_pg's own tasks and rewards
            always score in-process.
    """

    def __init__(
        self,
        task: Task,
        prompts_per_step: int = 8,
        seed: int = 0,
        validate_batch_size: int = 64,
        reward_timeout: float = 30.0,
        reward_workers: int | None = None,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if validate_batch_size < 1:
            raise ValueError(f"validate_batch_size must be >= 1, got {validate_batch_size}")
        if not (isinstance(reward_timeout, int | float) and reward_timeout > 0):
            raise ValueError(f"data.reward_timeout must be > 0 seconds, got {reward_timeout!r}; e.g. 30")
        if reward_workers is not None and not (isinstance(reward_workers, int) and reward_workers >= 0):
            raise ValueError(
                f"data.reward_workers must be an integer >= 0 or null, got {reward_workers!r}; null: min(4, CPUs), "
                "0: score in the trainer's process"
            )
        self.task = task
        task.bind_seed(seed)  # a task may derive its eval set from the run's seed (format_copy: seed + 123)
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.validate_batch_size = validate_batch_size
        self.reward_timeout, self.reward_workers = float(reward_timeout), reward_workers
        self._scorer: TaskScorer | None = None
        self.next_batch = 0

    def setup(self, stage: str | None = None) -> None:
        self.task.prepare()  # load task data here, so a missing dataset fails before any rollout

    @property
    def scorer(self) -> TaskScorer:
        """How the task's completions are scored (reward workers for your code; `llm_pg.data.isolation`)."""
        if self._scorer is None:
            self._scorer = TaskScorer(self.task, self.reward_workers, self.reward_timeout)
        return self._scorer

    def teardown(self, stage: str | None = None) -> None:
        if self._scorer is not None:  # the reward workers end with the fit (or validate) that started them
            self._scorer.close()
            self._scorer = None

    def on_exception(self, exception: BaseException) -> None:
        self.teardown()  # a run that stops (a reward that hung, a signal) ends its workers too

    def train_stream(self) -> PromptStream:
        rank, world_size = rank_and_world_size(self.trainer)
        return PromptStream(self.task, self.seed, self.prompts_per_step, self.next_batch, rank, world_size)

    def prompt_batch(self, position: int) -> PromptBatch:
        """This rank's stream batch `position`, as the dataloader yields it. The rollout takes the dataloader's
        batch; it reads the stream here only for dynamic sampling's refill rounds (the batches after it), and after
        such rounds, when the dataloader's next batch (fetched ahead) is one the refill already used."""
        return self.train_stream().batch(position)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_stream(), batch_size=None, num_workers=0, collate_fn=_keep)

    def val_dataloader(self) -> DataLoader:
        batches = EvalBatches(self.task.eval_examples, self.validate_batch_size)
        return DataLoader(batches, batch_size=None, num_workers=0, collate_fn=_keep)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Batches hold no tensors (the rollout tokenizes), and Lightning's default transfer would try to
        rebuild the frozen `Example` dataclasses and fail, so they pass through unchanged."""
        return batch

    def mark_consumed(self, index: int) -> None:
        """Record that training used the batches up to `index`; a resumed run continues at `index + 1`."""
        self.next_batch = index + 1

    def state_dict(self) -> dict[str, Any]:
        state = {"next_batch": self.next_batch, "seed": self.seed, "prompts_per_step": self.prompts_per_step}
        fingerprint = self.task.data_fingerprint()  # the data is part of the run: a resume over other data is refused
        return state if fingerprint is None else {**state, "data_fingerprint": fingerprint}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("seed", "prompts_per_step"):
            if key in state_dict and state_dict[key] != getattr(self, key):
                rank_zero_warn(
                    f"resuming with {key}={getattr(self, key)} but the checkpoint used {state_dict[key]}: "
                    "the prompt stream will differ from the interrupted run"
                )
        self.next_batch = int(state_dict["next_batch"])
