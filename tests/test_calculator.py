"""The safe calculator tool: values against Python's own arithmetic, error messages, and hostile inputs."""

from __future__ import annotations

import random
import re
import time

import pytest

from llm_pg.data.tasks.calculator import MAX_CHARS, CalculatorError, calculate

BOUND = 10**30


class Checked(int):
    """An int whose arithmetic raises OverflowError at the calculator's bound: the tests' reference values."""

    def __add__(self, other):
        return checked(int(self) + int(other))

    def __sub__(self, other):
        return checked(int(self) - int(other))

    def __mul__(self, other):
        return checked(int(self) * int(other))

    def __floordiv__(self, other):
        return checked(int(self) // int(other))

    def __mod__(self, other):
        return checked(int(self) % int(other))

    def __pow__(self, other):
        return checked(int(self) ** int(other))

    def __neg__(self):
        return Checked(-int(self))

    def __pos__(self):
        return self


def checked(value: int) -> Checked:
    if abs(value) >= BOUND:
        raise OverflowError(value)
    return Checked(value)


def reference(expression: str) -> int:
    """Python's value of the test's own `expression`: Python's parser, `/` read as `//`, bound-checked ints."""
    python = re.sub(r"\d+", r"Checked(\g<0>)", expression.replace("//", "/").replace("/", "//"))
    return int(eval(f"({python})", {"Checked": Checked}))  # parenthesized: newlines are whitespace


def timed(expression: str) -> tuple[str | CalculatorError, float]:
    """The result or the error of `calculate(expression)`, and the seconds it took."""
    start = time.perf_counter()
    try:
        result: str | CalculatorError = calculate(expression)
    except CalculatorError as error:
        result = error
    return result, time.perf_counter() - start


@pytest.mark.parametrize(
    ("expression", "expected"),
    [("37*48", "1776"), (" -(3+4)*2 ", "-14"), ("7//2", "3"), ("-7/2", "-4"), ("2**10", "1024")],
)
def test_examples(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "0",
        "1+2*3",
        "(1+2)*3",
        "10-4-3",
        "2*3-4*5",
        "100/7",
        "-100/7",
        "100/-7",
        "-100//-7",
        "17%5",
        "-17%5",
        "17%-5",
        "-17 % -5",
        "2**3**2",
        "(2**3)**2",
        "-2**2",
        "(-2)**2",
        "-2**-0",
        "2**-(-3)",
        "2*-3",
        "--5",
        "-+-5",
        "+5",
        "2*3**2",
        "-3**2*2",
        "1-2+3-4+5",
        "8//3*3+8%3",
        "((((7))))",
        "\t12 *\n 13 ",
        "(5-8)*(5+8)//(2**2)",
        "0**0",
        "(-1)**999999999999999999999999999999",
        "1**999999999999999999999999999999",
        "0**999999999999999999999999999999",
        "999999999999999999999999999999",
        "-999999999999999999999999999999",
        "999999999999999999999*999999999",
        "2**99",
        "3**62",
    ],
)
def test_matches_python(expression):
    assert calculate(expression) == str(reference(expression))


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "empty expression"),
        ("  \t ", "empty expression"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("5%(3-3)", "division by zero"),
        ("0/0", "division by zero"),
        ("2**-1", "negative exponent"),
        ("1**-1", "negative exponent"),
        ("10**30", "number too large (more than 30 digits)"),
        ("2**100", "number too large (more than 30 digits)"),
        ("-(10**29)*10", "number too large (more than 30 digits)"),
        ("999999999999999999999999999999+1", "number too large (more than 30 digits)"),
        ("1" * 31, "number at position 0 has more than 30 digits"),
        ("1+" + "2" * 31, "number at position 2 has more than 30 digits"),
        ("1+2x", "unexpected character 'x' at position 3"),
        ("2.5", "unexpected character '.' at position 1"),
        ("2^3", "unexpected character '^' at position 1"),
        ("1_000", "unexpected character '_' at position 1"),
        ("2²", "unexpected character '²' at position 1"),
        ("١+1", "unexpected character '١' at position 0"),
        ("1+\x00", "unexpected character '\\x00' at position 2"),
        ("__import__('os')", "unexpected character '_' at position 0"),
        ("(1+2", "unbalanced parentheses: missing ')'"),
        ("1+2)", "unbalanced parentheses: unexpected ')' at position 3"),
        ("1+", "missing operand at end of expression"),
        ("-", "missing operand at end of expression"),
        ("*2", "missing operand before '*' at position 0"),
        ("2 ** ** 3", "missing operand before '**' at position 5"),
        ("()", "missing operand before ')' at position 1"),
        ("2 3", "missing operator before '3' at position 2"),
        ("2(3)", "missing operator before '(' at position 1"),
        ("(" * 51 + "1" + ")" * 51, "too many nested parentheses (at most 50)"),
    ],
)
def test_errors(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        calculate(expression)


def test_error_is_value_error_and_rejects_non_strings():
    assert issubclass(CalculatorError, ValueError)
    with pytest.raises(CalculatorError, match="expression must be a string, not int"):
        calculate(12)  # type: ignore[arg-type]


def test_depth_limit_is_inclusive():
    assert calculate("(" * 50 + "1" + ")" * 50) == "1"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("9**9**9", "number too large"),
        ("9**" * 66 + "9", "number too large"),
        ("2**" * 66 + "2", "number too large"),
        ("9" * 30 + "**" + "9" * 30, "number too large"),
        ("1" * 1_000_000, "expression too long: 1000000 characters, at most 200"),
        ("(" * 100_000 + "1" + ")" * 100_000, "expression too long: 200001 characters, at most 200"),
        ("1+" * 100 + "1", "expression too long: 201 characters, at most 200"),
        ("1+" * 99 + "1", "100"),
        ("-" * 199 + "1", "-1"),
        ("((((" * 20 + "1" + "))))" * 20, "too many nested parentheses"),
        ("(" * 99 + ")" * 99, "too many nested parentheses"),
        ("9" * 30 + "*" + "9" * 30, "number too large"),
        ("(-1)**" + "9" * 30, "-1"),
        ("-" * 169 + "9" * 30, "-" + "9" * 30),
    ],
)
def test_hostile_inputs_are_fast(expression, expected):
    result, seconds = timed(expression)
    assert seconds < 0.5
    assert expected in str(result)


def test_long_expression_of_many_operations():
    expression = "+".join(["12345*6789//7%1000-3**4"] * 9)[:MAX_CHARS]
    expression = expression[: expression.rfind("+")]  # end on a complete term
    assert len(expression) > 180
    result, seconds = timed(expression)
    assert seconds < 0.5
    assert result == str(reference(expression))


OPERATORS = ["+", "-", "*", "/", "//", "%", "**"]


def random_expression(rng: random.Random, depth: int) -> str:
    """A random expression over small (sometimes large) ints with random parentheses and unary minus.

    A power's base is a literal or parenthesized and its exponent a literal 0..3, so no chain of powers
    makes Python's own evaluation slow.
    """
    if depth == 0 or rng.random() < 0.25:
        text = str(rng.randint(0, 12) if rng.random() < 0.9 else rng.randint(0, 10**15))
    else:
        operator = rng.choice(OPERATORS)
        left = random_expression(rng, depth - 1)
        if operator == "**":
            left = left if left.isdigit() else f"({left})"
            right = str(rng.randint(0, 3))
        else:
            right = random_expression(rng, depth - 1)
            left = f"({left})" if rng.random() < 0.4 else left
            right = f"({right})" if rng.random() < 0.4 else right
        space = rng.choice(["", " "])
        text = f"{left}{space}{operator}{space}{right}"
    return "-" + text if rng.random() < 0.15 else text


def test_random_expressions_match_python():
    rng = random.Random(0)
    outcomes = {"value": 0, "division by zero": 0, "number too large": 0}
    checked_count = 0
    while checked_count < 300:
        expression = random_expression(rng, depth=4)
        if len(expression) > MAX_CHARS:
            continue
        checked_count += 1
        try:
            expected, outcome = str(reference(expression)), "value"
        except ZeroDivisionError:
            expected, outcome = None, "division by zero"
        except OverflowError:
            expected, outcome = None, "number too large"
        outcomes[outcome] += 1
        if expected is None:
            with pytest.raises(CalculatorError, match=outcome):
                calculate(expression)
        else:
            assert calculate(expression) == expected, expression
    assert min(outcomes.values()) > 0, outcomes
