"""Answer parsing: the course's values on hand-checked cases, linear time on hostile input, no eval."""

import builtins
import time

import pytest

from llm_pg.data.tasks import format_copy, math_hard
from llm_pg.data.tasks.answers import (
    extract_boxed,
    is_xml_only,
    last_number,
    parse_number,
    strip_think,
    xml_answer,
    xml_number,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", 12.0),
        (" 12.0 ", 12.0),
        ("-3", -3.0),
        ("+4", 4.0),
        (".5", 0.5),
        ("1,000", 1000.0),
        ("1,0,0,0", 1000.0),  # every comma is deleted, grouped or not
        ("1,234.5", 1234.5),
        ("3/4", 0.75),
        ("3 / -4", -0.75),
        ("\\frac{1}{3}", 1 / 3),
        ("\\dfrac{3}{4}", 0.75),
        ("-\\tfrac{3}{4}", -0.75),
        ("-\\frac{-3}{4}", 0.75),
        ("2\\frac{1}{2}", 2.5),
        ("-2\\frac{1}{2}", -2.5),  # a mixed number takes the sign of its whole part
        ("-2\\frac{-1}{2}", -2.5),
        ("2 1/2", 2.5),
        ("-2 1/2", -2.5),
        ("\\$18.90", 18.9),
        ("$5$", 5.0),
        ("\\text{5}", 5.0),
        ("\\mathrm{ \\text{5} }", 5.0),
        ("{{42}}", None),  # one brace layer only
        ("{42}", 42.0),
        ("\\left7\\right", 7.0),
        ("\u0664\u0662", 42.0),  # Arabic-Indic digits are digits to re and float()
        ("9" * 400, float("inf")),
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
        "(1,2)",
        "\\text{(A)}",
        "9^9^9^9",
        "1/0",
        "\\frac{1}{0}",
        "2 1/0",
        "1e5",
        "inf",
        "nan",
        "5.",
        "12\\%",  # the course reads none of these: `\%`, degrees, units, `\frac12`, `\fbox`
        "90^\\circ",
        "12 \\text{ cm}",
        "\\frac12",
        "\\fbox{3}",
        "\\left(7\\right)",
    ],
)
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_float_tolerance_is_the_courses():
    assert abs(parse_number("0.3333333") - parse_number("\\frac{1}{3}")) < 1e-6  # counted correct
    assert math_hard.score("\\boxed{0.3333333}", repr(1 / 3)).correct
    assert not math_hard.score("\\boxed{0.33333}", repr(1 / 3)).correct


def test_strip_think_removes_blocks_then_lowercase_closers_only():
    assert strip_think("<think>a</think> x <THINK>b</Think> y ") == "x  y"
    assert strip_think("<think>a<think>b</think>c</think>d") == "cd"  # lazy: the first closer ends the block
    assert strip_think("<think>never closed </think") == "<think>never closed </think"
    assert strip_think("</think>x</THINK>") == "x</THINK>"  # the leftover removal is case-sensitive
    assert strip_think("<thin\u212a>a</think>b") == "b"  # the Kelvin sign matches k, as in re.IGNORECASE


def test_xml_answer_and_strictness():
    assert xml_answer("say <ANSWER> 42 </answer> and <answer>7</answer>") == "42"
    assert xml_answer("<answer>42") is None and xml_answer("</answer><answer>") is None
    assert xml_answer("<an\u017fwer>1</answer>") == "1"  # the long s matches s
    assert is_xml_only(" <think>x</think> <Answer>1</ANSWER>\n")
    assert is_xml_only("<answer>1</answer><answer>2</answer>")  # starts and ends with the tags
    assert not is_xml_only("<answer></answer") and not is_xml_only("ok <answer>1</answer>")
    assert xml_number("<answer>The answer is 42.</answer>") == 42.0  # the last number token of the content
    assert xml_number("<answer>1,234 or 5</answer>") == 5.0


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so \\boxed{12}.", "12"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{b}", "b"),
        ("\\boxed{5} then \\boxed{6", "5"),  # the last one never closes: the latest closed box wins
        ("\\boxed{\\boxed{7}}", "7"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("} } \\boxed{ 4 } }", "4"),
        ("<think>\\boxed{1}</think>\\boxed{2", None),
        ("\\fbox{3}", None),
        ("\\BOXED{3}", None),
        ("\\boxed{5", None),
        ("\\boxed5", None),
    ],
)
def test_extract_boxed(text, content):
    assert extract_boxed(text) == content
    assert math_hard.extract_boxed is extract_boxed


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("the answer is 5.", 5.0),
        ("x = -12", -12.0),
        ("1,2,3", 3.0),  # `,2` is no thousands group: the tokens are 1, 2 and 3
        ("total 1,000 dollars", 1000.0),
        ("pi is 3.14!", 3.14),
        ("<think>7</think> no digits", None),
    ],
)
def test_last_number(text, value):
    assert last_number(text) == value


BIG = 1_000_000
ADVERSARIAL = {
    "1 MB of text": "a" * BIG,
    "1 MB of open braces": "\\boxed{" + "{" * BIG,
    "1 MB of brace pairs": "\\boxed{" + "{}" * (BIG // 2) + "}",
    "20,000 unclosed boxed": "\\boxed{" * 20_000,
    "200,000 closed boxed": "\\boxed{1}" * 200_000,
    "100k unclosed answer": "<answer>" * 100_000,
    "100k answer, one close": "<answer>" * 100_000 + "9" * 100_000 + "</answer>",
    "100k unclosed think": "<think>" * 100_000 + "<answer>1</answer>",
    "100k think pairs": "<think></think>" * 100_000,
    "1 MB answer content": "<answer>" + "1 " * (BIG // 2) + "</answer>",
    "1 MB digits answer": "<answer>" + "9" * BIG + "</answer>",
    "deep text nesting": "<answer>" + "\\text{" * 100_000 + "5" + "}" * 100_000 + "</answer>",
    "deep text in box": "\\boxed{" + "\\text{" * 20_000 + "5" + "}" * 20_001,
    "tower": "\\boxed{9^9^9^9}",
    "1 MB digits boxed": "\\boxed{" + "9" * BIG + "}",
    "1 MB digits plain": "1" * BIG,
    "code": "\\boxed{__import__('os').system('x')}",
    "deep nesting": "\\boxed{" * 50_000 + "1" + "}" * 50_000,
    "long frac": "\\boxed{\\frac{" + "1" * 500_000 + "}{3}}",
    "1 MB digits and commas": "1," * (BIG // 2),
    "1 MB mixed": "\\boxed{1 " + "2" * BIG + "/3}",
}
CALLS = {
    "parse_number": parse_number,
    "extract_boxed": extract_boxed,
    "last_number": last_number,
    "xml_number": xml_number,
    "format_copy.score": lambda text: format_copy.score(text, "12"),
    "math_hard.score": lambda text: math_hard.score(text, "12"),
}


def test_adversarial_inputs_are_fast_and_never_raise(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("completion text must never be evaluated")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    worst, worst_case = 0.0, ""
    for name, text in ADVERSARIAL.items():
        for call_name, call in CALLS.items():
            start = time.perf_counter()
            call(text)
            elapsed = time.perf_counter() - start
            assert elapsed < 1.0, (name, call_name)  # a generous safety bound, not a benchmark
            if elapsed > worst:
                worst, worst_case = elapsed, f"{call_name} on {name}"
    assert math_hard.score(ADVERSARIAL["code"], "12").total == 0.1  # the keyword only: the box is no number
    assert parse_number("\\text{" * 100_000 + "5" + "}" * 100_000) is None  # past the peeling budget
    assert parse_number("\\text{" * 1_200 + "5" + "}" * 1_200) == 5.0  # the course overflows its stack here
    print(f"worst time per call on adversarial input: {worst * 1000:.1f} ms ({worst_case})")
