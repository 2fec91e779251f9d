"""DatasetTask: a task from any dataset, no code: local JSONL / JSON / Parquet / CSV files or a hub dataset.

The rows load with math_hard's loader (`math_data.load_split`: `datasets.load_dataset`, one-line errors), so a
config that runs offline on files here runs on Modal against the hub. Each row becomes an `Example`:

    prompt = row[prompt_column]   or   prompt_template.format_map(row)   ("Solve: {question}")
    answer = str(row[answer_column]).strip()
    fields = every other column of the row (all but the prompt and answer columns), for reward functions

and its reward is the weighted sum of the `rewards` entries (`rewards.py`: built-in names or "module:function"):

    total = sum_i w_i * total_i,   components[name_i] = w_i * total_i,   correct = the first entry's correct

so `train/reward_<name_i>` is each entry's weighted part and eval exact match is the first entry's `correct`.
With `eval_split: null` the eval set is a held-out slice of train: `eval_size` rows drawn with
`random.Random(f"dataset-eval:{s}")`, `s` = `eval_seed`, else the run's seed (`bind_seed`), and left out of
training. Otherwise it is the first `eval_size` rows of `eval_split`, in file order.
"""

from __future__ import annotations

import glob
import os
import random
import string
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from llm_pg.data.tasks.base import Example, Score, Task, examples_digest
from llm_pg.data.tasks.math_data import load_split
from llm_pg.data.tasks.rewards import resolve_rewards
from llm_pg.data.user_code import find_file, lookup_dirs

__all__ = ["DatasetTask"]

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # `dataset` values that read `data_files` from disk


def template_columns(template: str) -> list[str]:
    """The columns `{column}` placeholders name in `template` (`{q}` and `{q!r:>5}` name `q`), in order.

    A ValueError when the template is not a format string or has a positional `{}` / `{0}`."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(
            f"prompt_template {template!r} is not a format string ({err}): write literal braces as {{{{ and }}}}"
        ) from None
    columns = [name.split(".")[0].split("[")[0] for name in fields]
    if not all(column and not column.isdigit() for column in columns):
        raise ValueError(f"prompt_template {template!r} has a '{{}}' without a column name: write e.g. {{question}}")
    return list(dict.fromkeys(columns))


class DatasetTask(Task):
    """A task over the rows of a dataset, scored by the `rewards` entries (see the module docstring).

    `dataset` is a hub id, a local directory, or a builder (`json`, `csv`, `parquet`) reading `data_files`: a
    path, a list, or a split -> path(s) mapping; a relative path is looked up beside the config file, then in
    the working directory (`llm_pg.data.user_code.find_file`). Give `prompt_column` or `prompt_template`
    (neither: the column `prompt`). Data loads in `prepare()` (or on first use), not in `__init__`; missing
    files and columns, unreadable files and empty splits are one-line ValueErrors naming the file or column.
    The training stream walks the train rows in a fresh seeded permutation per epoch, as math_hard does.

    Args:
        dataset: a hub id, a local directory, or a builder reading data_files: json, csv, parquet.
        data_files: a path, a list of paths, or a mapping split -> path(s); relative paths beside the config.
        config_name: the hub dataset's configuration (subset), if it has several.
        train_split: the split to train on.
        eval_split: the split to evaluate on (its first eval_size rows); null: a seeded held-out slice of train.
        prompt_column: the column holding the user turn (default `prompt` when no prompt_template).
        prompt_template: the user turn with {column} placeholders, e.g. "Solve: {question}"; braces as {{ }}.
        answer_column: the column holding the gold answer (read as a stripped string).
        system_prompt: a system turn before every prompt, or null.
        eval_size: eval rows (held out of training when eval_split is null).
        eval_seed: the held-out slice's seed; null: the run's seed.
        rewards: built-in names (boxed_number, answer_tag, exact, boxed_exact) or "module:function" entries.
        reward_weights: one weight per reward (default 1.0 each); total = sum of weight x reward.
    """

    name = "dataset"

    def __init__(
        self,
        dataset: str = "json",
        data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        config_name: str | None = None,
        train_split: str = "train",
        eval_split: str | None = None,
        prompt_column: str | None = None,
        prompt_template: str | None = None,
        answer_column: str = "answer",
        system_prompt: str | None = None,
        eval_size: int = 64,
        eval_seed: int | None = None,
        rewards: Sequence[str] = ("exact",),
        reward_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size, eval_seed=eval_seed)
        if prompt_column is not None and prompt_template is not None:
            raise ValueError("give prompt_column or prompt_template, not both")
        self.prompt_column = "prompt" if prompt_column is None and prompt_template is None else prompt_column
        self.prompt_template = prompt_template
        self.template_columns = [] if prompt_template is None else template_columns(prompt_template)
        self.dataset, self.data_files, self.config_name = dataset, data_files, config_name
        self.train_split, self.eval_split, self.answer_column = train_split, eval_split, answer_column
        self.rewards = resolve_rewards(rewards)
        weights = [1.0] * len(self.rewards) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(self.rewards):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(self.rewards)} rewards {rewards}")
        self.reward_weights = weights
        self.components = tuple(reward.name for reward in self.rewards)
        self._order: tuple[tuple[int, int], list[int]] | None = None  # the current epoch's permutation
        self._split: tuple[int, tuple[list[Example], list[Example]]] | None = None  # (slice seed, (train, eval))

    # ---- data -------------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Load and check the splits now (cached: a second call costs nothing)."""
        _ = self.train_examples, self.eval_examples

    def _files(self, value: Any) -> Any:
        """`data_files` with each relative local path found beside the config or in the working directory."""
        if isinstance(value, Mapping):
            return {split: self._files(paths) for split, paths in value.items()}
        if isinstance(value, str):
            if any(c in value for c in "*?["):  # a pattern: the first directory where it matches a file
                found = next((os.path.join(d, value) for d in lookup_dirs() if glob.glob(os.path.join(d, value))), None)
            else:
                found = find_file(value)
            if found is None and self.dataset in LOCAL_BUILDERS:
                raise ValueError(f"DatasetTask data file '{value}' not found (looked in {', '.join(lookup_dirs())})")
            return value if found is None else found
        return None if value is None else [self._files(path) for path in value]

    def _source(self, split: str) -> str:
        """What a message names for `split`: its data file(s), else the dataset."""
        files = self.data_files
        if isinstance(files, Mapping):
            files = files.get(split, files)
        return repr(files if files is not None else self.dataset)

    @cached_property
    def _rows(self) -> dict[str, list[Example]]:
        """Every split this task reads, as examples in file order (loaded once)."""
        if self.data_files is None and self.dataset in LOCAL_BUILDERS:
            raise ValueError(
                f"DatasetTask: dataset '{self.dataset}' reads data_files: give e.g. data_files: rows.jsonl"
            )
        files = self._files(self.data_files)
        splits = [self.train_split] + ([self.eval_split] if self.eval_split not in (None, self.train_split) else [])
        if isinstance(files, Mapping):
            for split in splits:
                if split not in files:
                    raise ValueError(f"DatasetTask split '{split}' is not a key of data_files ({', '.join(files)})")
        return {split: self._examples(split, files) for split in splits}

    def _examples(self, split: str, files: Any) -> list[Example]:
        needed = [self.answer_column, *([self.prompt_column] if self.prompt_column else self.template_columns)]
        expected = "the columns " + ", ".join(dict.fromkeys(needed))
        data = load_split(self.dataset, split, self.config_name, files, task="DatasetTask", expected=expected)
        for column in dict.fromkeys(needed):
            if column not in data.column_names:
                role = "prompt_template" if column in self.template_columns else self._role(column)
                raise ValueError(
                    f"DatasetTask: {role} names column '{column}', which split '{split}' of {self._source(split)} "
                    f"does not have (columns: {', '.join(data.column_names)})"
                )
        try:
            examples = [self._example(row, i, split) for i, row in enumerate(data)]
        except UnicodeDecodeError as err:  # pyarrow reads the bytes and fails only when a row is decoded
            raise ValueError(f"DatasetTask could not read {self._source(split)}: not UTF-8 text ({err})") from None
        if not examples:
            raise ValueError(f"DatasetTask: split '{split}' of {self._source(split)} has no rows")
        return examples

    def _role(self, column: str) -> str:
        return "answer_column" if column == self.answer_column else "prompt_column"

    def _example(self, row: Mapping[str, Any], index: int, split: str) -> Example:
        where = f"row {index} of split '{split}' of {self._source(split)}"
        for column in (self.answer_column, self.prompt_column):
            if column is not None and row[column] is None:
                raise ValueError(f"DatasetTask: {where} has no {self._role(column)} value (column '{column}' is null)")
        if self.prompt_template is None:
            prompt = str(row[self.prompt_column])
        else:
            try:
                prompt = self.prompt_template.format_map(row)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"DatasetTask: prompt_template cannot format {where}: {err!r}") from None
        kept = {key: value for key, value in row.items() if key not in (self.answer_column, self.prompt_column)}
        return Example(prompt=prompt, answer=str(row[self.answer_column]).strip(), fields=kept)

    def _held_out(self) -> tuple[list[Example], list[Example]]:
        """(train, eval), computed once per slice seed."""
        seed = self.run_seed if self.eval_seed is None else self.eval_seed
        if self._split is None or self._split[0] != seed:
            self._split = (seed, self._slice(seed))
        return self._split[1]

    def _slice(self, seed: int) -> tuple[list[Example], list[Example]]:
        """(train, eval): the seeded held-out slice of the train split when there is no eval split."""
        rows = self._rows[self.train_split]
        if self.eval_split is not None:
            return rows, self._rows[self.eval_split][: self.eval_size]
        if self.eval_size >= len(rows):
            raise ValueError(
                f"DatasetTask: eval_size {self.eval_size} leaves no training rows of the {len(rows)} in split "
                f"'{self.train_split}' of {self._source(self.train_split)}: lower eval_size or set eval_split"
            )
        order = list(range(len(rows)))
        random.Random(f"dataset-eval:{seed}").shuffle(order)
        held = set(order[: self.eval_size])
        return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

    def data_fingerprint(self) -> str | None:
        return examples_digest(self.train_examples, self.eval_examples)

    def data_source(self) -> str:
        return repr(self.data_files if self.data_files is not None else self.dataset)

    @property
    def train_examples(self) -> list[Example]:
        """The training rows: the train split, without the held-out slice when there is no eval split."""
        return self._held_out()[0]

    def build_eval_set(self) -> list[Example]:
        return self._held_out()[1]

    def bind_seed(self, seed: int) -> None:
        super().bind_seed(seed)
        self._order = None

    def train_example(self, index: int, seed: int) -> Example:
        examples = self.train_examples
        epoch, position = divmod(index, len(examples))
        if self._order is None or self._order[0] != (seed, epoch):
            order = list(range(len(examples)))
            random.Random(f"dataset:{seed}:{epoch}").shuffle(order)
            self._order = ((seed, epoch), order)
        return examples[self._order[1][position]]

    # ---- reward -----------------------------------------------------------------------------------------------

    def score(self, completion: str, example: Example) -> Score:
        """`total = sum_i w_i * total_i` over the rewards; components are the weighted parts; `correct` is the
        first reward's. A user function that raises or returns NaN raises RewardError (the rollout stops the run)."""
        total, components, correct = 0.0, {}, False
        for i, (reward, weight) in enumerate(zip(self.rewards, self.reward_weights, strict=True)):
            result = reward(completion, example)
            components[reward.name] = weight * result.total
            total += weight * result.total
            correct = result.correct if i == 0 else correct
        return Score(total=total, correct=bool(correct), components=components)

    def eval_metrics(
        self, completions: Sequence[str], examples: Sequence[Example], scores: Sequence[Score] | None = None
    ) -> dict[str, float]:
        """`exact_match` (the first reward's correct), the mean `reward` and each entry's mean `reward_<name>`."""
        scores = self.scores_of(completions, examples, scores)
        n = max(len(scores), 1)
        metrics = {"exact_match": sum(s.correct for s in scores) / n, "reward": sum(s.total for s in scores) / n}
        for name in self.components:
            metrics[f"reward_{name}"] = sum(s.components[name] for s in scores) / n
        return metrics
