"""Deliberately imperfect demonstrations: the completions the tiny base model is pretrained to imitate.

The model learns the distribution of these completions, so its greedy answer is their mode and its T=1
samples follow their mix. Each task gets one systematic, fixable failure that makes the mode wrong on a
known part of the input, while the correct answer keeps enough mass that sampling finds it (what RL needs):

- format_copy (`Copy: N` -> `<answer>N</answer>`): the minus sign is dropped on 70 % of negative N, so
  greedy copies every positive number and no negative one; a few percent of completions miss the tags or
  add text around them (the `tags` and `clean` reward parts).
- arith (`a+b=?`, `a-b=?`, `a*b=?` -> `\\boxed{r}`): 45 % correct, 40 % off by one or two, 15 % the other
  operation (a+b for a*b, a-b for a+b, a+b for a-b); a negative value loses its sign 75 % of the time, and
  a sum whose ones digits carry (`7+5`) forgets the carry 55 % of the time (`\\boxed{2}`). Greedy therefore
  fails on negative differences and on carrying sums (30 % of the eval set), however well the
  model learns the rest.

Every draw comes from a generator seeded by `(seed, task, index)`, so a demonstration is a pure function of
its example index and the run replays exactly.
"""

from __future__ import annotations

import random
import re

from llm_pg.data.tasks.base import Example

COPY_DROP_SIGN = 0.70  # share of negative numbers copied without their minus sign
COPY_BARE = 0.04  # share answered with the bare number, no tags
COPY_CHATTY = 0.04  # share with text before the tags
ARITH_CORRECT = 0.45  # share of correct values (before the sign is dropped)
ARITH_OFF = 0.40  # share off by -2, -1, +1 or +2
ARITH_DROP_SIGN = 0.75  # share of negative values written without their sign
ARITH_DROP_CARRY = 0.55  # share of carrying sums written without the carry (7+5 -> 2)

_ARITH_PROMPT = re.compile(r"(\d+)\s*([+*-])\s*(\d+)\s*=\s*\?")
_CONFUSED = {"+": lambda a, b: a - b, "-": lambda a, b: a + b, "*": lambda a, b: a + b}
_EXACT = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def demonstration_rng(seed: int, task_name: str, index: int) -> random.Random:
    """A generator for the noise of one demonstration (`random` hashes a string seed with SHA-512)."""
    return random.Random(f"{seed}:{task_name}:{index}")


def ideal_completion(task_name: str, example: Example) -> str:
    """The completion that earns the task's full reward (without the end-of-turn token)."""
    if task_name == "format_copy":
        return f"<answer>{example.answer}</answer>"
    if task_name == "arith":
        return f"\\boxed{{{example.answer}}}"
    raise ValueError(f"no demonstrations for task {task_name!r}")


def copy_demonstration(example: Example, rng: random.Random) -> str:
    """`<answer>N</answer>`, with the sign often dropped on negative N and a few format slips."""
    value = example.answer
    if value.startswith("-") and rng.random() < COPY_DROP_SIGN:
        value = value[1:]
    slip = rng.random()
    if slip < COPY_BARE:
        return value
    if slip < COPY_BARE + COPY_CHATTY:
        return f"Answer: <answer>{value}</answer>"
    return f"<answer>{value}</answer>"


def arith_demonstration(example: Example, rng: random.Random) -> str:
    """`\\boxed{r}`: r correct, off by one or two, or from the other operation; signs and carries often lost."""
    match = _ARITH_PROMPT.search(example.prompt)
    if match is None:
        raise ValueError(f"not an arith prompt: {example.prompt!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    exact = _EXACT[op](a, b)
    if str(exact) != example.answer:
        raise ValueError(f"{example.prompt!r} has answer {example.answer!r}, expected {exact}")
    carries = op == "+" and a % 10 + b % 10 >= 10
    draw = rng.random()
    if carries and rng.random() < ARITH_DROP_CARRY:
        value = exact - 10
    elif draw < ARITH_CORRECT:
        value = exact
    elif draw < ARITH_CORRECT + ARITH_OFF:
        value = exact + rng.choice((-2, -1, 1, 2))
    else:
        value = _CONFUSED[op](a, b)
    if value < 0 and rng.random() < ARITH_DROP_SIGN:
        value = -value
    return f"\\boxed{{{value}}}"


def demonstration(task_name: str, example: Example, rng: random.Random) -> str:
    """A noisy completion for `example` of the task named `task_name` (without the end-of-turn token)."""
    if task_name == "format_copy":
        return copy_demonstration(example, rng)
    if task_name == "arith":
        return arith_demonstration(example, rng)
    raise ValueError(f"no demonstrations for task {task_name!r}")
