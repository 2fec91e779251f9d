"""arith: expressions, their values (integer arithmetic, no eval), scoring by the math scorer."""

import re

import pytest

from llm_pg.data.tasks import ArithTask
from llm_pg.data.tasks.arith import evaluate

TWO_OPERANDS = re.compile(r"(\d+)([+*-])(\d+)=\?")


def test_default_prompts_are_tiny_two_operand_expressions():
    task = ArithTask()
    for i in range(300):
        example = task.train_example(i, seed=0)
        a, op, b = TWO_OPERANDS.fullmatch(example.prompt).groups()
        a, b = int(a), int(b)
        high = 9 if op == "*" else 20
        assert 0 <= a <= high and 0 <= b <= high
        assert int(example.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert task.messages(example) == [{"role": "user", "content": example.prompt}]


def test_precedence_without_eval():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "+"]) == 10
    assert evaluate([9, 2, 3], ["-", "-"]) == 4
    assert evaluate([6, 7], ["*"]) == 42


def test_three_operand_option():
    task = ArithTask(three_operand=True)
    prompts = [task.train_example(i, seed=0).prompt for i in range(100)]
    three = [p for p in prompts if len(re.findall(r"[+*-]", p)) == 2]
    assert 20 < len(three) < 80


def test_ideal_completion_scores_like_math_hard():
    task = ArithTask()
    example = task.eval_examples[0]
    result = task.score(f"\\boxed{{{example.answer}}}", example)
    assert result.correct and result.total == 0.1 + 1.0  # boxed literal, then correct: the course's 1.1
    assert result.components == {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}
    assert task.components == ("correct", "boxed", "relaxed")
    assert task.score(f"it is {example.answer}", example).total == 0.1  # the relaxed last-number bonus
    assert task.eval_metrics([f"\\boxed{{{example.answer}}}"], [example])["exact_match"] == 1.0


def test_streams_are_deterministic():
    assert ArithTask().eval_examples == ArithTask().eval_examples
    assert len(ArithTask().eval_examples) == 128
    assert ArithTask().train_example(3, seed=1) == ArithTask().train_example(3, seed=1)
    assert ArithTask().eval_examples != ArithTask(eval_seed=1).eval_examples


def test_custom_ops_and_template():
    task = ArithTask(ops=("*",), mul_range=(2, 3), prompt_template="Compute {expr}.", system_prompt="Be brief.")
    example = task.train_example(0, seed=0)
    assert re.fullmatch(r"Compute [23]\*[23]\.", example.prompt)
    assert task.messages(example)[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"ops": ("/",)}, "ops"),
        ({"ops": ()}, "ops"),
        ({"add_range": (5, 1)}, "add_range"),
        ({"mul_range": (9, 0)}, "mul_range"),
        ({"prompt_template": "no expression"}, "prompt_template"),
    ],
)
def test_invalid_arguments(kwargs, key):
    with pytest.raises(ValueError, match=key):
        ArithTask(**kwargs)
