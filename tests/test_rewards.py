"""Built-in checkers on hand-written cases and hostile text; rewards by name or import path; float coercion."""

import math
import time

import pytest

from llm_pg.data.tasks import format_copy, math_hard
from llm_pg.data.tasks.base import Example, RewardError, Score
from llm_pg.data.tasks.rewards import BUILTIN_REWARDS, Reward, resolve_rewards


def check(name: str, completion: str, answer: str) -> Score:
    return BUILTIN_REWARDS[name](completion, Example("p", answer))


@pytest.mark.parametrize(
    ("completion", "answer", "total", "correct"),
    [
        ("\\boxed{12}", "12", 1.1, True),
        ("so it is 12", "12", 0.1, False),  # relaxed: no box, the last number is right
        ("\\boxed{1/2}", "0.5", 1.1, True),
        ("\\boxed{13}", "12", 0.1, False),
        ("twelve", "12", 0.0, False),
    ],
)
def test_boxed_number_is_math_hards_reward(completion, answer, total, correct):
    result = check("boxed_number", completion, answer)
    assert result.total == pytest.approx(total) and result.correct is correct
    assert result == math_hard.score(completion, answer)


@pytest.mark.parametrize(
    ("completion", "answer", "total", "correct"),
    [
        ("<answer>42</answer>", "42", 1.3, True),
        ("Sure: <answer>42</answer>", "42", 1.2, True),  # not tag-only: no clean bonus
        ("<answer>The answer is -7.0</answer>", "-7", 1.3, True),  # last number token of the tag, any gold number
        ("<answer>41</answer>", "42", 0.3, False),
        ("42", "42", 0.0, False),
    ],
)
def test_answer_tag_is_format_copys_parsing_for_any_gold_number(completion, answer, total, correct):
    result = check("answer_tag", completion, answer)
    assert result.total == pytest.approx(total) and result.correct is correct
    assert result == format_copy.score(completion, answer)


@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [
        ("<answer>  Paris </answer>", "Paris", True),
        ("I think <answer>Paris</answer> is it", " Paris\n", True),  # the tag's content, both stripped
        ("  Paris\n", "Paris", True),  # no tag: the whole completion
        ("<answer>paris</answer>", "Paris", False),  # case matters
        ("The answer is Paris", "Paris", False),
        ("<answer>Paris", "Paris", False),  # an unclosed tag is no tag: the whole text is compared
        ("<answer>Rome</answer><answer>Paris</answer>", "Paris", False),  # the first tag counts
    ],
)
def test_exact(completion, answer, correct):
    result = check("exact", completion, answer)
    assert result.correct is correct and result.total == (1.0 if correct else 0.0)


@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [
        ("\\boxed{x + 1}", "x+1", True),  # whitespace deleted from both
        ("so \\boxed{\\frac{1}{2}}.", "\\frac {1} {2}", True),
        ("\\boxed{ 7 }", "The solution is \\boxed{7}.", True),  # a boxed gold is read the same way
        ("\\boxed{7} then \\boxed{8}", "7", False),  # the last box
        ("\\boxed{7} then \\boxed{8", "7", True),  # ... that closes
        ("7", "7", False),  # no box
        ("\\boxed{X+1}", "x+1", False),
    ],
)
def test_boxed_exact(completion, answer, correct):
    result = check("boxed_exact", completion, answer)
    assert result.correct is correct and result.total == (1.0 if correct else 0.0)


HOSTILE = {
    "1 MB of digits": "9" * 1_000_000,
    "100k unclosed answer tags": "<answer>" * 100_000,
    "100k unclosed boxes": "\\boxed{" * 100_000,
    "100k unclosed think tags": "<think>" * 100_000 + "</answer>" * 1000,
    "1 MB of braces": "{" * 500_000 + "}" * 500_000,
    "nested text wrappers": "\\boxed{" + "\\text{" * 50_000 + "1" + "}" * 50_001,
}


@pytest.mark.parametrize("name", sorted(BUILTIN_REWARDS))
@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_builtins_are_fast_and_safe_on_hostile_text(name, text):
    start = time.perf_counter()
    result = BUILTIN_REWARDS[name](text, Example("p", "1"))
    assert time.perf_counter() - start < 1.0
    assert isinstance(result, Score) and math.isfinite(result.total)


def test_float_results_are_correct_at_one():
    def reward(value):
        return Reward("r", "m:r", lambda completion, example: value)("c", Example("p", "1"))

    assert reward(0.7) == Score(0.7, False)
    assert reward(0.1 + 0.2 + 0.7) == Score(0.1 + 0.2 + 0.7, True)  # 0.9999999999999999 counts as 1.0
    assert reward(1.3) == Score(1.3, True)
    assert reward(1) == Score(1.0, True) and isinstance(reward(1).total, float)
    assert reward(False) == Score(0.0, False)
    custom = Score(total=0.4, correct=True, components={"part": 0.4})
    assert reward(custom) == custom  # a Score keeps its own correct


@pytest.mark.parametrize(
    "value", [None, "1.0", [1.0], Score(total="1", correct=True), float("nan"), float("-inf"), Score(math.inf, True)]
)
def test_a_result_that_is_no_finite_number_is_a_reward_error_naming_the_function(value):
    with pytest.raises(RewardError) as info:
        Reward("score", "myrewards:score", lambda completion, example: value)("c", Example("p", "1"))
    message = str(info.value)
    assert "'myrewards:score'" in message and "\n" not in message
    assert repr(value.total if isinstance(value, Score) else value) in message


def test_entries_resolve_by_name_and_import_path(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def score(completion, example):\n    return 0.5\n")
    (tmp_path / "other.py").write_text("def score(completion, example):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = resolve_rewards(["exact", "mine:score", "other:score", "exact"])
    assert [r.name for r in rewards] == ["exact", "score", "score_2", "exact_2"]
    assert [r("c", Example("p", "1")).total for r in rewards[1:3]] == [0.5, 0.25]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["exactly"], "unknown reward 'exactly': use one of boxed_number, answer_tag, exact, boxed_exact"),
        (["no_such_module_xyz:score"], "no module 'no_such_module_xyz' beside the config, in the working directory"),
        (["json:no_such_function"], "has no function 'no_such_function'"),
        (["json:"], "write 'module:function'"),
        ([], "non-empty list"),
        ("exact", "non-empty list"),
    ],
)
def test_bad_entries_are_one_line_errors(entries, message):
    with pytest.raises(ValueError, match=message) as info:
        resolve_rewards(entries)
    assert "\n" not in str(info.value)


def test_a_module_whose_own_import_fails_shows_that_error_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import math\nimport no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as error:
        resolve_rewards(["broken_rewards:score"])
    assert str(error.value) == (
        f"reward 'broken_rewards:score': importing broken_rewards failed: {tmp_path / 'broken_rewards.py'}:2: "
        "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"
    )


def test_a_function_that_raises_is_a_reward_error_naming_it_with_the_cause_kept():
    def score(completion, example):
        return {"a": 1}[example.fields["unit"]]

    with pytest.raises(RewardError) as info:
        Reward("score", "myrewards:score", score)("c", Example("p", "1", {"unit": "mm"}))
    message = str(info.value)
    assert message.startswith("reward function 'myrewards:score' raised KeyError: 'mm' (test_rewards.py:")
    assert "in score)" in message and "\n" not in message
    assert isinstance(info.value.__cause__, KeyError)
