"""arith: small integer arithmetic answered as `\\boxed{N}`, the offline CPU stand-in for math_hard.

The default user turn is a two-operand expression such as `12+7=?`, `15-18=?` or `6*7=?`; the ideal
completion is `\\boxed{19}`. Completions are scored by `math_hard.score`, so the reward components and
eval metrics are those of math_hard. Values are computed with Python integer arithmetic, never `eval`.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence

from llm_pg.data.tasks.base import Example
from llm_pg.data.tasks.math_hard import BoxedAnswerTask

__all__ = ["ArithTask"]

OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of `operands[0] ops[0] operands[1] (ops[1] operands[2])` with `*` binding tighter than `+`/`-`.

    Handles two or three operands: `2+3*4` is 14, `2*3+4` is 10, `9-2-3` is 4 (left to right).
    """
    if len(ops) == 2 and ops[1] == "*" and ops[0] != "*":
        return OPERATORS[ops[0]](operands[0], operands[1] * operands[2])
    value = operands[0]
    for op, operand in zip(ops, operands[1:], strict=True):
        value = OPERATORS[op](value, operand)
    return value


class ArithTask(BoxedAnswerTask):
    """Integer expressions: `a+b` and `a-b` with operands in `add_range`, `a*b` with operands in `mul_range`
    (both inclusive).

    With `three_operand=True`, half of the examples get a third operand (`3+4*5=?`); an operand next to
    a `*` comes from `mul_range`. Train example `i` of seed `s` is drawn from
    `random.Random(f"arith:{s}:{i}")`, a pure function of `(s, i)`; the eval set is `eval_size` draws from
    `random.Random(f"arith-eval:{eval_seed}")`. In `prompt_template` the literal `{expr}` is replaced by the
    expression. The expression space is small (about a thousand two-operand items), so eval items also
    occur in training: the eval set measures learning of the format and the arithmetic, not generalization.

    Args:
        ops: the operators drawn from, a subset of `+`, `-`, `*`.
        add_range: inclusive operand range of `+` and `-`.
        mul_range: inclusive operand range of an operand next to `*`.
        three_operand: half of the examples get a third operand.
        system_prompt: the system turn (null: none).
        prompt_template: the user turn, with `{expr}` replaced by the expression.
        eval_size: eval examples.
        eval_seed: seed of the eval set.
    """

    name = "arith"

    def __init__(
        self,
        ops: Sequence[str] = ("+", "-", "*"),
        add_range: tuple[int, int] = (0, 20),
        mul_range: tuple[int, int] = (0, 9),
        three_operand: bool = False,
        system_prompt: str | None = None,
        prompt_template: str = "{expr}=?",
        eval_size: int = 128,
        eval_seed: int = 4321,
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size, eval_seed=eval_seed)
        if not ops or any(op not in OPERATORS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {tuple(OPERATORS)}, got {ops!r}")
        for key, (low, high) in {"add_range": add_range, "mul_range": mul_range}.items():
            if low > high:
                raise ValueError(f"{key} must be (low, high) with low <= high, got {(low, high)}")
        if "{expr}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{expr}}', got {prompt_template!r}")
        self.ops = tuple(ops)
        self.add_range = (int(add_range[0]), int(add_range[1]))
        self.mul_range = (int(mul_range[0]), int(mul_range[1]))
        self.three_operand = three_operand
        self.prompt_template = prompt_template

    def _draw(self, rng: random.Random) -> Example:
        n_ops = 2 if self.three_operand and rng.random() < 0.5 else 1
        ops = [rng.choice(self.ops) for _ in range(n_ops)]
        operands = []
        for position in range(n_ops + 1):
            next_to_product = "*" in ops[max(position - 1, 0) : position + 1]
            operands.append(rng.randint(*(self.mul_range if next_to_product else self.add_range)))
        expr = "".join(f"{operand}{op}" for operand, op in zip(operands, [*ops, ""], strict=True))
        return Example(prompt=self.prompt_template.replace("{expr}", expr), answer=str(evaluate(operands, ops)))

    def train_example(self, index: int, seed: int) -> Example:
        return self._draw(random.Random(f"arith:{seed}:{index}"))

    def build_eval_set(self) -> list[Example]:
        rng = random.Random(f"arith-eval:{self.eval_seed}")
        return [self._draw(rng) for _ in range(self.eval_size)]
