"""Answer parsing for the tasks, equal to the course's `hw4/utils/answer_parsing.py` on every input, in linear time.

Completions are untrusted text: nothing here evaluates them, every scan is a single pass, and no call raises.
The values are those of the course, including its choices (tested against its recorded outputs in
`tests/fixtures/course_parity.json`):

- Tags are matched case-insensitively with Python's Unicode `re.IGNORECASE` rules (the Kelvin sign matches
  `k`, `ſ` matches `s`). `<think>...</think>` blocks are removed first (leftmost, shortest, non-overlapping),
  then every case-sensitive `</think>` left over, then the text is stripped.
- A number is read with floats: `\\$`, `$`, `,`, `\\left`, `\\right` are deleted, one outer brace pair and
  `\\text{...}` / `\\mathrm{...}` wrappers are peeled, then the whole text must be a plain number (`12`, `-3.5`,
  `.5`; `\\d` is any Unicode digit), `a/b`, `a b/c`, `\\frac{a}{b}` (also `dfrac`, `tfrac`, signed) or a mixed
  `w\\frac{a}{b}`, with integers a, b; a zero denominator gives None; a mixed number takes the sign of its whole
  part. Nothing else is a number: `12\\%`, `90^\\circ`, `12 \\text{ cm}`, `\\frac12` all give None.

Where the course is slower than linear we get the same answer in one pass: the course rescans from every
`<answer>`, `<think>` and `\\boxed{` to the end of the text; we pair tags and braces left to right. The one
place we may differ: `\\text{\\text{...}}` peeling is the course's recursion (which raises RecursionError
past about a thousand levels and is quadratic in the depth); we peel in a loop and give up with None once
the peeled text totals `MAX_PEEL_CHARS`, which no course-readable answer of sane size reaches.
"""

from __future__ import annotations

import re

import numpy as np

MAX_PEEL_CHARS = 8_000_000  # total characters re-read while peeling nested \text{} wrappers

# Case-insensitive literal tags: re's IGNORECASE gives the course's Unicode case rules.
_THINK_OPEN = re.compile(re.escape("<think>"), re.IGNORECASE)
_THINK_CLOSE = re.compile(re.escape("</think>"), re.IGNORECASE)
_ANSWER_OPEN = re.compile(re.escape("<answer>"), re.IGNORECASE)
_ANSWER_CLOSE = re.compile(re.escape("</answer>"), re.IGNORECASE)
_BOX_OPEN = re.compile(r"\\boxed\s*\{")  # case-sensitive, as the course

# A number token in running text: `1,234.5`, `-12`, `3` (thousands groups are optional).
NUMBER_TOKEN = re.compile(r"[-+]?(?:\d+(?:,\d{3})*|\d+)(?:\.\d+)?")
_INT = r"([-+]?\d+)"
_FRAC = rf"\\(?:frac|dfrac|tfrac)\s*\{{\s*{_INT}\s*\}}\s*\{{\s*{_INT}\s*\}}"  # \frac{a}{b}, integers a, b
_SIGNED_FRAC = re.compile(rf"([+-]?)\s*{_FRAC}")
_MIXED_FRAC = re.compile(rf"{_INT}\s*{_FRAC}")
_MIXED_SLASH = re.compile(rf"{_INT}\s+{_INT}\s*/\s*{_INT}")
_SLASH = re.compile(rf"{_INT}\s*/\s*{_INT}")
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")
_WRAPPER = re.compile(r"\\(?:text|mathrm)\s*\{(.*)\}", re.DOTALL)


def strip_think(text: str) -> str:
    """`text` without `<think>...</think>` blocks and stray `</think>` tags, stripped.

    A block runs from the leftmost `<think>` to the first `</think>` after it; the search resumes after that.
    An unclosed `<think>` is kept. Each tag search starts where the last ended, so the pass is linear.
    """
    kept, position = [], 0
    while (opener := _THINK_OPEN.search(text, position)) and (closer := _THINK_CLOSE.search(text, opener.end())):
        kept.append(text[position : opener.start()])
        position = closer.end()
    kept.append(text[position:])
    return "".join(kept).replace("</think>", "").strip()  # the leftover tag is removed case-sensitively


def xml_answer(text: str) -> str | None:
    """The stripped text between the first `<answer>` and the first `</answer>` after it, else None.

    Tags are case-insensitive and `text` is read after `strip_think`.
    """
    cleaned = strip_think(text)
    opener = _ANSWER_OPEN.search(cleaned)
    closer = _ANSWER_CLOSE.search(cleaned, opener.end()) if opener else None
    return None if closer is None else cleaned[opener.end() : closer.start()].strip()


def is_xml_only(text: str) -> bool:
    """True when the think-stripped text starts with `<answer>` and ends with a separate `</answer>`."""
    cleaned = strip_think(text)
    tail = len(cleaned) - len("</answer>")
    return (
        tail >= len("<answer>")
        and _ANSWER_OPEN.match(cleaned) is not None
        and _ANSWER_CLOSE.match(cleaned, tail) is not None
    )


def xml_number(text: str) -> float | None:
    """The number in the `<answer>` tag: the whole content if it is one, else its last number token."""
    content = xml_answer(text)
    if content is None:
        return None
    value = parse_number(content)
    return value if value is not None else _last_token_value(content)


def last_number(text: str) -> float | None:
    """The value of the last number token (`NUMBER_TOKEN`) of the think-stripped text, else None."""
    return _last_token_value(strip_think(text))


def _last_token_value(text: str) -> float | None:
    tokens = NUMBER_TOKEN.findall(text)
    return parse_number(tokens[-1]) if tokens else None


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last-starting `\\boxed{...}` (`\\boxed {` too) whose brace closes, else None.

    Read after `strip_think`. Every raw `{` and `}` counts, as in the course, so `\\{1,2\\}` balances like
    `{1,2}`; in `\\boxed{5} then \\boxed{6` the second never closes, so the answer is `5`. The brace at
    position p closes at the first later position where the running brace depth falls back to its depth
    before p; with the depth and its suffix minimum computed once (vectorised), each box is an O(1) test.
    """
    cleaned = strip_think(text)
    braces = [match.end() - 1 for match in _BOX_OPEN.finditer(cleaned)]  # each box's "{"
    if not braces:
        return None
    codes = np.array([cleaned]).view(np.uint32)  # [n] code points (a 4-byte-per-char string, no codec)
    depth = np.cumsum((codes == ord("{")).astype(np.int64) - (codes == ord("}")))  # [n] depth after char i
    lowest_after = np.minimum.accumulate(depth[::-1])[::-1]  # [n] min(depth[i:])
    for brace in reversed(braces):
        outside = depth[brace] - 1  # the depth just before this box's "{"
        if brace + 1 < len(depth) and lowest_after[brace + 1] <= outside:
            close = brace + 1 + int(np.argmax(depth[brace + 1 :] <= outside))  # depth moves by 1: first hit is "}"
            return cleaned[brace + 1 : close].strip()
    return None


def boxed_number(text: str) -> float | None:
    """`parse_number` of `extract_boxed(text)`; None without a closed box."""
    content = extract_boxed(text)
    return None if content is None else parse_number(content)


def gold_value(answer: str) -> float | None:
    """A gold answer string as a float: `float(answer)` (so `repr(x)` reads back as exactly x), else
    `parse_number(answer)` (so `\\frac{1}{2}` works too), else None."""
    try:
        return float(answer)
    except ValueError:
        return parse_number(answer)


def _ratio(numerator: str, denominator: str) -> float | None:
    den = float(denominator)
    return None if abs(den) < 1e-12 else float(numerator) / den


def _mixed(whole_text: str, numerator: str, denominator: str) -> float | None:
    """`w a/b` as `w + |a/b|`, or `w - |a/b|` when w is negative."""
    ratio = _ratio(numerator, denominator)
    if ratio is None:
        return None
    whole = float(whole_text)
    return whole - abs(ratio) if whole < 0 else whole + abs(ratio)


def _unwrap(text: str) -> str:
    """One normalisation round: strip, delete `\\$ $ , \\left \\right`, peel one outer brace pair."""
    text = text.strip().replace("\\$", "").replace("$", "").replace(",", "")
    text = text.replace("\\left", "").replace("\\right", "").strip()
    if len(text) >= 2 and text[0] == "{" and text[-1] == "}" and text[1:-1].strip():
        text = text[1:-1].strip()
    return text


def parse_number(text: str) -> float | None:
    """The float value of `text` when the whole text is one number (see the module docstring), else None.

    Float arithmetic as the course does it: `\\frac{1}{3}` is `1.0 / 3.0`, `"9" * 400` is inf. Never raises.
    """
    peeled = 0
    text = _unwrap(text)
    while match := _WRAPPER.fullmatch(text):  # \text{...} and \mathrm{...} are read again from the start
        peeled += len(text)
        if peeled > MAX_PEEL_CHARS:
            return None
        text = _unwrap(match.group(1))
    if not text:
        return None
    if "\\" in text:  # only the fraction forms hold a backslash (the checks skip regexes that cannot match)
        return _parse_fraction(text)
    if "/" in text:
        if match := _MIXED_SLASH.fullmatch(text):
            return _mixed(*match.groups())
        match = _SLASH.fullmatch(text)
        return None if match is None else _ratio(*match.groups())
    return float(text) if _PLAIN.fullmatch(text) else None


def _parse_fraction(text: str) -> float | None:
    """`[+-]\\frac{a}{b}` (also `dfrac`, `tfrac`) or the mixed `w\\frac{a}{b}`, else None."""
    if match := _SIGNED_FRAC.fullmatch(text):
        ratio = _ratio(match.group(2), match.group(3))
        return None if ratio is None else (-1.0 if match.group(1) == "-" else 1.0) * ratio
    match = _MIXED_FRAC.fullmatch(text)
    return None if match is None else _mixed(*match.groups())
