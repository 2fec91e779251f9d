"""format_copy: reward components, prompts, deterministic streams, adversarial input."""

import time
from dataclasses import replace

import pytest

from llm_pg.data.tasks import Example, FormatCopyTask
from llm_pg.data.tasks.format_copy import SYSTEM_PROMPT, score


@pytest.mark.parametrize(
    ("completion", "components"),
    [
        ("<answer>42</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),
        ("  <answer> 42 </answer>\n", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),
        ("Sure! <answer>42</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.0}),
        ("<answer>42</answer> done", {"correct": 1.0, "tags": 0.2, "clean": 0.0}),
        ("<answer>43</answer>", {"correct": 0.0, "tags": 0.2, "clean": 0.1}),
        ("<answer>42.0</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),  # numbers compare as floats
        ("<answer>The answer is 42</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),  # last number
        ("<answer>42 or 43</answer>", {"correct": 0.0, "tags": 0.2, "clean": 0.1}),
        ("<ANSWER>42</Answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),  # tags are case-insensitive
        ("<think>41?</think> <answer>42</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),
        ("<answer>42</answer><answer>7</answer>", {"correct": 1.0, "tags": 0.2, "clean": 0.1}),  # first tag
        ("<answer>7</answer>, <answer>42</answer>", {"correct": 0.0, "tags": 0.2, "clean": 0.1}),
        ("</answer>42<answer>", {"correct": 0.0, "tags": 0.0, "clean": 0.0}),
        ("<answer>42", {"correct": 0.0, "tags": 0.0, "clean": 0.0}),
        ("42", {"correct": 0.0, "tags": 0.0, "clean": 0.0}),
        ("", {"correct": 0.0, "tags": 0.0, "clean": 0.0}),
    ],
)
def test_score_components(completion, components):
    result = score(completion, "42")
    assert result.components == components
    assert result.total == pytest.approx(sum(components.values()), abs=1e-15)
    assert result.correct == (components["correct"] == 1.0)


def test_negative_targets_and_maximum():
    assert score("<answer>-4999</answer>", "-4999").total == 1.3
    assert score("<answer>+7</answer>", "7").correct
    assert not score("<answer>7</answer>", "not an integer").correct  # an unreadable target never matches


def test_course_prompt_by_default():
    task = FormatCopyTask()
    example = task.eval_examples[0]
    assert example.prompt == f"Copy this integer exactly: {example.answer}"
    assert task.messages(example) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": example.prompt},
    ]
    assert len(task.eval_examples) == 64


def test_eval_set_is_the_courses():
    """The course reseeds its task generator with `seed + 123` and draws 64 `randint(-5000, 5000)` targets;
    its first four for run seeds 0 and 5 (recorded from the course's FormatCopyTask) are pinned here."""
    task = FormatCopyTask()
    assert [e.answer for e in task.eval_examples[:4]] == ["-4143", "-615", "-3572", "1672"]  # seed 0 until bound
    task.bind_seed(5)  # the datamodule binds the run's seed: eval seed 128
    assert [e.answer for e in task.eval_examples[:4]] == ["-1123", "1646", "3380", "963"]
    explicit = FormatCopyTask(eval_seed=123)
    explicit.bind_seed(5)  # an explicit eval_seed wins over the run's seed
    assert explicit.eval_examples == FormatCopyTask().eval_examples


def test_tiny_variant():
    task = FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")
    example = task.train_example(0, seed=0)
    assert example.prompt == f"Copy: {example.answer}"
    assert task.messages(example) == [{"role": "user", "content": example.prompt}]
    assert task.score(f"<answer>{example.answer}</answer>", example).total == pytest.approx(1.3)
    assert all(-999 <= int(task.train_example(i, seed=1).answer) <= 999 for i in range(200))
    assert [e.answer for e in task.eval_examples[:3]] == ["-892", "-451", "-821"]  # Random(123), its own range


def test_streams_are_pure_functions_of_their_seeds():
    first, second = FormatCopyTask(), FormatCopyTask()
    assert first.eval_examples == second.eval_examples
    assert first.eval_examples != FormatCopyTask(eval_seed=7).eval_examples
    assert first.train_example(17, seed=5) == second.train_example(17, seed=5)
    assert [first.train_example(i, seed=5) for i in range(8)] != [first.train_example(i, seed=6) for i in range(8)]
    assert len({first.train_example(i, seed=0).answer for i in range(100)}) > 90


def test_eval_metrics():
    task = FormatCopyTask()
    examples = [Example("p", "1"), Example("p", "2"), Example("p", "3"), Example("p", "4")]
    completions = ["<answer>1</answer>", "x <answer>2</answer>", "<answer>9</answer>", "4"]
    metrics = task.eval_metrics(completions, examples)
    assert metrics == pytest.approx({"exact_match": 0.5, "reward": 0.7, "has_tag": 0.75, "tag_only": 0.5})
    # Given the scores (as the evaluation passes them), the same metrics, from those scores and no others.
    scores = [task.score(c, e) for c, e in zip(completions, examples, strict=True)]
    assert task.eval_metrics(completions, examples, scores) == metrics
    assert task.eval_metrics(completions, examples, [replace(scores[0], correct=True)] * 4)["exact_match"] == 1.0
    with pytest.raises(ValueError, match="eval_metrics got 3 scores for 4 completions"):
        task.eval_metrics(completions, examples, scores[:3])


def test_invalid_arguments():
    with pytest.raises(ValueError, match="low must be <= high"):
        FormatCopyTask(low=5, high=4)
    with pytest.raises(ValueError, match="prompt_template"):
        FormatCopyTask(prompt_template="Copy this")
    with pytest.raises(ValueError, match="eval_size"):
        FormatCopyTask(eval_size=0)


def test_adversarial_inputs_are_fast():
    texts = ["<answer>" * 200_000, "<answer>" + "9" * 1_000_000 + "</answer>", "a" * 1_000_000 + "</answer>"]
    for text in texts:
        start = time.perf_counter()
        result = score(text, "42")
        assert time.perf_counter() - start < 1.0
        assert not result.correct
