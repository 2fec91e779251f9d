"""Safe answer checking for the boxed-number tasks (math_hard, arith).

Completions are untrusted text. Nothing here evaluates them: numbers are read by a small grammar into
exact `fractions.Fraction` values, every step is linear in the input, and inputs past a length limit
are rejected rather than computed, so `9^9^9^9` or a 100,000-digit number costs microseconds.

Accepted number forms (after stripping `$`, `\\$`, `\\%`, `^\\circ`, `\\left`/`\\right`, spacing macros,
unit text such as `\\text{ cm}` and one layer of outer braces):

    12   -3   +4   12.0   .5   1,000   1,234.5   3/4   \\frac{1}{2}   \\dfrac{-3}{4}   -\\tfrac{3}{4}
    \\frac12   2\\frac{1}{2} (mixed number, 5/2)   \\text{5}

Anything else (expressions, intervals, roots, powers, `x=5`) is not a number and parses to None.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_SCAN_CHARS = 100_000  # extract_boxed reads only this many trailing characters
MAX_ANSWER_CHARS = 100  # longer boxed contents are not numbers we accept
MAX_NUMBER_CHARS = 40  # longest plain numeric token read by last_number

_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)[ \t\n]*\{|[{}]")
_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[!,;: ]|\\?\$|\\?%|\^\{?\\circ\}?|\\circ|°")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\{([^{}]*)\}")
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(rf"([+-]?){_UNSIGNED}")
_FRAC = re.compile(rf"([+-]?)(\d*)\\[dt]?frac(?:\{{([+-]?{_UNSIGNED})\}}\{{([+-]?{_UNSIGNED})\}}|(\d)(\d))")
_SLASH = re.compile(rf"([+-]?{_UNSIGNED})/([+-]?{_UNSIGNED})")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance, else None.

    "Last" means the latest-starting box that closes: in `\\boxed{5} then \\boxed{6` the second never
    closes, so the answer is `5`; in `\\boxed{\\boxed{7}}` it is `7`. One left-to-right pass over brace
    tokens with a stack of open braces (each marked with where its box content starts, if it opens a
    box): linear time, no regex backtracking, no re-scan from each `\\boxed{`. Raw braces count, as in
    the MATH reference parser, so `\\{1,2\\}` balances like `{1,2}`. Only the last `MAX_SCAN_CHARS`
    characters are read (a 512-token completion is about 2,000).
    """
    text = text[-MAX_SCAN_CHARS:]
    starts = [i for i in (text.find("\\boxed"), text.find("\\fbox")) if i >= 0]
    if not starts:
        return None
    open_braces: list[int | None] = []  # content start of a box opener, None for a plain "{"
    best: tuple[int, int] | None = None  # (content start, content end) of the latest-starting closed box
    for match in _BOX_TOKEN.finditer(text, min(starts)):
        token = match.group()
        if token == "{":
            open_braces.append(None)
        elif token != "}":
            open_braces.append(match.end())
        elif open_braces:  # a "}" with nothing open is ignored
            content_start = open_braces.pop()
            if content_start is not None and (best is None or content_start > best[0]):
                best = (content_start, match.start())
    return None if best is None else text[best[0] : best[1]].strip()


def _normalize(text: str) -> str | None:
    """Strip formatting that does not change the value; None when the text cannot be a number."""
    if len(text) > MAX_ANSWER_CHARS or re.search(r"\d\s+\d", text):  # "2 1/2" or "1 000" are ambiguous
        return None
    text = _TEXT.sub(lambda m: m.group(1) if any(c.isdigit() for c in m.group(1)) else "", text)
    text = "".join(_DROP.sub("", text).split())
    while len(text) >= 2 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    return text


def _unsigned(token: str) -> Fraction:
    return Fraction(token.replace(",", ""))  # Fraction reads "1234.5" and ".5" exactly


def _signed(token: str) -> Fraction:
    return -_unsigned(token[1:]) if token.startswith("-") else _unsigned(token.lstrip("+"))


def _ratio(numerator: str, denominator: str) -> Fraction | None:
    den = _signed(denominator)
    return None if den == 0 else _signed(numerator) / den


def _parse_frac(match: re.Match[str]) -> Fraction | None:
    sign, whole, num, den, short_num, short_den = match.groups()
    value = _ratio(num or short_num, den or short_den)
    if value is None or (whole and value < 0):  # "2\frac{-1}{2}" is not a mixed number
        return None
    value += int(whole or 0)
    return -value if sign == "-" else value


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written in `text` (see the module docstring), or None.

    Never raises and never evaluates the text; input longer than `MAX_ANSWER_CHARS` is rejected.
    """
    normalized = _normalize(text)
    if not normalized:
        return None
    if _NUMBER.fullmatch(normalized):
        return _signed(normalized)
    if match := _FRAC.fullmatch(normalized):
        return _parse_frac(match)
    if match := _SLASH.fullmatch(normalized):
        return _ratio(match.group(1), match.group(2))
    return None


def last_number(text: str) -> Fraction | None:
    """The last plain number in `text` (`-12`, `1,000`, `3.5`), for the relaxed exact-match metric.

    Found with ten `str.rfind` calls and a bounded backward walk (at most `MAX_NUMBER_CHARS`), so it is
    linear at worst; a numeric run longer than that is rejected (None). Commas that are not thousands
    separators split numbers: the last number of `1,2,3` is 3. Fractions are not read here.
    """
    end = max(text.rfind(digit) for digit in "0123456789")
    if end < 0:
        return None
    start = end
    while start > 0 and text[start - 1] in "0123456789.,":
        start -= 1
        if end - start >= MAX_NUMBER_CHARS:
            return None
    token = text[start : end + 1].lstrip(".,")
    if not _NUMBER.fullmatch(token):
        token = token.rsplit(",", 1)[-1]
    if not _NUMBER.fullmatch(token):
        return None
    value = _unsigned(token)
    return -value if start > 0 and text[start - 1] == "-" else value


def numbers_equal(predicted: str | None, gold: str) -> bool:
    """True when both strings parse to the same exact number (`12` = `12.0`, `\\frac{1}{2}` = `0.5`)."""
    if predicted is None:
        return False
    value = parse_number(predicted)
    return value is not None and value == parse_number(gold)
