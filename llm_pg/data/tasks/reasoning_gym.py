"""ReasoningGymTask: any procedural dataset of `reasoning-gym` as a task, by name (`dataset: basic_arithmetic`).

Needs the optional extra: `pip install -e ".[reasoning]"` (the dev extra, which `make test` installs, has it too).
Everything is generated on this machine: no network.

- Items: `reasoning_gym.create_dataset(dataset, seed=..., size=..., **dataset_config)`, whose item `i` is a pure
  function of the dataset seed and `i` (most of its datasets draw it from `Random(seed + i)`). The run's seed `s`
  gives a base `b = random.Random(f"reasoning_gym:{s}").randrange(2**30)`: train example `i` is item `i % train_size`
  of the dataset seeded `b`; the eval set is items `0..eval_size-1` of the dataset seeded `eval_seed`, else
  `b + train_size`, so under that convention no eval item shares a generator seed with a train item.
- Answer: the stripped content of the last `<answer>...</answer>` (case-sensitive), as reasoning-gym's
  `utils.extract_answer` reads it, found in one left-to-right pass (the library's regex rescans from every
  unclosed tag to the end: quadratic on hostile text).
- Reward: the dataset's own `score_answer(answer, entry)` in [0, 1], component `score`; correct when it is 1.0
  (within 1e-9). No answer tag, or an answer over `max_answer_chars`, scores 0 without calling the scorer (some
  reasoning-gym scorers parse answers with sympy); a scorer that raises on an answer scores it 0 (logged once).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.data.tasks.math_hard import PROMPT_TEMPLATE, SYSTEM_PROMPT, BoxedAnswerTask, gold_value

__all__ = ["BoxedReasoningGymTask", "ReasoningGymTask", "last_answer_tag"]

log = logging.getLogger(__name__)

_OPEN, _CLOSE = "<answer>", "</answer>"


def last_answer_tag(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` of `text`, else None: what
    `reasoning_gym.utils.extract_answer(text)` returns, in linear time.

    The library's regex pairs each leftmost `<answer>` with the first `</answer>` after it and resumes after
    that; once an opener has no closer after it, no later one has either, so the scan stops there.
    """
    found, position = None, 0
    while (opener := text.find(_OPEN, position)) >= 0 and (closer := text.find(_CLOSE, opener + len(_OPEN))) >= 0:
        found, position = text[opener + len(_OPEN) : closer], closer + len(_CLOSE)
    return None if found is None else found.strip()


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "ReasoningGymTask needs reasoning-gym: pip install -e '.[reasoning]' (pinned in requirements.lock)"
        ) from None
    return reasoning_gym


class ReasoningGymTask(Task):
    """The reasoning-gym dataset `dataset` with its keyword settings `dataset_config` (see the module docstring).

    `system_prompt` is one of reasoning-gym's prompt names (`default`, `simple`, `direct`, `DeepSeekZero`,
    `chain_of_draft`: they ask for `<answer>` tags), your own text, or null. In `prompt_template` the literal
    `{question}` is replaced by the item's question. `Example.fields` holds the item's `question` and `metadata`.

    Args:
        dataset: a reasoning-gym dataset name, e.g. basic_arithmetic, chain_sum, leg_counting.
        dataset_config: the dataset's own settings (its config dataclass's fields), e.g. {max_terms: 2}.
        system_prompt: a reasoning-gym prompt name (default, simple, direct, DeepSeekZero, chain_of_draft),
            your own text, or null.
        prompt_template: the user turn; the literal {question} is replaced by the item's question.
        eval_size: eval items.
        eval_seed: the eval set's dataset seed; null: derived from the run's seed.
        train_size: distinct training items before the stream repeats.
        max_answer_chars: longer answers score 0 without calling the dataset's scorer.
    """

    name = "reasoning_gym"
    components = ("score",)

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        dataset_config: Mapping[str, Any] | None = None,
        system_prompt: str | None = "default",
        prompt_template: str = "{question}",
        eval_size: int = 64,
        eval_seed: int | None = None,
        train_size: int = 100_000,
        max_answer_chars: int = 10_000,
    ) -> None:
        library = _library()
        prompts = library.utils.SYSTEM_PROMPTS
        super().__init__(
            system_prompt=prompts.get(system_prompt, system_prompt), eval_size=eval_size, eval_seed=eval_seed
        )
        if dataset not in library.factory.DATASETS:
            names = sorted(library.factory.DATASETS)
            raise ValueError(
                f"reasoning-gym has no dataset '{dataset}' ({len(names)} are: {', '.join(names[:8])}, ...)"
            )
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
        if train_size < 1:
            raise ValueError(f"train_size must be >= 1, got {train_size}")
        self.dataset, self.dataset_config = dataset, dict(dataset_config or {})
        self.prompt_template, self.train_size, self.max_answer_chars = prompt_template, train_size, max_answer_chars
        self._create(0, 1)  # a wrong dataset_config fails here, while the config is parsed
        self._train: tuple[int, Any] | None = None  # (run seed, its training dataset)
        self._warned = False

    def _create(self, seed: int, size: int) -> Any:
        try:
            return _library().create_dataset(self.dataset, seed=seed, size=size, **self.dataset_config)
        except (TypeError, AssertionError, ValueError) as err:
            raise ValueError(
                f"reasoning-gym '{self.dataset}' refused dataset_config {self.dataset_config}: {err}"
            ) from None

    def _base_seed(self, seed: int) -> int:
        return random.Random(f"reasoning_gym:{seed}").randrange(2**30)

    def _train_dataset(self, seed: int) -> Any:
        """The training dataset of run seed `seed` (kept for the last seed asked)."""
        if self._train is None or self._train[0] != seed:
            self._train = (seed, self._create(self._base_seed(seed), self.train_size))
        return self._train[1]

    def _example(self, entry: Mapping[str, Any]) -> Example:
        fields = {key: value for key, value in entry.items() if key != "answer"}
        prompt = self.prompt_template.replace("{question}", str(entry["question"]))
        return Example(prompt=prompt, answer=str(entry["answer"]), fields=fields)

    def train_example(self, index: int, seed: int) -> Example:
        return self._example(self._train_dataset(seed)[index % self.train_size])

    def build_eval_set(self) -> list[Example]:
        seed = self._base_seed(self.run_seed) + self.train_size if self.eval_seed is None else self.eval_seed
        dataset = self._create(seed, self.eval_size)
        return [self._example(dataset[i]) for i in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        """The dataset's `score_answer` of the last answer tag's content, in [0, 1]."""
        answer = last_answer_tag(completion)
        value = 0.0
        if answer is not None and len(answer) <= self.max_answer_chars:
            entry = {**example.fields, "answer": example.answer}
            try:
                value = float(self._train_dataset(self.run_seed).score_answer(answer, entry))
            except Exception as err:  # the library's scorer could not read this answer: a wrong answer
                if not self._warned:
                    log.warning("reasoning-gym '%s' scorer raised %r on an answer; scored 0", self.dataset, err)
                    self._warned = True
        return Score(total=value, correct=value >= 1.0 - 1e-9, components={"score": value})


class BoxedReasoningGymTask(BoxedAnswerTask, ReasoningGymTask):
    """A reasoning-gym dataset with numeric answers, asked and scored as math_hard: the course's system prompt and
    user turn around the item's question, the reward of `math_hard.score` (boxed 0.1 + relaxed 0.1 + correct 1.0
    on the last `\\boxed{}`) and math_hard's eval metrics (`exact_match`, `exact_match_relaxed`, `has_boxed`). The
    items, seeds and eval set are `ReasoningGymTask`'s; the dataset's own scorer is not used. A dataset whose
    answers are not numbers (math_hard's parser reads none) is refused when the config is parsed.

    Args:
        dataset: a reasoning-gym dataset with numeric answers, e.g. basic_arithmetic, chain_sum, gsm_symbolic.
        dataset_config: the dataset's own settings (its config dataclass's fields), e.g. {max_terms: 2}.
        system_prompt: the system turn (default: math_hard's), or null.
        prompt_template: the user turn (default: math_hard's); the literal {question} is replaced by the question.
        eval_size: eval items.
        eval_seed: the eval set's dataset seed; null: derived from the run's seed.
        train_size: distinct training items before the stream repeats.
    """

    name = "reasoning_gym_boxed"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        dataset_config: Mapping[str, Any] | None = None,
        system_prompt: str | None = SYSTEM_PROMPT,
        prompt_template: str = PROMPT_TEMPLATE.replace("{problem}", "{question}"),
        eval_size: int = 64,
        eval_seed: int | None = None,
        train_size: int = 100_000,
    ) -> None:
        super().__init__(dataset, dataset_config, system_prompt, prompt_template, eval_size, eval_seed, train_size)
        answers = [str(item["answer"]) for item in self._create(0, 8)]
        if any(gold_value(answer) is None for answer in answers):
            raise ValueError(
                f"data.task.dataset: reasoning-gym '{dataset}' has answers that are not numbers ({answers[:3]}); "
                "BoxedReasoningGymTask scores numbers: use ReasoningGymTask for it"
            )
