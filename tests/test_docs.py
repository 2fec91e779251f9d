"""Every Markdown table in README.md and docs/*.md renders: a header, a separator, the same number of cells in every
row, at least one body row, and no second table glued to it (a header and separator inside another table's rows,
which a renderer shows as a broken row of the first)."""

import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def cells(line: str) -> list[str]:
    """The cells of a table row: split on `|` not escaped with a backslash (GFM splits inside code spans too)."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip() for p in parts[1:-1]]


def tables(text: str) -> list[tuple[int, list[str]]]:
    """`(first line number, lines)` of each block of consecutive table lines outside fenced code."""
    found, block, start, fenced = [], [], 0, False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            if not block:
                start = number
            block.append(line.strip())
            continue
        if block:
            found.append((start, block))
            block = []
    return found


def problems(text: str) -> list[str]:
    out = []
    for start, block in tables(text):
        width = len(cells(block[0]))
        if len(block) < 2 or not SEPARATOR.match(block[1]):
            out.append(f"line {start}: no separator row under the header")
            continue
        if len(cells(block[1])) != width:
            out.append(f"line {start}: the separator has {len(cells(block[1]))} cells, the header {width}")
        if len(block) == 2:
            out.append(f"line {start}: a header-only table")
        for offset, row in enumerate(block[2:], 2):
            if SEPARATOR.match(row):
                out.append(f"line {start + offset}: a second table glued to the one at line {start}")
            elif len(cells(row)) != width:
                out.append(f"line {start + offset}: {len(cells(row))} cells, the header has {width}")
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_markdown_table_renders(path: Path):
    assert problems(path.read_text()) == []


def test_the_checker_finds_what_broke_the_docs():
    glued = "| run | em |\n|---|---|\n| a | 1.0 |\n| prompt | completion | reward |\n|---|---|---|\n| p | c | 1.3 |\n"
    assert problems(glued) == [
        "line 4: 3 cells, the header has 2",
        "line 5: a second table glued to the one at line 1",
        "line 6: 3 cells, the header has 2",
    ]
    assert problems("text\n\n| a | b |\n|---|---|\n\nmore") == ["line 3: a header-only table"]
    assert problems("| a | b |\n| x | y |\n") == ["line 1: no separator row under the header"]
    assert problems("| `\\|A\\|` | b |\n|---|---|\n| 1 | 2 |\n") == []  # an escaped pipe is no cell border
    assert problems("```\n| not | a table\n```\n") == []
