"""Rewards by name or by import path, for `DatasetTask`'s `rewards: [...]`.

An entry is a built-in checker or `"pkg.module:function"`. Every reward is `fn(completion: str, example: Example)
-> float | Score`; `Reward` wraps one and always returns a `Score`. The built-ins reuse the tasks' parsers
(`answers.py`, format_copy, math_hard), so they are linear-time, never raise and never evaluate the text:

    boxed_number  math_hard's reward (the course's): `\\boxed{` 0.1 + last boxed number equals the gold 1.0
                  + 0.1 when no box parses but the last number is right; max 1.1, correct = the boxed number
    answer_tag    format_copy's reward (the course's) for any gold number: a closed `<answer>` tag 0.2 + nothing
                  but the tag 0.1 + the tag's number equals the gold 1.0; max 1.3, correct = the number
    exact         1.0 when the stripped content of the first `<answer>...</answer>` (`answers.xml_answer`), or
                  the whole stripped completion when no tag closes, equals the stripped gold string; else 0.0
    boxed_exact   1.0 when the content of the last closed `\\boxed{}` (`answers.extract_boxed`) equals the gold
                  with all whitespace deleted from both (a gold that holds a `\\boxed{}` is read the same way)

A user function's float counts as correct when it is at least 1.0 (the top of a 0-1 reward), within 1e-9; a
function whose maximum is elsewhere returns a `Score` with its own `correct`. A function that raises, or returns
a non-finite value or something that is neither a number nor a `Score`, raises `RewardError` naming the function
and the value (an exception's type, message and line); the rollout stops the run with it in one line, adding the
row (`llm_pg.runs.guards`). Nothing is swallowed: the original exception is the `RewardError`'s `__cause__`.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_pg.data.tasks import format_copy, math_hard
from llm_pg.data.tasks.answers import extract_boxed, xml_answer
from llm_pg.data.tasks.base import Example, RewardError, Score

__all__ = ["BUILTIN_REWARDS", "Reward", "answer_tag", "boxed_exact", "boxed_number", "exact", "resolve_rewards"]

CORRECT_AT = 1.0  # a float reward counts as correct from here up
_TOLERANCE = 1e-9  # so 0.1 + 0.2 + 0.7 (0.9999999999999999) counts as 1.0


def boxed_number(completion: str, example: Example) -> Score:
    """math_hard's reward against the gold number `example.answer` (max 1.1)."""
    return math_hard.score(completion, example.answer)


def answer_tag(completion: str, example: Example) -> Score:
    """format_copy's reward against the gold number `example.answer` (max 1.3)."""
    return format_copy.score(completion, example.answer)


def exact(completion: str, example: Example) -> Score:
    """1.0 when the answer tag's stripped content (else the whole stripped completion) is the stripped gold."""
    content = xml_answer(completion)
    correct = (completion.strip() if content is None else content) == example.answer.strip()
    return Score(total=float(correct), correct=correct)


def _squeeze(text: str) -> str:
    return "".join(text.split())


def boxed_exact(completion: str, example: Example) -> Score:
    """1.0 when the last closed `\\boxed{}` holds the gold string, all whitespace deleted from both."""
    content = extract_boxed(completion)
    gold = extract_boxed(example.answer)
    correct = content is not None and _squeeze(content) == _squeeze(example.answer if gold is None else gold)
    return Score(total=float(correct), correct=correct)


BUILTIN_REWARDS: dict[str, Callable[[str, Example], Score]] = {
    "boxed_number": boxed_number,
    "answer_tag": answer_tag,
    "exact": exact,
    "boxed_exact": boxed_exact,
}


@dataclass(frozen=True)
class Reward:
    """One entry of `rewards`: its component `name`, the `entry` as written, and the function."""

    name: str
    entry: str
    fn: Callable[[str, Example], float | Score]

    def __call__(self, completion: str, example: Example) -> Score:
        """The function's result as a `Score`; a float `v` is `Score(v, v >= 1.0 - 1e-9)`. RewardError when the
        function raises or returns a non-finite value or no number."""
        try:
            value = self.fn(completion, example)
        except Exception as err:  # reported with the function's name (the rollout adds the row), not swallowed
            frame = traceback.extract_tb(err.__traceback__)[-1]
            raise RewardError(
                f"reward function '{self.entry}' raised {type(err).__name__}: {err} "
                f"({os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
            ) from err
        total = value.total if isinstance(value, Score) else value
        if not isinstance(total, numbers.Real):  # int, float, bool and numpy scalars
            shown = f"a Score with total {total!r}" if isinstance(value, Score) else repr(value)
            raise RewardError(
                f"reward function '{self.entry}' returned {shown} ({type(total).__name__}): return a float "
                "or an llm_pg.data.tasks.Score"
            )
        if not math.isfinite(total):
            raise RewardError(f"reward function '{self.entry}' returned {total!r}: rewards must be finite numbers")
        if isinstance(value, Score):
            return Score(total=float(total), correct=bool(value.correct), components=value.components)
        return Score(total=float(total), correct=float(total) >= CORRECT_AT - _TOLERANCE)


def import_failure(error: BaseException) -> str:
    """Where and why importing a user's module failed, in one line: `file:line: Type: message`."""
    if isinstance(error, SyntaxError):
        return f"{error.filename}:{error.lineno}: {type(error).__name__}: {error.msg}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(error).__name__}: {' '.join(str(error).split())}"


def import_function(entry: str, what: str = "reward", example: str = "myrewards:score") -> Callable[..., Any]:
    """The function `entry` ("pkg.module:function") names, or a one-line ValueError saying what is missing (`what`:
    the kind of function, for the message; `example`: an entry of that kind)."""
    module_name, _, attribute = entry.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} '{entry}': write 'module:function' (e.g. '{example}')")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"{what} '{entry}': importing {module_name} failed: {import_failure(err)}") from None
        raise ValueError(
            f"{what} '{entry}': no module '{module_name}' beside the config, in the working directory or on "
            "sys.path (llm_pg.data.user_code)"
        ) from None
    except Exception as err:  # a syntax error, or the module's own code raising at import
        raise ValueError(f"{what} '{entry}': importing {module_name} failed: {import_failure(err)}") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        where = getattr(module, "__file__", module_name)
        raise ValueError(f"{what} '{entry}': {where} has no function '{attribute}'")
    return fn


def named_functions(
    entries: Sequence[str], builtins: Mapping[str, Callable[..., Any]], what: str, builtin: str, imported: str
) -> list[tuple[str, str, Callable[..., Any]]]:
    """`(entry, name, function)` for each of a config's `entries` of kind `what` (reward, tool): a built-in name
    (`builtins`) or `"module:function"`, imported now so that a typo fails before training, in one line (`builtin`
    and `imported`: examples of each for the messages)."""
    if isinstance(entries, str) or not entries:
        raise ValueError(f"{what}s must be a non-empty list of names, got {entries!r}: e.g. [{builtin}]")
    out = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"{what}s entry {entry!r} must be a built-in name or 'module:function'")
        if entry in builtins:
            out.append((entry, entry, builtins[entry]))
        elif ":" in entry:
            out.append((entry, entry.rpartition(":")[2], import_function(entry, what, imported)))
        else:
            raise ValueError(f"unknown {what} '{entry}': use one of {', '.join(builtins)} or 'module:function'")
    return out


def resolve_rewards(entries: Sequence[str]) -> list[Reward]:
    """One `Reward` per entry: a built-in name or `"pkg.module:function"` (imported now, so a typo fails before
    training). Component names: the built-in's name or the function's; a repeated name gets `_2`, `_3`, ..."""
    rewards: list[Reward] = []
    for entry, name, fn in named_functions(entries, BUILTIN_REWARDS, "reward", "answer_tag", "myrewards:score"):
        taken = {reward.name for reward in rewards}
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}_{n}"
        rewards.append(Reward(unique, entry, fn))
    return rewards
