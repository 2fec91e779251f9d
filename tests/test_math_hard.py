"""math_hard: reward components, the course's filter on the fixture, data errors, lazy loading, offline error."""

import json
import time
from pathlib import Path

import pytest

from llm_pg.data.tasks import Example, MathHardTask
from llm_pg.data.tasks.math_hard import PROMPT_TEMPLATE, SYSTEM_PROMPT, DataFileError, DatasetUnavailableError, score

FIXTURE = Path(__file__).parent / "fixtures" / "math_sample"
DATA_FILES = {"train": str(FIXTURE / "train.jsonl"), "test": str(FIXTURE / "test.jsonl")}
COURSE = json.loads((FIXTURE.parent / "course_parity.json").read_text(encoding="utf-8"))


def fixture_task(**kwargs) -> MathHardTask:
    return MathHardTask(dataset="json", data_files=DATA_FILES, **kwargs)


@pytest.mark.parametrize(
    ("completion", "answer", "components"),
    [
        ("\\boxed{12}", "12", {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}),
        ("so it is \\boxed{12.0}", "12.0", {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{1,000}", "1000", {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{0.5}", "\\frac{1}{2}", {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{\\dfrac{-3}{4}}", "-0.75", {"correct": 1.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{13}", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{13} but really 12", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.0}),  # a box parsed
        ("\\boxed{x} so x = 12", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.1}),
        ("\\boxed{12\\%}", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.1}),  # `\%` is no number
        ("the answer is 12", "12", {"correct": 0.0, "boxed": 0.0, "relaxed": 0.1}),
        ("the answer is 11", "12", {"correct": 0.0, "boxed": 0.0, "relaxed": 0.0}),
        ("\\boxed{12", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.1}),  # the literal counts unclosed
        ("\\boxed {12}", "12", {"correct": 1.0, "boxed": 0.0, "relaxed": 0.0}),  # a box, but not the literal
        ("\\BOXED{12}", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.1}),  # literal after lower()
        ("<think>\\boxed{12}</think>", "12", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.0}),
        ("\\boxed{12}", "x^2", {"correct": 0.0, "boxed": 0.1, "relaxed": 0.0}),
        ("", "12", {"correct": 0.0, "boxed": 0.0, "relaxed": 0.0}),
    ],
)
def test_score_components(completion, answer, components):
    result = score(completion, answer)
    assert result.components == components
    assert result.total == pytest.approx(sum(components.values()), abs=1e-15)
    assert result.correct == (components["correct"] == 1.0)
    assert result.total <= 1.1 and (result.correct or result.total < 1.0)


def test_totals_are_the_courses_floats():
    assert score("\\boxed{12}", "12").total == 0.1 + 1.0 == 1.1
    assert score("\\boxed{x} 12", "12").total == 0.1 + 0.1 == 0.2


def test_filter_counts_on_fixture():
    task = fixture_task()
    task.prepare()
    zero = {"dropped_no_problem": 0, "dropped_no_solution": 0, "dropped_not_finite": 0}
    assert task.filter_stats == {
        "train": {"seen": 24, "kept": 9, "dropped_level": 5, "dropped_no_boxed": 3, "dropped_non_numeric": 7, **zero},
        "test": {"seen": 7, "kept": 4, "dropped_level": 1, "dropped_no_boxed": 1, "dropped_non_numeric": 1, **zero},
    }
    course = {case["split"]: case["gold"] for case in COURSE["math_sample"]}  # the course's _build_rows, recorded
    assert [float(e.answer) for e in task.train_examples] == course["train"]
    assert [float(e.answer) for e in task.eval_examples] == course["test"] == [9.0, 1.5, -2.5, 1024.0]


def test_empty_levels_keeps_every_level():
    task = fixture_task(levels=[])
    assert len(task.train_examples) == 13
    assert task.filter_stats["train"]["dropped_level"] == 1  # "Level ?" has no level at all


def test_eval_set_is_deterministic_and_sized():
    first, second = fixture_task(eval_size=2), fixture_task(eval_size=2)
    assert first.eval_examples == second.eval_examples
    assert [e.answer for e in first.eval_examples] == ["9.0", "1.5"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_drop_reasons_on_odd_rows(tmp_path):
    rows = [
        {"problem": None, "level": "Level 5", "solution": "\\boxed{1}"},
        {"problem": "p", "level": "Level 5", "solution": None},
        {"problem": "p", "level": "Level 5", "solution": "\\boxed{" + "9" * 400 + "}"},
        {"problem": "p", "level": "Level 5", "solution": "no box"},
        {"problem": "p", "level": "Level 5", "solution": "\\boxed{\\pi}"},
        {"problem": "p", "level": "Level 3", "solution": "\\boxed{1}"},
        {"problem": " p ", "level": "Level 5", "solution": "\\boxed{\\frac{1}{3}}"},
    ]
    files = {"train": write_jsonl(tmp_path / "train.jsonl", rows), "test": write_jsonl(tmp_path / "test.jsonl", rows)}
    task = MathHardTask(dataset="json", data_files=files)
    assert [(e.prompt.split("\n")[0], e.answer) for e in task.eval_examples] == [("p", repr(1 / 3))]
    assert task.filter_stats["test"] == {
        "seen": 7,
        "kept": 1,
        "dropped_level": 1,
        "dropped_no_problem": 1,
        "dropped_no_solution": 1,
        "dropped_no_boxed": 1,
        "dropped_non_numeric": 1,
        "dropped_not_finite": 1,
    }


def test_empty_eval_set_names_split_dataset_and_counts(tmp_path):
    train = [{"problem": "p", "level": "Level 5", "solution": "\\boxed{1}"}]
    test = [{"problem": "p", "level": "Level 3", "solution": "\\boxed{1}"}]
    files = {"train": write_jsonl(tmp_path / "train.jsonl", train), "test": write_jsonl(tmp_path / "test.jsonl", test)}
    with pytest.raises(ValueError) as info:
        MathHardTask(dataset="json", data_files=files).prepare()  # fails before any training
    message = str(info.value)
    assert "'test'" in message and "'json'" in message and "'dropped_level': 1" in message and "\n" not in message


@pytest.mark.parametrize("content", ["", "this is not json\n{"])
@pytest.mark.parametrize("bad_split", ["train", "test"])
def test_unreadable_data_file_is_one_line_naming_it(tmp_path, content, bad_split):
    good = [{"problem": "p", "level": "Level 5", "solution": "\\boxed{1}"}]
    files = {split: write_jsonl(tmp_path / f"{split}.jsonl", good) for split in ("train", "test")}
    (tmp_path / f"{bad_split}.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(DataFileError) as info:
        MathHardTask(dataset="json", data_files=files).prepare()
    message = str(info.value)
    assert files[bad_split] in message and "\n" not in message
    other = "test" if bad_split == "train" else "train"
    assert files[other] not in message


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
        {"exact_match": 0.25, "exact_match_relaxed": 0.5, "has_boxed": 0.5, "reward": (1.1 + 0.1 + 0.1) / 4}
    )
    scores = [task.score(c, e) for c, e in zip(completions, examples, strict=True)]
    assert task.eval_metrics(completions, examples, scores) == metrics  # the evaluation's scores: the same metrics


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
