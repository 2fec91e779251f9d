"""The math_hard data: load a split, and keep exactly the rows the course keeps, in dataset order.

A row is kept (the course's `MathHardTask._build_rows`) when
1. its level, the first integer in `str(row.get("level", row.get("difficulty")))`, is one of `levels`
   (an empty `levels` keeps every row that has a level);
2. it has a problem (`problem`, else `question`, else `prompt`) and a solution (`solution`, else `answer`,
   else `final_answer`), both non-empty after stripping;
3. its gold number exists and is finite: `parse_number` of the solution's last closed `\\boxed{}`, else
   `parse_number` of the whole solution.

One departure, on purpose: a problem or solution that is None is dropped (`dropped_no_problem`,
`dropped_no_solution`), where the course would turn it into the string "None" and could keep the row.
`filter_rows` counts `seen`, `kept` and `dropped_<reason>` for every reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llm_pg.data.tasks.answers import boxed_number, extract_boxed, parse_number

__all__ = ["DataFileError", "DatasetUnavailableError", "filter_rows", "gold_number", "load_split", "row_level"]

DROP_REASONS = ("level", "no_problem", "no_solution", "no_boxed", "non_numeric", "not_finite")
_LEVEL = re.compile(r"\d+")


class DatasetUnavailableError(RuntimeError):
    """The math dataset could not be loaded (hub unreachable and no cached copy, or a wrong path)."""


class DataFileError(ValueError):
    """A local data file is empty or cannot be read as the builder's format."""


def _local_files(data_files: Any) -> list[str]:
    """The paths named in `data_files` (a path, a list of paths or a split -> path(s) mapping) that exist."""
    if isinstance(data_files, Mapping):
        names = [name for value in data_files.values() for name in _local_files(value)]
    elif isinstance(data_files, str):
        names = [data_files]
    else:
        names = [name for value in data_files or () for name in _local_files(value)]
    return [name for name in names if os.path.isfile(name)]


def _unreadable_json(path: str) -> bool:
    """True when `path` is not UTF-8, or neither JSON Lines (first non-blank line) nor one JSON document."""
    with open(path, encoding="utf-8") as file:
        try:
            first = next((line for line in file if line.strip()), "")
            json.loads(first)
            return False
        except ValueError:  # UnicodeDecodeError is a ValueError too
            file.seek(0)
        try:
            json.load(file)
            return False
        except ValueError:
            return True


def load_split(
    dataset: str,
    split: str,
    config_name: str | None = None,
    data_files: Any = None,
    task: str = "math_hard",
    expected: str = "the MATH columns (problem, level, solution)",
) -> Iterable:
    """`datasets.load_dataset(dataset, config_name, data_files=..., split=split)`, with one-line errors that name
    the `task` and, for an unreadable file, what it should hold (`expected`). Shared by math_hard and DatasetTask."""
    import datasets  # imported here: arith and format_copy need no datasets import

    local = _local_files(data_files)
    for path in local:
        if os.path.getsize(path) == 0:
            raise DataFileError(f"{task} data file '{path}' is empty: give it one row per line (JSON Lines)")
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
    except (datasets.exceptions.DatasetsError, ValueError, StopIteration) as err:  # unreadable or empty files
        bad = [path for path in local if dataset == "json" and _unreadable_json(path)] or local or [dataset]
        raise DataFileError(
            f"{task} could not read {', '.join(map(repr, bad))} ({_root_cause(err)}): check that it is "
            f"{dataset!r} data with {expected}"
        ) from None


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost cause of `err` (datasets wraps the parser's own message)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def row_level(row: Mapping[str, Any]) -> int | None:
    """The first integer in `str(row.get("level", row.get("difficulty")))` (`"Level 5"` -> 5), else None."""
    match = _LEVEL.search(str(row.get("level", row.get("difficulty"))))
    try:
        return None if match is None else int(match.group())
    except ValueError:  # more digits than int() reads (Python's 4300-digit limit): not a level
        return None


def _text(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The stripped value of the first of `keys` the row has ("" when none, or when it is None)."""
    for key in keys:
        if key in row:
            return "" if row[key] is None else str(row[key]).strip()
    return ""


def gold_number(solution: str) -> float | None:
    """The solution's last boxed number, else the whole solution read as a number, else None."""
    value = boxed_number(solution)
    return parse_number(solution) if value is None else value


def _keep(row: Mapping[str, Any], levels: set[int]) -> tuple[str | None, dict[str, Any]]:
    """(None, the kept row) or (the drop reason, {})."""
    level = row_level(row)
    if level is None or (levels and level not in levels):
        return "level", {}
    problem = _text(row, ("problem", "question", "prompt"))
    if not problem:
        return "no_problem", {}
    solution = _text(row, ("solution", "answer", "final_answer"))
    if not solution:
        return "no_solution", {}
    gold = gold_number(solution)
    if gold is None:  # no_boxed: neither a closed box nor a number; non_numeric: a box that is not a number
        return ("no_boxed" if extract_boxed(solution) is None else "non_numeric"), {}
    if not math.isfinite(gold):
        return "not_finite", {}
    return None, {"problem": problem, "solution": solution, "gold": gold, "level": level}


def filter_rows(rows: Iterable[Mapping[str, Any]], levels: Sequence[int]) -> tuple[list[dict], dict[str, int]]:
    """The kept rows, in order, as `{"problem", "solution", "gold", "level"}`, and the counts `seen`, `kept`,
    `dropped_<reason>` for each reason in `DROP_REASONS` (see the module docstring)."""
    allowed = {int(level) for level in levels}
    stats = dict.fromkeys(("seen", "kept", *(f"dropped_{reason}" for reason in DROP_REASONS)), 0)
    kept = []
    for row in rows:
        stats["seen"] += 1
        reason, fields = _keep(row, allowed)
        stats["kept" if reason is None else f"dropped_{reason}"] += 1
        if reason is None:
            kept.append(fields)
    return kept, stats
