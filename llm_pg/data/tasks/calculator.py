"""calculator: a safe integer calculator that a model calls as a tool during rollouts.

The expression text comes from the model, so it is untrusted and may be hostile. The safety choices:

- No `eval`, `exec`, `compile`, `ast` or sympy: a hand-written tokenizer, a shunting-yard pass to postfix
  and an explicit-stack evaluator. Nothing recurses, so deep nesting cannot exhaust the Python stack.
- Bounded work: the length is checked (`len` only) before anything is scanned, every stage is linear in
  the number of tokens, and every value stays below 10**30 in absolute value, so each operation is cheap.
  A power is refused *before* it is computed when its result would pass the bound (`9**9**9` fails at once).
- Syntax is checked in full before any arithmetic, and every failure is a `CalculatorError` with a short
  message meant to be shown to the model as the tool's observation.

Grammar: non-negative decimal integer literals (ASCII digits, at most 30 each), binary `+ - * / // % **`,
unary `-` and `+`, parentheses; spaces, tabs and newlines are ignored. Precedence and associativity are
Python's: `**` binds tighter than a unary minus on its left (`-2**2` is -4) and is right-associative
(`2**3**2` is 512). Values are integers only: `/` and `//` both floor-divide and `%` follows Python's sign rule.
Positions in messages are 0-based character offsets.
"""

from __future__ import annotations

__all__ = ["MAX_CHARS", "MAX_DEPTH", "MAX_DIGITS", "CalculatorError", "calculate"]

MAX_CHARS = 200  # longest accepted expression, in characters
MAX_DIGITS = 30  # longest integer literal, and the bound on every value: |value| < 10**MAX_DIGITS
MAX_DEPTH = 50  # deepest parenthesis nesting

_LIMIT = 10**MAX_DIGITS
_DIGITS = frozenset("0123456789")
_SPACES = frozenset(" \t\r\n")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "u-": 3, "u+": 3, "**": 4}
_RIGHT_ASSOCIATIVE = frozenset({"**"})


class CalculatorError(ValueError):
    """The expression is malformed, too large or undefined (division by zero); the message says which."""


def calculate(expression: str) -> str:
    """The integer value of `expression` as a decimal string, e.g. `calculate("37*48") == "1776"`.

    Raises `CalculatorError` for anything that is not a well-formed expression within the bounds.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression too long: {len(expression)} characters, at most {MAX_CHARS}")
    return str(_evaluate(_to_postfix(_tokenize(expression))))


def _tokenize(expression: str) -> list[tuple[str, int]]:
    """The tokens of `expression` (a literal's digits, an operator or a parenthesis) with their positions."""
    tokens: list[tuple[str, int]] = []
    i, n = 0, len(expression)
    while i < n:
        char = expression[i]
        if char in _SPACES:
            i += 1
        elif char in _DIGITS:
            start = i
            while i < n and expression[i] in _DIGITS:
                i += 1
            if i - start > MAX_DIGITS:
                raise CalculatorError(f"number at position {start} has more than {MAX_DIGITS} digits")
            tokens.append((expression[start:i], start))
        elif expression.startswith(("**", "//"), i):
            tokens.append((expression[i : i + 2], i))
            i += 2
        elif char in "+-*/%()":
            tokens.append((char, i))
            i += 1
        else:
            raise CalculatorError(f"unexpected character {char!r} at position {i}")
    return tokens


def _to_postfix(tokens: list[tuple[str, int]]) -> list[int | str]:
    """Shunting-yard: the tokens in postfix order, literals as ints and unary minus/plus as `u-`/`u+`.

    Checks the syntax in full: operands and operators alternate, parentheses balance and nest at most
    `MAX_DEPTH` deep.
    """
    output: list[int | str] = []
    stack: list[str] = []  # pending operators and "("
    depth = 0
    expect_operand = True
    for text, position in tokens:
        if expect_operand:
            if text[0] in _DIGITS:
                output.append(int(text))
                expect_operand = False
            elif text == "(":
                depth += 1
                if depth > MAX_DEPTH:
                    raise CalculatorError(f"too many nested parentheses (at most {MAX_DEPTH})")
                stack.append(text)
            elif text in ("+", "-"):
                stack.append("u" + text)  # a prefix operator has no left operand, so it pops nothing
            else:
                raise CalculatorError(f"missing operand before {text!r} at position {position}")
        elif text == ")":
            while stack and stack[-1] != "(":
                output.append(stack.pop())
            if not stack:
                raise CalculatorError(f"unbalanced parentheses: unexpected ')' at position {position}")
            stack.pop()
            depth -= 1
        elif text in _PRECEDENCE:
            precedence = _PRECEDENCE[text]
            left_associative = text not in _RIGHT_ASSOCIATIVE
            while stack and stack[-1] != "(":
                top = _PRECEDENCE[stack[-1]]
                if top < precedence or (top == precedence and not left_associative):
                    break
                output.append(stack.pop())
            stack.append(text)
            expect_operand = True
        else:
            raise CalculatorError(f"missing operator before {text!r} at position {position}")
    if expect_operand:
        raise CalculatorError("missing operand at end of expression" if tokens else "empty expression")
    while stack:
        operator = stack.pop()
        if operator == "(":
            raise CalculatorError("unbalanced parentheses: missing ')'")
        output.append(operator)
    return output


def _evaluate(postfix: list[int | str]) -> int:
    """The value of a well-formed postfix sequence, every intermediate value checked against the bound."""
    values: list[int] = []
    for item in postfix:
        if isinstance(item, int):
            values.append(item)
        elif item == "u-":
            values[-1] = -values[-1]
        elif item != "u+":
            right = values.pop()
            values[-1] = _apply(item, values[-1], right)
    return values[0]


def _apply(operator: str, left: int, right: int) -> int:
    """`left operator right` for a binary operator, raising `CalculatorError` past the bound."""
    if operator == "+":
        value = left + right
    elif operator == "-":
        value = left - right
    elif operator == "*":
        value = left * right
    elif operator == "**":
        value = _power(left, right)
    elif right == 0:
        raise CalculatorError("division by zero")
    elif operator == "%":
        value = left % right
    else:  # "/" and "//" both floor-divide
        value = left // right
    if abs(value) >= _LIMIT:
        raise CalculatorError(f"number too large (more than {MAX_DIGITS} digits)")
    return value


def _power(base: int, exponent: int) -> int:
    """`base ** exponent`, refused before computing it when the result would reach the bound.

    With `k = bit_length(|base|) - 1`, `|base| >= 2**k`, so `exponent * k >= bit_length(10**30)` means the
    result is at least `2**100 > 10**30`. Otherwise the result has fewer than 200 bits: cheap to compute,
    and the caller checks it exactly. Bases 0, 1 and -1 pass for any exponent.
    """
    if exponent < 0:
        raise CalculatorError("negative exponent")
    if exponent * (abs(base).bit_length() - 1) >= _LIMIT.bit_length():
        raise CalculatorError(f"number too large (more than {MAX_DIGITS} digits)")
    return base**exponent
