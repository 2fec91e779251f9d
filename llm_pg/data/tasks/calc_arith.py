"""calc_arith: two-digit products answered as `\\boxed{N}`, with a calculator the model may call (a `ToolTask`).

The user turn is `37*48=?`. The model may write `<calc>37*48</calc>` and end its turn; the calculator's result
(`1776`, or `error: ...` for an expression it refuses) comes back as a tool turn, and the model answers
`\\boxed{1776}`. Scored as arith and math_hard are (`math_hard.score`) on the model's turns: the last closed box.
The calculator is `llm_pg.data.tasks.calculator.calculate`: integers only, no `eval`, linear time, bounded input.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import ClassVar

from llm_pg.data.tasks.base import Example
from llm_pg.data.tasks.calculator import CalculatorError, calculate
from llm_pg.data.tasks.math_hard import BoxedAnswerTask
from llm_pg.data.tasks.tools import ToolError, ToolTask

__all__ = ["SYSTEM_PROMPT", "CalcArithTask", "calc"]

SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write <calc>EXPRESSION</calc> (for example <calc>12*34</calc>) and end "
    "your message; its result comes back in the next message. Give the final answer as \\boxed{NUMBER}."
)


def calc(expression: str) -> str:
    """The calculator tool: the value of an integer expression, or a `ToolError` saying why there is none."""
    try:
        return calculate(expression)
    except CalculatorError as error:
        raise ToolError(str(error)) from None


class CalcArithTask(ToolTask, BoxedAnswerTask):
    """Products `a*b` with both operands drawn from `mul_range` (inclusive), and the calculator tool `calc`.

    Train example `i` of seed `s` is drawn from `random.Random(f"calc_arith:{s}:{i}")`; the eval set is `eval_size`
    draws from `random.Random(f"calc_arith-eval:{eval_seed}")`. With `max_turns: 1` the model answers at once (a
    call it writes is never run): the same task without the tool.

    Args:
        mul_range: inclusive range of both operands.
        max_turns: model turns of an episode (the call, then the answer: 2 is enough; 1: no tool).
        max_tool_tokens: tokens of one calculator result (a result has at most 31 characters).
        system_prompt: the system turn, telling the model about the calculator (null: none, as the tiny model's).
        prompt_template: the user turn, with `{expr}` replaced by the expression.
        eval_size: eval examples.
        eval_seed: seed of the eval set.
    """

    name = "calc_arith"
    tools: ClassVar[Mapping[str, Callable[[str], str]]] = {"calc": calc}

    def __init__(
        self,
        mul_range: tuple[int, int] = (10, 99),
        max_turns: int = 3,
        max_tool_tokens: int = 32,
        system_prompt: str | None = SYSTEM_PROMPT,
        prompt_template: str = "{expr}=?",
        eval_size: int = 128,
        eval_seed: int = 4321,
    ) -> None:
        super().__init__(max_turns, max_tool_tokens, system_prompt, eval_size, eval_seed)
        low, high = int(mul_range[0]), int(mul_range[1])
        if low > high or low < 0:
            raise ValueError(f"mul_range must be (low, high) with 0 <= low <= high, got {tuple(mul_range)}")
        if "{expr}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{expr}}', got {prompt_template!r}")
        self.mul_range, self.prompt_template = (low, high), prompt_template

    def _draw(self, rng: random.Random) -> Example:
        a, b = rng.randint(*self.mul_range), rng.randint(*self.mul_range)
        return Example(prompt=self.prompt_template.replace("{expr}", f"{a}*{b}"), answer=str(a * b))

    def train_example(self, index: int, seed: int) -> Example:
        return self._draw(random.Random(f"calc_arith:{seed}:{index}"))

    def build_eval_set(self) -> list[Example]:
        rng = random.Random(f"calc_arith-eval:{self.eval_seed}")
        return [self._draw(rng) for _ in range(self.eval_size)]
