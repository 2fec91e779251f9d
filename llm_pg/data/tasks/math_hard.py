"""math_hard: level-5 MATH problems whose gold answer is a number (the course's hw4 task).

The data is `the-jb/hendrycks-math` (MATH schema: `problem`, `level`, `type`, `solution`) by default;
any hub id, local directory, or builder plus `data_files` (`dataset="json", data_files={"train": ...,
"test": ...}`) works. Rows are kept exactly as the course keeps them (see `math_data.py`, which also states
our one departure: None problems and solutions are dropped); the counts of rows seen, kept and dropped by
reason are logged and kept in `MathHardTask.filter_stats`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from functools import cached_property

from llm_pg.data.tasks.answers import boxed_number, extract_boxed, gold_value, last_number
from llm_pg.data.tasks.base import Example, Score, Task, examples_digest
from llm_pg.data.tasks.math_data import DataFileError, DatasetUnavailableError, filter_rows, load_split

__all__ = [
    "BoxedAnswerTask",
    "DataFileError",
    "DatasetUnavailableError",
    "MathHardTask",
    "extract_boxed",
    "filter_rows",
    "score",
]

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "Solve the competition-level math problem.\n"
    "Return the final answer in this exact format: \\boxed{NUMBER}\n"
    "Do not output XML, ####, or extra prose.\n"
    "Output only the boxed final answer."
)
PROMPT_TEMPLATE = "{problem}\n\nReturn only: \\boxed{NUMBER}"

CORRECT_REWARD = 1.0
BOXED_REWARD = 0.1
RELAXED_REWARD = 0.1


def _close(value: float | None, gold: float | None) -> bool:
    return value is not None and gold is not None and abs(value - gold) < 1e-6


def score(completion: str, answer: str) -> Score:
    """Reward of a boxed-number completion against the gold number `answer`, equal to the course's
    `MathHardTask.reward`.

    total = boxed + relaxed + correct (summed in this order, as the course does), with
        boxed   0.1  the text contains the literal `\\boxed{` in any case (`\\BOXED{` too; `<think>` included)
        relaxed 0.1  no closed box parses as a number, yet the last number token of the think-stripped text
                     is within 1e-6 of the gold (so "... the answer is 12" earns a little)
        correct 1.0  the last closed `\\boxed{...}` (or `\\boxed {...}`) of the think-stripped text parses
                     to within 1e-6 of the gold
    Maximum 1.1. The gold is `float(answer)` (`repr` of a float reads back exactly), else `parse_number(answer)`.
    Never raises, never evaluates the text.
    """
    gold = gold_value(answer)
    boxed_value = boxed_number(completion)
    correct = _close(boxed_value, gold)
    relaxed = boxed_value is None and _close(last_number(completion), gold)
    boxed = "\\boxed{" in completion.lower()
    total = 0.0
    for earned, weight in ((boxed, BOXED_REWARD), (relaxed, RELAXED_REWARD), (correct, CORRECT_REWARD)):
        total += weight if earned else 0.0
    components = {
        "correct": CORRECT_REWARD * correct,
        "boxed": BOXED_REWARD * boxed,
        "relaxed": RELAXED_REWARD * relaxed,
    }
    return Score(total=total, correct=correct, components=components)


class BoxedAnswerTask(Task):
    """A task answered with `\\boxed{NUMBER}` and scored by `score` above (math_hard and arith)."""

    components = ("correct", "boxed", "relaxed")

    def score(self, completion: str, example: Example) -> Score:
        return score(completion, example.answer)

    def eval_metrics(
        self, completions: Sequence[str], examples: Sequence[Example], scores: Sequence[Score] | None = None
    ) -> dict[str, float]:
        """The course's eval: `exact_match` (boxed parser), `exact_match_relaxed` (boxed, or else the last
        number token, even when a wrong box parses), `has_boxed` (a closed box) and the mean `reward`."""
        n = max(len(completions), 1)
        totals = {"exact_match": 0.0, "exact_match_relaxed": 0.0, "has_boxed": 0.0, "reward": 0.0}
        scores = self.scores_of(completions, examples, scores)
        for completion, example, result in zip(completions, examples, scores, strict=True):
            totals["exact_match"] += result.correct
            totals["exact_match_relaxed"] += result.correct or _close(
                last_number(completion), gold_value(example.answer)
            )
            totals["has_boxed"] += extract_boxed(completion) is not None
            totals["reward"] += result.total
        return {key: value / n for key, value in totals.items()}


class MathHardTask(BoxedAnswerTask):
    """Level-5 MATH with numeric answers: train from `train_split`, eval on the first `eval_size` (512) kept
    rows of `eval_split` in dataset order, as the course does. `levels` lists the kept MATH levels (the
    course's `(5,)`; empty keeps every level). A split that keeps no row is a ValueError naming it.

    The data loads on first use (`prepare()`, `train_example` or `eval_examples`), not in `__init__`, so a
    config can be built without it. `train_example(i, seed)` walks the kept train rows in a fresh seeded
    permutation per epoch: row `perm(seed, i // N)[i % N]`, N the number of kept rows. In
    `prompt_template` the literal `{problem}` is replaced by the problem; other braces stay as written.

    Args:
        dataset: a hub id (the course's `the-jb/hendrycks-math`) or a file format (`json`, `parquet`, `csv`) with
            `data_files`.
        data_files: local files, one path or a `{split: path}` mapping (relative paths: beside the config first).
        config_name: the hub dataset's configuration (null: its default).
        levels: MATH levels kept, by the first integer of the `level` field (the course: [5]; [] keeps all).
        train_split: the split prompts are drawn from.
        eval_split: the split whose first `eval_size` kept rows are the eval set.
        eval_size: eval examples (the course: 512).
        system_prompt: the system turn (the course's Qwen2.5-Math prompt; null: none).
        prompt_template: the user turn, with `{problem}` replaced by the problem.
    """

    name = "math_hard"

    def __init__(
        self,
        dataset: str = "the-jb/hendrycks-math",
        data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        config_name: str | None = None,
        levels: Sequence[int] = (5,),
        train_split: str = "train",
        eval_split: str = "test",
        eval_size: int = 512,
        system_prompt: str | None = SYSTEM_PROMPT,
        prompt_template: str = PROMPT_TEMPLATE,
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size)
        if "{problem}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{problem}}', got {prompt_template!r}")
        self.dataset = dataset
        self.data_files = data_files
        self.config_name = config_name
        self.levels = [int(level) for level in levels]
        self.train_split = train_split
        self.eval_split = eval_split
        self.prompt_template = prompt_template
        self.filter_stats: dict[str, dict[str, int]] = {}
        self._permutation_cache: tuple[tuple[int, int], list[int]] | None = None

    def prepare(self) -> None:
        """Load and filter both splits now (fails early and clearly when the data is unavailable)."""
        _ = self.train_examples, self.eval_examples

    @cached_property
    def train_examples(self) -> list[Example]:
        return self._load(self.train_split)

    def data_fingerprint(self) -> str | None:
        return examples_digest(self.train_examples, self.eval_examples)

    def data_source(self) -> str:
        return repr(self.data_files if self.data_files is not None else self.dataset)

    def build_eval_set(self) -> list[Example]:
        return self._load(self.eval_split)[: self.eval_size]

    def train_example(self, index: int, seed: int) -> Example:
        examples = self.train_examples
        epoch, position = divmod(index, len(examples))
        return examples[self._permutation(seed, epoch, len(examples))[position]]

    def _permutation(self, seed: int, epoch: int, size: int) -> list[int]:
        # Only the current epoch's order is kept: the stream walks indices in order.
        if self._permutation_cache is None or self._permutation_cache[0] != (seed, epoch):
            order = list(range(size))
            random.Random(f"math_hard:{seed}:{epoch}").shuffle(order)
            self._permutation_cache = ((seed, epoch), order)
        return self._permutation_cache[1]

    def _load(self, split: str) -> list[Example]:
        """The kept rows of `split` as examples (gold: `repr` of the course's float gold), in dataset order."""
        rows, stats = filter_rows(load_split(self.dataset, split, self.config_name, self.data_files), self.levels)
        self.filter_stats[split] = stats
        log.info("math_hard %s split '%s' (levels %s): %s", self.dataset, split, self.levels, stats)
        if not rows:
            raise ValueError(
                f"math_hard kept no rows of split '{split}' of dataset '{self.dataset}' (levels {self.levels}): "
                f"{stats}; check `levels` and the data"
            )
        return [
            Example(prompt=self.prompt_template.replace("{problem}", row["problem"]), answer=repr(row["gold"]))
            for row in rows
        ]
