"""What every task provides: prompts, a deterministic eval set, and a reward that never raises."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


class RewardError(ValueError):
    """A reward that cannot be used (a reward function returned a non-number, say). The message names the function
    and the value; the rollout stops the run with it in one line, with the row it was scoring."""


@dataclass(frozen=True)
class Score:
    """The reward of one completion: `total` is the sum of `components`; `correct` is exact match."""

    total: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Example:
    """One prompt of a task: the user turn, the gold answer the reward checks against, and any other fields
    of its row (`DatasetTask` puts every column but the prompt and answer columns here; a reward function reads
    them as `example.fields["unit"]`). `Example(prompt, answer)` has no fields. Fields take part in `==` but
    not in `hash`, so an example stays hashable whatever its fields hold."""

    prompt: str  # the user turn, as the model sees it inside the chat template
    answer: str  # the gold answer (an integer for format_copy and arith, a number for math_hard)
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)


class Task(ABC):
    """A verifiable-reward task.

    Subclasses set `name` and `components` (the reward's part names, logged as `train/reward_<part>`)
    and take their knobs (value range, system prompt, eval size and seed) as constructor arguments,
    so a YAML config can set them.
    """

    name: str = "task"
    components: tuple[str, ...] = ()

    def __init__(self, system_prompt: str | None = None, eval_size: int = 64, eval_seed: int | None = 1234) -> None:
        if eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {eval_size}")
        self.system_prompt = system_prompt
        self.eval_size = eval_size
        self.eval_seed = eval_seed
        self.run_seed = 0

    def bind_seed(self, seed: int) -> None:
        """Tell the task the run's top-level `seed` (the datamodule does), for eval sets derived from it."""
        if seed != self.run_seed:
            self.run_seed = seed
            self.__dict__.pop("eval_examples", None)  # drop an eval set built for the old seed

    @abstractmethod
    def train_example(self, index: int, seed: int) -> Example:
        """Example `index` of the endless training stream; a pure function of `(seed, index)`."""

    @abstractmethod
    def build_eval_set(self) -> list[Example]:
        """The held-out set: identical across algorithms and processes, and across runs with the same seed
        (format_copy draws it from the run seed + 123, as the course does)."""

    @abstractmethod
    def score(self, completion: str, example: Example) -> Score:
        """Reward of one completion. Never raises and never evaluates the text as code."""

    def prepare(self) -> None:
        """Load whatever the task needs (data files) now; a no-op for synthetic tasks."""
        return None

    def data_fingerprint(self) -> str | None:
        """A digest of the data the task reads beyond its config (`examples_digest` of its train rows and eval
        set), recorded in checkpoints: a resume over changed data is refused. None (the default): the task's
        examples are a function of its config and the seed (synthetic tasks), which the settings check covers."""
        return None

    def data_source(self) -> str:
        """Where the task's data comes from, for messages (the files, or the dataset's name)."""
        return type(self).__name__

    @cached_property
    def eval_examples(self) -> list[Example]:
        return self.build_eval_set()

    def messages(self, example: Example) -> list[dict[str, str]]:
        """Chat messages for `example`: an optional system turn, then the user turn."""
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*turns, {"role": "user", "content": example.prompt}]

    def scores_of(
        self, completions: Sequence[str], examples: Sequence[Example], scores: Sequence[Score] | None = None
    ) -> Sequence[Score]:
        """`scores` when given (one per completion), else each completion scored."""
        if scores is None:
            return [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
        if len(scores) != len(completions):
            raise ValueError(f"eval_metrics got {len(scores)} scores for {len(completions)} completions")
        return scores

    def eval_metrics(
        self, completions: Sequence[str], examples: Sequence[Example], scores: Sequence[Score] | None = None
    ) -> dict[str, float]:
        """Eval-set metrics; the base reports `exact_match` and the mean reward. `scores`: `score(completions[i],
        examples[i])` when the caller has them already (the evaluation does), so no completion is scored twice."""
        scores = self.scores_of(completions, examples, scores)
        n = max(len(scores), 1)
        return {
            "exact_match": sum(s.correct for s in scores) / n,
            "reward": sum(s.total for s in scores) / n,
        }


def examples_digest(*example_lists: list[Example]) -> str:
    """sha256 over every example's prompt, answer and metadata, list by list, in order."""
    digest = hashlib.sha256()
    for examples in example_lists:
        digest.update(f"[{len(examples)}]".encode())
        for example in examples:
            row = [example.prompt, example.answer, dict(example.fields)]
            digest.update(json.dumps(row, sort_keys=True, default=repr).encode())
    return digest.hexdigest()
