"""math_hard: reward components, the filter on the fixture, lazy loading and the offline error."""

import time
from pathlib import Path

import pytest

from llm_pg.data.tasks import Example, MathHardTask
from llm_pg.data.tasks.math_hard import PROMPT_TEMPLATE, SYSTEM_PROMPT, DatasetUnavailableError, score

FIXTURE = Path(__file__).parent / "fixtures" / "math_sample"
DATA_FILES = {"train": str(FIXTURE / "train.jsonl"), "test": str(FIXTURE / "test.jsonl")}


def fixture_task(**kwargs) -> MathHardTask:
    return MathHardTask(dataset="json", data_files=DATA_FILES, **kwargs)


@pytest.mark.parametrize(
    ("completion", "answer", "components"),
    [
        ("\\boxed{12}", "12", {"correct": 1.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("so it is \\boxed{12.0}", "12", {"correct": 1.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{1,000}", "1000", {"correct": 1.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{0.5}", "\\frac{1}{2}", {"correct": 1.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{\\dfrac{-3}{4}}", "-0.75", {"correct": 1.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{13}", "12", {"correct": 0.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{13} but really 12", "12", {"correct": 0.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("\\boxed{x} so x = 12", "12", {"correct": 0.0, "boxed": 0.1, "numeric": 0.0, "relaxed": 0.1}),
        ("the answer is 12", "12", {"correct": 0.0, "boxed": 0.0, "numeric": 0.0, "relaxed": 0.1}),
        ("the answer is 11", "12", {"correct": 0.0, "boxed": 0.0, "numeric": 0.0, "relaxed": 0.0}),
        ("\\boxed{12", "12", {"correct": 0.0, "boxed": 0.0, "numeric": 0.0, "relaxed": 0.1}),
        ("\\boxed{12}", "x^2", {"correct": 0.0, "boxed": 0.1, "numeric": 0.1, "relaxed": 0.0}),
        ("", "12", {"correct": 0.0, "boxed": 0.0, "numeric": 0.0, "relaxed": 0.0}),
    ],
)
def test_score_components(completion, answer, components):
    result = score(completion, answer)
    assert result.components == pytest.approx(components)
    assert result.total == pytest.approx(sum(components.values()))
    assert result.correct == (components["correct"] == 1.0)
    assert result.total <= 1.5
    assert result.correct or result.total < 1.0


def test_filter_counts_on_fixture():
    task = fixture_task()
    task.prepare()
    assert task.filter_stats == {
        "train": {"seen": 24, "kept": 12, "dropped_level": 5, "dropped_no_boxed": 2, "dropped_non_numeric": 5},
        "test": {"seen": 7, "kept": 4, "dropped_level": 1, "dropped_no_boxed": 1, "dropped_non_numeric": 1},
    }
    gold = ["12", "0.5", "1,000", "-3", "\\frac{1}{2}", "-\\dfrac{3}{4}", "7", "2", "10\\text{ inches}", "\\$18.90"]
    assert [e.answer for e in task.train_examples] == [*gold, "25\\%", "{42}"]
    assert [e.answer for e in task.eval_examples] == ["9", "1.5", "-\\frac{5}{2}", "1,024"]  # dataset order


def test_level_none_keeps_every_level():
    task = fixture_task(level=None)
    assert len(task.train_examples) == 17
    assert task.filter_stats["train"]["dropped_level"] == 0


def test_eval_set_is_deterministic_and_sized():
    first, second = fixture_task(eval_size=2), fixture_task(eval_size=2)
    assert first.eval_examples == second.eval_examples
    assert [e.answer for e in first.eval_examples] == ["9", "1.5"]


def test_prompt_and_messages_follow_the_course():
    task = fixture_task()
    example = task.eval_examples[0]
    assert example.prompt == "What is $10 - 1$?\n\nReturn only: \\boxed{NUMBER}"
    assert PROMPT_TEMPLATE.replace("{problem}", "P") == "P\n\nReturn only: \\boxed{NUMBER}"
    assert task.messages(example) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": example.prompt},
    ]


def test_train_stream_walks_a_seeded_permutation_per_epoch():
    task = fixture_task()
    n = len(task.train_examples)
    epoch0 = [task.train_example(i, seed=3) for i in range(n)]
    epoch1 = [task.train_example(n + i, seed=3) for i in range(n)]
    assert sorted(e.answer for e in epoch0) == sorted(e.answer for e in task.train_examples)
    assert sorted(e.answer for e in epoch1) == sorted(e.answer for e in epoch0)
    assert epoch0 != epoch1
    assert [fixture_task().train_example(i, seed=3) for i in range(n)] == epoch0
    assert [task.train_example(i, seed=4) for i in range(n)] != epoch0


def test_eval_metrics():
    task = fixture_task()
    examples = [Example("p", "12"), Example("p", "12"), Example("p", "12"), Example("p", "12")]
    completions = ["\\boxed{12}", "it is 12", "\\boxed{5}", "nothing"]
    metrics = task.eval_metrics(completions, examples)
    assert metrics == pytest.approx(
        {"exact_match": 0.25, "exact_match_relaxed": 0.5, "has_boxed": 0.5, "reward": 0.375}
    )


def test_loading_is_lazy_and_offline_error_is_clear(monkeypatch):
    import datasets
    import huggingface_hub.constants

    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    task = MathHardTask(dataset="llm-pg-tests/no-such-dataset")  # no data needed to build a config
    start = time.perf_counter()
    with pytest.raises(DatasetUnavailableError) as info:
        task.prepare()
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "llm-pg-tests/no-such-dataset" in message
    assert "HF_DATASETS_OFFLINE" in message and "data_files" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_bad_prompt_template_is_rejected():
    with pytest.raises(ValueError, match="prompt_template"):
        MathHardTask(prompt_template="no placeholder")
