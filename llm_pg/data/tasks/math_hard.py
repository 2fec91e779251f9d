"""math_hard: level-5 MATH problems whose gold `\\boxed{}` answer is a number (the course's hw4 task).

The data is `the-jb/hendrycks-math` (MATH schema: `problem`, `level`, `type`, `solution`) by default;
any hub id, local directory, or builder plus `data_files` (`dataset="json", data_files={"train": ...,
"test": ...}`) works. Rows are kept when their level matches and the last boxed answer of the solution
parses as a number (see `answers.py`); the counts of rows seen, kept and dropped by reason are logged
and kept in `MathHardTask.filter_stats`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

from llm_pg.data.tasks.answers import extract_boxed, last_number, parse_number
from llm_pg.data.tasks.base import Example, Score, Task

__all__ = ["BoxedAnswerTask", "DatasetUnavailableError", "MathHardTask", "extract_boxed", "filter_rows", "score"]

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
NUMERIC_REWARD = 0.1
RELAXED_REWARD = 0.1


def score(completion: str, answer: str) -> Score:
    """Reward of a boxed-number completion against the gold number `answer`.

    total = correct + boxed + numeric + relaxed, with
        correct 1.0  the last balanced `\\boxed{...}` parses to exactly the gold number
        boxed   0.1  a balanced `\\boxed{...}` is present
        numeric 0.1  its content parses as a number
        relaxed 0.1  the boxed answer is missing or not a number, yet the last number in the text equals the
                     gold (the course's fallback bonus, so "... the answer is 12" still earns a little)
    The maximum is 1.2 and a wrong boxed answer earns at most 0.2 (boxed + numeric, or boxed + relaxed),
    so the total is below 1.0 whenever the boxed answer is wrong. Never raises, never evaluates the text.
    """
    boxed = extract_boxed(completion)
    boxed_value = None if boxed is None else parse_number(boxed)
    gold = parse_number(answer)
    correct = boxed_value is not None and boxed_value == gold
    relaxed = boxed_value is None and gold is not None and last_number(completion) == gold
    components = {
        "correct": CORRECT_REWARD * correct,
        "boxed": BOXED_REWARD * (boxed is not None),
        "numeric": NUMERIC_REWARD * (boxed_value is not None),
        "relaxed": RELAXED_REWARD * relaxed,
    }
    return Score(total=math.fsum(components.values()), correct=correct, components=components)


class BoxedAnswerTask(Task):
    """A task answered with `\\boxed{NUMBER}` and scored by `score` above (math_hard and arith)."""

    components = ("correct", "boxed", "numeric", "relaxed")

    def score(self, completion: str, example: Example) -> Score:
        return score(completion, example.answer)

    def eval_metrics(self, completions: Sequence[str], examples: Sequence[Example]) -> dict[str, float]:
        """`exact_match` (boxed parser), `exact_match_relaxed` (boxed, or else the last number anywhere),
        `has_boxed` (a balanced boxed answer is present) and the mean `reward`."""
        n = max(len(completions), 1)
        totals = {"exact_match": 0.0, "exact_match_relaxed": 0.0, "has_boxed": 0.0, "reward": 0.0}
        for completion, example in zip(completions, examples, strict=True):
            result = self.score(completion, example)
            relaxed = result.correct or last_number(completion) == parse_number(example.answer)
            totals["exact_match"] += result.correct
            totals["exact_match_relaxed"] += relaxed
            totals["has_boxed"] += result.components["boxed"] > 0
            totals["reward"] += result.total
        return {key: value / n for key, value in totals.items()}


class DatasetUnavailableError(RuntimeError):
    """The math dataset could not be loaded (hub unreachable and no cached copy, or a wrong path)."""


def load_split(dataset: str, split: str, config_name: str | None = None, data_files: Any = None) -> Iterable:
    """`datasets.load_dataset(dataset, config_name, data_files=..., split=split)`, with one clear error."""
    import datasets  # imported here: arith and format_copy need no datasets import

    try:
        return datasets.load_dataset(dataset, config_name, data_files=data_files, split=split)
    except OSError as err:  # ConnectionError (offline, unreachable hub) and FileNotFoundError are OSErrors
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DatasetUnavailableError(
            f"Could not load split '{split}' of dataset '{dataset}': {reason}\n"
            "Two ways out: (1) use a cached copy: load it once with network access (it is cached under "
            "HF_HOME), then run with HF_DATASETS_OFFLINE=1; or (2) point the task at local files: "
            "dataset='json' (or 'parquet') with data_files={'train': ..., 'test': ...}, or dataset=<a local "
            "directory>."
        ) from None


def _drop_reason(row: Mapping[str, Any], level: str | None) -> str | None:
    """Why a MATH-schema row is not used (`level`, `no_boxed`, `non_numeric`), or None to keep it."""
    if level is not None and str(row.get("level", "")).strip() != level:
        return "level"
    answer = extract_boxed(str(row.get("solution") or ""))
    if answer is None:
        return "no_boxed"
    return "non_numeric" if parse_number(answer) is None else None


def filter_rows(
    rows: Iterable[Mapping[str, Any]], level: str | None, prompt_template: str
) -> tuple[list[Example], dict[str, int]]:
    """Examples from MATH-schema rows whose level matches (`None` keeps all) and whose gold answer, the
    last boxed answer of `solution`, parses as a number. Returns the examples and the counts
    `seen`, `kept`, `dropped_level`, `dropped_no_boxed`, `dropped_non_numeric`."""
    stats = dict.fromkeys(("seen", "kept", "dropped_level", "dropped_no_boxed", "dropped_non_numeric"), 0)
    examples = []
    for row in rows:
        stats["seen"] += 1
        reason = _drop_reason(row, level)
        if reason is not None:
            stats[f"dropped_{reason}"] += 1
            continue
        stats["kept"] += 1
        prompt = prompt_template.replace("{problem}", str(row.get("problem", "")))
        examples.append(Example(prompt=prompt, answer=extract_boxed(str(row["solution"])) or ""))
    return examples, stats


class MathHardTask(BoxedAnswerTask):
    """Level-5 MATH with numeric answers: train from `train_split`, eval on the first `eval_size` kept
    rows of `eval_split` in dataset order.

    The data loads on first use (`prepare()`, `train_example` or `eval_examples`), not in `__init__`, so a
    config can be built without it. `train_example(i, seed)` walks the kept train rows in a fresh seeded
    permutation per epoch: row `perm(seed, i // N)[i % N]`, N the number of kept rows. In
    `prompt_template` the literal `{problem}` is replaced by the problem; other braces stay as written.
    """

    name = "math_hard"

    def __init__(
        self,
        dataset: str = "the-jb/hendrycks-math",
        data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        config_name: str | None = None,
        level: str | None = "Level 5",
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
        self.level = level
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
        examples = self._load(self.train_split)
        if not examples:
            raise ValueError(f"math_hard kept no rows of split '{self.train_split}': {self.filter_stats}")
        return examples

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
        rows = load_split(self.dataset, split, self.config_name, self.data_files)
        examples, stats = filter_rows(rows, self.level, self.prompt_template)
        self.filter_stats[split] = stats
        log.info("math_hard %s split '%s' (level %s): %s", self.dataset, split, self.level, stats)
        return examples
