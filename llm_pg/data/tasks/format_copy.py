"""format_copy: copy an integer into `<answer>...</answer>` and nothing else (the course's sanity task).

A policy-gradient pipeline that works learns this in a few dozen steps: the reward jumps once the
model finds the tag format, then saturates near 1.3.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from llm_pg.data.tasks.answers import gold_value, is_xml_only, xml_answer, xml_number
from llm_pg.data.tasks.base import Example, Score, Task

__all__ = ["FormatCopyTask", "score"]

SYSTEM_PROMPT = (
    "You are a strict formatter.\n"
    "Return the final answer as XML using exactly one tag: <answer>...</answer>.\n"
    "Output only the XML tag and nothing else."
)
PROMPT_TEMPLATE = "Copy this integer exactly: {n}"

CORRECT_REWARD = 1.0
TAGS_REWARD = 0.2
CLEAN_REWARD = 0.1
EVAL_SEED_OFFSET = 123  # the course draws its eval targets with seed `run seed + 123`


def score(completion: str, target: str) -> Score:
    """Reward of a format_copy completion for the integer `target`, equal to the course's `FormatCopyTask.reward`.

    total = tags + clean + correct (summed in this order, as the course does, so 1.3 is the same float), with
        tags    0.2  an `<answer>` tag closes: `answers.xml_answer` is not None (case-insensitive tags,
                     after removing `<think>` blocks)
        clean   0.1  the think-stripped text is nothing but `<answer>...</answer>` (`answers.is_xml_only`)
        correct 1.0  the tag's number (`answers.xml_number`: the whole content, else its last number token)
                     is within 1e-6 of the target, so `42.0` and `The answer is 42` count
    Maximum 1.3. Linear time; never raises.
    """
    value, gold = xml_number(completion), gold_value(target)
    correct = value is not None and gold is not None and abs(value - gold) < 1e-6
    tags = xml_answer(completion) is not None
    clean = is_xml_only(completion)
    total = 0.0
    for earned, weight in ((tags, TAGS_REWARD), (clean, CLEAN_REWARD), (correct, CORRECT_REWARD)):
        total += weight if earned else 0.0
    components = {"correct": CORRECT_REWARD * correct, "tags": TAGS_REWARD * tags, "clean": CLEAN_REWARD * clean}
    return Score(total=total, correct=correct, components=components)


class FormatCopyTask(Task):
    """Copy an integer drawn uniformly from `[low, high]`.

    Train example `i` of seed `s` draws its integer from `random.Random(f"format_copy:{s}:{i}")`, a pure
    function of `(s, i)`. The eval set is the course's: `eval_size` (64) draws `randint(low, high)` from
    `random.Random(eval_seed)`, where `eval_seed=None` (the default) means the run's seed + 123 (the datamodule
    binds the run's seed with `bind_seed`; 0 until then).
    In `prompt_template` the literal `{n}` is replaced by the integer. The course setting is the default;
    the tiny CPU setting is `FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")`.

    Args:
        low: smallest integer to copy (inclusive; the course: -5000).
        high: largest integer to copy (inclusive; the course: 5000).
        system_prompt: the system turn (the course's format instructions; null: none).
        prompt_template: the user turn, with `{n}` replaced by the integer.
        eval_size: eval targets (the course: 64).
        eval_seed: seed of the eval targets (null: the run's seed + 123, as the course).
    """

    name = "format_copy"
    components = ("correct", "tags", "clean")

    def __init__(
        self,
        low: int = -5000,
        high: int = 5000,
        system_prompt: str | None = SYSTEM_PROMPT,
        prompt_template: str = PROMPT_TEMPLATE,
        eval_size: int = 64,
        eval_seed: int | None = None,
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size, eval_seed=eval_seed)
        if low > high:
            raise ValueError(f"low must be <= high, got low={low}, high={high}")
        if "{n}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{n}}', got {prompt_template!r}")
        self.low = low
        self.high = high
        self.prompt_template = prompt_template

    def _example(self, n: int) -> Example:
        return Example(prompt=self.prompt_template.replace("{n}", str(n)), answer=str(n))

    def train_example(self, index: int, seed: int) -> Example:
        return self._example(random.Random(f"format_copy:{seed}:{index}").randint(self.low, self.high))

    def build_eval_set(self) -> list[Example]:
        seed = self.run_seed + EVAL_SEED_OFFSET if self.eval_seed is None else self.eval_seed
        rng = random.Random(seed)
        return [self._example(rng.randint(self.low, self.high)) for _ in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        return score(completion, example.answer)

    def eval_metrics(
        self, completions: Sequence[str], examples: Sequence[Example], scores: Sequence[Score] | None = None
    ) -> dict[str, float]:
        """`exact_match`, mean `reward`, `has_tag` (share earning the tags term: an `<answer>` tag closes)
        and `tag_only` (share earning the clean term: nothing but the tagged answer), as the course's eval."""
        scores = self.scores_of(completions, examples, scores)
        n = max(len(scores), 1)
        return {
            "exact_match": sum(s.correct for s in scores) / n,
            "reward": sum(s.total for s in scores) / n,
            "has_tag": sum(s.components["tags"] > 0 for s in scores) / n,
            "tag_only": sum(s.components["clean"] > 0 for s in scores) / n,
        }
