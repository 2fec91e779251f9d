"""calc_arith: products answered as `\\boxed{N}`, with a calculator the model may call (a `ToolTask`).

The user turn is `37*48=?`. With `call_format: tags` (the tiny model's dialect) the model may write
`<calc>37*48</calc>` and end its turn; with `call_format: json` (real chat models: Qwen2.5, ...) the tool
`calculator(expression)` is in the chat template's tool block and the model writes
`<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>`. The calculator's result
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

__all__ = ["JSON_SYSTEM_PROMPT", "SYSTEM_PROMPT", "CalcArithTask", "calc"]

SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write <calc>EXPRESSION</calc> (for example <calc>12*34</calc>) and end "
    "your message; its result comes back in the next message. Give the final answer as \\boxed{NUMBER}."
)
# With JSON calls the chat template describes the tool itself; the system turn asks for the answer's form only.
JSON_SYSTEM_PROMPT = "You are a helpful assistant. Give the final answer as \\boxed{NUMBER}."


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, *, //, %, ** and parentheses) and return its value.

    Args:
        expression: the expression to evaluate, e.g. 37*48
    """
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
        system_prompt: the system turn (null: none, as the tiny model's); the default tells the model about the
            calculator (tags) or only asks for a boxed answer (json, whose tool block the template writes).
        prompt_template: the user turn, with `{expr}` replaced by the expression.
        eval_size: eval examples.
        eval_seed: seed of the eval set.
        call_format: tags (<calc>EXPR</calc>, the tool `calc`) or json (the tool `calculator(expression)` in the
            chat template's tools= block, called with <tool_call> JSON).
        shots: worked products shown before the question, as earlier turns of the conversation (`demonstrations`):
            with the tool (json, `max_turns` > 1) each is the question, a call, the calculator's result and
            `The answer is \\boxed{N}.`; without it (`max_turns: 1`) the question and `A*B = N. The answer is
            \\boxed{N}.`. The products are fixed (`random.Random("calc_arith-shots")`), the same in both.
    """

    name = "calc_arith"
    tools: ClassVar[Mapping[str, Callable[..., str]]] = {"calc": calc}

    def __init__(
        self,
        mul_range: tuple[int, int] = (10, 99),
        max_turns: int = 3,
        max_tool_tokens: int = 32,
        system_prompt: str | None = SYSTEM_PROMPT,
        prompt_template: str = "{expr}=?",
        eval_size: int = 128,
        eval_seed: int = 4321,
        call_format: str = "tags",
        shots: int = 0,
    ) -> None:
        if call_format == "json" and system_prompt == SYSTEM_PROMPT:  # the default: the one for the call format
            system_prompt = JSON_SYSTEM_PROMPT
        super().__init__(max_turns, max_tool_tokens, system_prompt, eval_size, eval_seed, call_format)
        if call_format == "json":
            self.tools = {"calculator": calc}  # the name Qwen2.5-Coder calls unprompted
        low, high = int(mul_range[0]), int(mul_range[1])
        if low > high or low < 0:
            raise ValueError(f"mul_range must be (low, high) with 0 <= low <= high, got {tuple(mul_range)}")
        if "{expr}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{expr}}', got {prompt_template!r}")
        if shots < 0:
            raise ValueError(f"shots must be >= 0, got {shots}")
        if shots and call_format != "json" and max_turns > 1:
            raise ValueError(
                "shots with the tool need call_format: json (a <calc> call and its result are not chat messages); "
                "set call_format: json, or max_turns: 1 for the task without the tool"
            )
        self.mul_range, self.prompt_template, self.shots = (low, high), prompt_template, shots

    def demonstrations(self) -> list[dict]:
        """The `shots` worked products as chat messages, before the question (`messages`): with the tool, the call
        as the template's own `tool_calls` and the product as the tool turn (what the calculator returns; no tool
        runs here, so a subclass's own tool never runs outside the reward workers); without it, the product
        written out."""
        name = next(iter(self.tools))  # the calculator (a subclass's first tool)
        rng, turns = random.Random("calc_arith-shots"), []
        for _ in range(self.shots):
            a, b = rng.randint(*self.mul_range), rng.randint(*self.mul_range)
            expr, value = f"{a}*{b}", str(a * b)
            answer = f"The answer is \\boxed{{{value}}}."
            turns.append({"role": "user", "content": self.prompt_template.replace("{expr}", expr)})
            if self.shows_tools:
                call = {"type": "function", "function": {"name": name, "arguments": {"expression": expr}}}
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
                turns.append({"role": self.observation_role, "content": value})
                turns.append({"role": "assistant", "content": answer})
            else:
                turns.append({"role": "assistant", "content": f"{expr} = {value}. {answer}"})
        return turns

    def messages(self, example: Example) -> list[dict]:
        """The system turn (if any), the `shots` demonstrations, then the question."""
        turns = super().messages(example)
        return [*turns[:-1], *self.demonstrations(), turns[-1]]

    def _draw(self, rng: random.Random) -> Example:
        a, b = rng.randint(*self.mul_range), rng.randint(*self.mul_range)
        return Example(prompt=self.prompt_template.replace("{expr}", f"{a}*{b}"), answer=str(a * b))

    def train_example(self, index: int, seed: int) -> Example:
        return self._draw(random.Random(f"calc_arith:{seed}:{index}"))

    def build_eval_set(self) -> list[Example]:
        rng = random.Random(f"calc_arith-eval:{self.eval_seed}")
        return [self._draw(rng) for _ in range(self.eval_size)]
