"""format_copy: copy an integer into `<answer>...</answer>` and nothing else (the course's sanity task).

A policy-gradient pipeline that works learns this in a few dozen steps: the reward jumps once the
model finds the tag format, then saturates near 1.3.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

from llm_pg.data.tasks.base import Example, Score, Task

__all__ = ["FormatCopyTask", "score"]

SYSTEM_PROMPT = (
    "You are a strict formatter.\n"
    "Return the final answer as XML using exactly one tag: <answer>...</answer>.\n"
    "Output only the XML tag and nothing else."
)
PROMPT_TEMPLATE = "Copy this integer exactly: {n}"

OPEN, CLOSE = "<answer>", "</answer>"
CORRECT_REWARD = 1.0
TAGS_REWARD = 0.2
CLEAN_REWARD = 0.1
_INTEGER = re.compile(r"[+-]?\d{1,30}")


def _as_int(text: str | None) -> int | None:
    """The integer `text` spells (optional sign, at most 30 digits), else None."""
    return int(text) if text is not None and _INTEGER.fullmatch(text.strip()) else None


def tagged_answer(completion: str) -> str | None:
    """The stripped text between the first `<answer>` and the first `</answer>` after it, else None."""
    start = completion.find(OPEN)
    end = completion.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
    return None if end < 0 else completion[start + len(OPEN) : end].strip()


def score(completion: str, target: str) -> Score:
    """Reward of a format_copy completion for the integer `target`.

    total = correct + tags + clean, with
        correct 1.0  the tagged answer (first `<answer>`...`</answer>`, stripped) is an integer equal to target
        tags    0.2  exactly one `<answer>` and exactly one `</answer>`, in that order
        clean   0.1  tags holds and the whitespace-stripped completion starts with `<answer>` and ends with
                     `</answer>`: nothing but the tagged answer
    Maximum 1.3. Tags are case-sensitive. Linear time; never raises.
    """
    answer = tagged_answer(completion)
    value = _as_int(answer)
    correct = value is not None and value == _as_int(target)
    one_pair = completion.count(OPEN) == 1 and completion.count(CLOSE) == 1
    tags = one_pair and completion.find(OPEN) < completion.find(CLOSE)
    stripped = completion.strip()
    clean = tags and stripped.startswith(OPEN) and stripped.endswith(CLOSE)
    components = {"correct": CORRECT_REWARD * correct, "tags": TAGS_REWARD * tags, "clean": CLEAN_REWARD * clean}
    return Score(total=math.fsum(components.values()), correct=correct, components=components)


class FormatCopyTask(Task):
    """Copy an integer drawn uniformly from `[low, high]`.

    Train example `i` of seed `s` draws its integer from `random.Random(f"format_copy:{s}:{i}")`, a pure
    function of `(s, i)`; the eval set is `eval_size` draws from `random.Random(f"format_copy-eval:{eval_seed}")`.
    In `prompt_template` the literal `{n}` is replaced by the integer. The course setting is the default;
    the tiny CPU setting is `FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")`.
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
        eval_seed: int = 123,
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
        rng = random.Random(f"format_copy-eval:{self.eval_seed}")
        return [self._example(rng.randint(self.low, self.high)) for _ in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        return score(completion, example.answer)

    def eval_metrics(self, completions: Sequence[str], examples: Sequence[Example]) -> dict[str, float]:
        """`exact_match`, mean `reward`, `has_tag` (share earning the tags term: one `<answer>...</answer>`
        pair) and `tag_only` (share earning the clean term: nothing but the tagged answer)."""
        scores = [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
        n = max(len(scores), 1)
        return {
            "exact_match": sum(s.correct for s in scores) / n,
            "reward": sum(s.total for s in scores) / n,
            "has_tag": sum(s.components["tags"] > 0 for s in scores) / n,
            "tag_only": sum(s.components["clean"] > 0 for s in scores) / n,
        }
