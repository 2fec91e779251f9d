"""Safe answer checking: exact parses, linear-time extraction, adversarial input, no eval."""

import builtins
import time
from fractions import Fraction

import pytest

from llm_pg.data.tasks import math_hard
from llm_pg.data.tasks.answers import extract_boxed, last_number, numbers_equal, parse_number


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", Fraction(12)),
        ("12.0", Fraction(12)),
        ("-3", Fraction(-3)),
        ("+4", Fraction(4)),
        ("1,000", Fraction(1000)),
        ("1,234.5", Fraction(2469, 2)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("-\\tfrac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("\\frac12", Fraction(1, 2)),
        ("2\\frac{1}{2}", Fraction(5, 2)),
        ("-2\\frac{1}{2}", Fraction(-5, 2)),
        ("\\$18.90", Fraction(189, 10)),
        ("$5$", Fraction(5)),
        ("25\\%", Fraction(25)),
        ("90^\\circ", Fraction(90)),
        ("90^{\\circ}", Fraction(90)),
        ("10\\text{ inches}", Fraction(10)),
        ("\\text{5}", Fraction(5)),
        ("{{42}}", Fraction(42)),
        ("\\left(7\\right)", None),
        (" 7 ", Fraction(7)),
    ],
)
def test_parse_number_values(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "x^2+1",
        "\\sqrt{2}",
        "(-\\infty, 3]",
        "(1,2)",
        "1,2",
        "\\text{(A)}",
        "x=5",
        "9^9^9^9",
        "10^{10^{10}}",
        "1/0",
        "\\frac{1}{0}",
        "1 000",
        "2 1/2",
        "1e5",
        "inf",
        "nan",
        "2\\frac{-1}{2}",
        "9" * 101,
    ],
)
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_numbers_equal_is_numeric_equivalence():
    assert numbers_equal("12.0", "12")
    assert numbers_equal("1,000", "1000")
    assert numbers_equal("\\frac{1}{2}", "0.5")
    assert not numbers_equal("0.33", "\\frac{1}{3}")
    assert not numbers_equal(None, "1")
    assert not numbers_equal("x", "x")  # non-numbers are never equal


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so \\boxed{12}.", "12"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{b}", "b"),
        ("\\boxed{5} then \\boxed{6", "5"),  # the last one never closes: the latest closed box wins
        ("\\boxed{\\boxed{7}}", "7"),
        ("\\fbox{3}", "3"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("} } \\boxed{ 4 } }", "4"),
        ("\\boxed{5", None),
        ("no box {here}", None),
        ("\\boxed5", None),
    ],
)
def test_extract_boxed(text, content):
    assert extract_boxed(text) == content
    assert math_hard.extract_boxed is extract_boxed


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("the answer is 5.", Fraction(5)),
        ("x = -12", Fraction(-12)),
        ("1,2,3", Fraction(3)),
        ("total 1,000 dollars", Fraction(1000)),
        ("pi is 3.14!", Fraction(314, 100)),
        ("no digits", None),
        ("9" * 100, None),
    ],
)
def test_last_number(text, value):
    assert last_number(text) == value


ADVERSARIAL = {
    "1 MB of text": "a" * 1_000_000,
    "1 MB of open braces": "\\boxed{" + "{" * 1_000_000,
    "1 MB of brace pairs": "\\boxed{" + "{}" * 500_000 + "}",
    "20,000 unclosed boxed": "\\boxed{" * 20_000,
    "200,000 closed boxed": "\\boxed{1}" * 200_000,
    "tower": "\\boxed{9^9^9^9}",
    "nested power": "\\boxed{10^{10^{10}}}",
    "100k digits boxed": "\\boxed{" + "9" * 100_000 + "}",
    "100k digits plain": "1" * 100_000,
    "code": "\\boxed{__import__('os').system('x')}",
    "deep nesting": "\\boxed{" * 50_000 + "1" + "}" * 50_000,
    "long frac": "\\boxed{\\frac{" + "1" * 50_000 + "}{3}}",
    "1 MB digits and commas": "1," * 500_000,
}


def test_adversarial_inputs_are_fast_and_never_raise(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("completion text must never be evaluated")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    worst = 0.0
    for name, text in ADVERSARIAL.items():
        for call in (extract_boxed, parse_number, last_number, lambda t: math_hard.score(t, "12")):
            start = time.perf_counter()
            call(text)
            elapsed = time.perf_counter() - start
            assert elapsed < 1.0, name
            worst = max(worst, elapsed)
    assert math_hard.score(ADVERSARIAL["code"], "12").total == pytest.approx(0.1)  # boxed, not a number
    print(f"worst time per call on adversarial input: {worst * 1000:.1f} ms")
