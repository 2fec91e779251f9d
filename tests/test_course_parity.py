"""Differential tests: llm_pg's rewards, parses and data filter equal the course's recorded outputs, row by row.

`fixtures/course_parity.json` holds the course's outputs on several hundred inputs (realistic, adversarial and
fuzzed), recorded by running the course's own code with `fixtures/record_course_outputs.py` (its docstring gives
the command). Rewards are compared with exact float equality, so summation order and float parsing must match.
"""

import json
import math
from pathlib import Path

import pytest

from llm_pg.data.tasks import answers, format_copy, math_hard
from llm_pg.data.tasks.math_data import filter_rows

TABLE = json.loads((Path(__file__).parent / "fixtures" / "course_parity.json").read_text(encoding="utf-8"))


def same_float(ours: float | None, course: float | None) -> bool:
    """Equal as floats down to the bit (nan equals nan, -0.0 differs from 0.0)."""
    return repr(ours) == repr(course)


def test_table_is_large_enough():
    assert len(TABLE["format_copy"]) >= 150 and len(TABLE["math_hard"]) >= 150
    assert len(TABLE["gold"]) >= 60 and len(TABLE["parse_number"]) >= 60


def test_format_copy_reward_equals_the_course():
    mismatches = []
    for row in TABLE["format_copy"]:
        completion, target = row["completion"], str(row["target"])
        result = format_copy.score(completion, target)
        ours = {
            "reward": result.total,
            "has_tag": float(result.components["tags"] > 0),
            "tag_only": float(result.components["clean"] > 0),
            "correct": float(result.correct),
            "content": answers.xml_answer(completion),
            "number": repr(answers.xml_number(completion)),  # repr: bit-exact, and nan equals nan
        }
        course = {key: row[key] for key in ours} | {"number": repr(row["number"])}
        if ours != course:
            mismatches.append((completion[:80], ours, course))
    assert not mismatches, mismatches[:5]


def test_format_copy_components_are_the_weights():
    result = format_copy.score("<think>1</think><ANSWER>42</answer>", "42")
    assert result.components == {"correct": 1.0, "tags": 0.2, "clean": 0.1}
    assert result.total == 0.2 + 0.1 + 1.0 == 1.3  # the course's order of summation


def test_math_hard_reward_equals_the_course():
    mismatches = []
    for row in TABLE["math_hard"]:
        completion = row["completion"]
        result = math_hard.score(completion, repr(row["gold"]))
        ours = {
            "reward": result.total,
            "correct": float(result.correct),
            "relaxed_bonus": float(result.components["relaxed"] > 0),
            "boxed_keyword": float(result.components["boxed"] > 0),
            "has_boxed": float(math_hard.extract_boxed(completion) is not None),
            "boxed_content": math_hard.extract_boxed(completion),
        }
        course = {key: row[key] for key in ours}
        if ours != course or not same_float(answers.last_number(completion), row["last_number"]):
            mismatches.append((completion[:80], ours, course))
    assert not mismatches, mismatches[:5]


def test_math_hard_eval_metrics_follow_the_course_eval():
    """The course's `evaluate` counts a relaxed match when the last number is right even if a wrong box parses
    (unlike the reward's flag), and `has_boxed` when a box closes."""
    task = math_hard.MathHardTask()
    for row in TABLE["math_hard"]:
        example = math_hard.Example("p", repr(row["gold"]))
        metrics = task.eval_metrics([row["completion"]], [example])
        last = row["last_number"]
        relaxed = bool(row["correct"]) or (last is not None and abs(last - row["gold"]) < 1e-6)
        assert metrics["exact_match_relaxed"] == float(relaxed), row["completion"][:80]
        assert metrics["has_boxed"] == row["has_boxed"] and metrics["exact_match"] == row["correct"]
        assert row["correct_relaxed"] == float(row["correct"] or row["relaxed_bonus"])  # the reward's own flag


def test_parse_number_equals_the_course():
    for row in TABLE["parse_number"]:
        ours = answers.parse_number(row["text"])
        if "raises" in row:  # the course's recursion overflows; ours answers without raising
            assert ours is None or ours == 7.0
            continue
        assert same_float(ours, row["value"]), (row["text"][:80], ours, row["value"])


def test_gold_of_each_solution_equals_the_course():
    for row in TABLE["gold"]:
        kept, stats = filter_rows([{"problem": "p", "level": "Level 5", "solution": row["solution"]}], [5])
        ours = kept[0]["gold"] if kept else None
        assert same_float(ours, row["gold"]), (row["solution"][:80], ours, row["gold"], stats)


def test_row_filter_equals_the_course():
    for row in TABLE["rows"]:
        kept, _ = filter_rows([row["row"]], [5])
        assert [r["gold"] for r in kept] == row["kept"], row["row"]
    for case in TABLE["levels"]:
        kept, _ = filter_rows([r["row"] for r in TABLE["rows"]], case["levels"])
        assert len(kept) == len(case["kept"])


def test_none_problem_or_solution_is_our_one_departure():
    none_problem, none_solution = TABLE["departures"]
    assert none_problem["course_kept"] == [1.0]  # the course reads None as the problem text "None"
    assert none_solution["course_kept"] == []  # and the solution "None" has no number: dropped either way
    for case in TABLE["departures"]:
        kept, stats = filter_rows([case["row"]], [5])
        assert kept == [] and stats["dropped_no_problem"] + stats["dropped_no_solution"] == 1


@pytest.mark.parametrize("gold", [1 / 3, 0.1 + 0.2, -2.5, 1e-05, 1e16])
def test_gold_strings_read_back_exactly(gold):
    assert answers.gold_value(repr(gold)) == gold
    assert math.isfinite(gold)
