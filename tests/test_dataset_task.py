"""DatasetTask: column mapping, template filling, the held-out slice, data errors in one line, weighted rewards."""

import json

import pytest

from llm_pg.data.tasks import DatasetTask, Example, RewardError
from llm_pg.data.tasks import dataset as dataset_module

ROWS = [{"question": f"What is {i} cm in mm?", "answer": f" {10 * i} ", "unit": "mm", "id": i} for i in range(20)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def task_on(tmp_path, rows=ROWS, **kwargs):
    kwargs.setdefault("data_files", write_jsonl(tmp_path / "rows.jsonl", rows))
    return DatasetTask(dataset="json", **kwargs)


def test_columns_map_to_prompt_answer_and_fields(tmp_path):
    task = task_on(tmp_path, prompt_column="question", eval_size=4)
    example = next(e for e in task.train_examples if e.fields["id"] == 3)
    assert example == Example("What is 3 cm in mm?", "30", {"unit": "mm", "id": 3})
    assert task.messages(example) == [{"role": "user", "content": "What is 3 cm in mm?"}]
    assert task.components == ("exact",)


def test_template_fills_columns_and_keeps_them_in_fields(tmp_path):
    task = task_on(tmp_path, prompt_template="Convert: {question} Answer in {unit}. {{no column}}", eval_size=4)
    example = next(e for e in task.train_examples if e.fields["id"] == 2)
    assert example.prompt == "Convert: What is 2 cm in mm? Answer in mm. {no column}"
    assert example.answer == "20" and example.fields == {"question": "What is 2 cm in mm?", "unit": "mm", "id": 2}


def test_system_prompt_and_default_prompt_column(tmp_path):
    rows = [{"prompt": "Copy: 5", "answer": 5}, {"prompt": "Copy: 6", "answer": 6}]
    task = task_on(tmp_path, rows, system_prompt="Be brief.", eval_size=1)  # no prompt_column: the column prompt
    (example,) = task.train_examples
    assert example.prompt in ("Copy: 5", "Copy: 6") and example.answer == example.prompt[-1]
    assert task.messages(example) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": example.prompt},
    ]


def test_held_out_slice_is_seeded_disjoint_and_deterministic(tmp_path):
    def split(seed, **kwargs):
        task = task_on(tmp_path, prompt_column="question", eval_size=5, **kwargs)
        task.bind_seed(seed)
        return [e.fields["id"] for e in task.train_examples], [e.fields["id"] for e in task.eval_examples]

    train, held = split(7)
    assert len(held) == 5 and len(train) == 15 and sorted(train + held) == list(range(20))
    assert split(7) == (train, held)  # same seed, same slice (in file order)
    assert held == sorted(held) and train == sorted(train)
    assert split(8)[1] != held
    assert split(8, eval_seed=7) == split(9, eval_seed=7) == (train, held)  # eval_seed fixes it across run seeds

    task = task_on(tmp_path, prompt_column="question", eval_size=5)
    task.bind_seed(7)
    stream = {task.train_example(i, seed=7).fields["id"] for i in range(15)}
    assert stream == set(train)  # one epoch of the stream walks the training rows, never a held-out one
    task.bind_seed(8)  # a new run seed re-slices
    assert [e.fields["id"] for e in task.eval_examples] == split(8)[1]


def test_eval_split_is_the_first_rows_of_its_file(tmp_path):
    files = {
        "train": write_jsonl(tmp_path / "train.jsonl", ROWS[:10]),
        "test": write_jsonl(tmp_path / "t.jsonl", ROWS[10:]),
    }
    task = DatasetTask(dataset="json", data_files=files, eval_split="test", prompt_column="question", eval_size=3)
    assert [e.fields["id"] for e in task.eval_examples] == [10, 11, 12]
    assert sorted(e.fields["id"] for e in task.train_examples) == list(range(10))


def test_csv_and_parquet_load_the_same_rows(tmp_path):
    import pandas as pd

    frame = pd.DataFrame(ROWS)
    frame.to_csv(tmp_path / "rows.csv", index=False)
    frame.to_parquet(tmp_path / "rows.parquet")
    for builder, name in (("csv", "rows.csv"), ("parquet", "rows.parquet")):
        task = DatasetTask(dataset=builder, data_files=str(tmp_path / name), prompt_column="question", eval_size=2)
        assert {e.fields["id"] for e in task.train_examples + task.eval_examples} == set(range(20))


def test_prepare_is_idempotent_and_loads_once(tmp_path, monkeypatch):
    calls = []
    real = dataset_module.load_split
    monkeypatch.setattr(dataset_module, "load_split", lambda *a, **k: calls.append(a) or real(*a, **k))
    task = task_on(tmp_path, prompt_column="question", eval_size=4)
    task.prepare()
    task.prepare()
    task.train_example(3, seed=0)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("content", "kwargs", "message"),
    [
        (None, {"data_files": "missing.jsonl"}, "data file 'missing.jsonl' not found"),
        (b"", {}, "is empty"),
        (b"not json {\n", {}, "could not read"),
        ('{"question": "caf\xe9", "answer": 1}\n'.encode("latin-1"), {}, "could not read.*not UTF-8"),
        (b'{"q": "x", "answer": 1}\n', {}, "names column 'question', which split 'train' of"),
        (b'{"question": "x", "n": 1}\n', {}, "answer_column names column 'answer'"),
        (b'{"question": "x", "answer": null}\n', {}, "row 0 of split 'train'.*has no answer_column value"),
        (b'{"question": "x", "answer": 1}\n', {"eval_size": 1}, "eval_size 1 leaves no training rows of the 1"),
        (b"[]", {}, "has no rows|could not read"),
        (b'{"question": "x", "answer": 1}\n', {"eval_split": "test"}, "split 'test' is not a key of data_files"),
    ],
)
def test_data_problems_are_one_line_errors_naming_file_or_column(tmp_path, content, kwargs, message):
    path = tmp_path / "rows.jsonl"
    if content is not None:
        path.write_bytes(content)
    if "eval_split" in kwargs:
        kwargs["data_files"] = {"train": str(path)}
    kwargs.setdefault("data_files", str(path))
    task = DatasetTask(dataset="json", prompt_column="question", **kwargs)  # nothing loads yet
    with pytest.raises(ValueError, match=message) as info:
        task.prepare()
    text = str(info.value)
    assert "\n" not in text
    assert ("rows.jsonl" in text or "missing.jsonl" in text) or "data_files" in text


def test_a_file_builder_without_data_files_is_one_line():
    with pytest.raises(ValueError, match="dataset 'csv' reads data_files: give e"):
        DatasetTask(dataset="csv").prepare()


def test_template_problems_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="literal braces"):
        task_on(tmp_path, prompt_template="Solve {question")
    with pytest.raises(ValueError, match="without a column name"):
        task_on(tmp_path, prompt_template="Solve {}")
    with pytest.raises(ValueError, match="not both"):
        task_on(tmp_path, prompt_template="{question}", prompt_column="question")
    task = task_on(tmp_path, prompt_template="Solve {question}, answer as \\boxed{NUMBER}")
    with pytest.raises(ValueError, match=r"prompt_template names column 'NUMBER'.*columns: question, answer, unit, id"):
        task.prepare()
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2 rewards"):
        task_on(tmp_path, rewards=["exact", "answer_tag"], reward_weights=[1.0])


def test_weights_combine_components_and_the_first_entry_decides_correct(tmp_path, monkeypatch):
    (tmp_path / "unit_rewards.py").write_text(
        "def has_unit(completion, example):\n    return 0.3 if example.fields['unit'] in completion else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = task_on(
        tmp_path,
        prompt_column="question",
        rewards=["answer_tag", "unit_rewards:has_unit", "exact"],
        reward_weights=[1.0, 0.5, 2.0],
        eval_size=2,
    )
    example = Example("p", "30", {"unit": "mm"})
    result = task.score("<answer>30</answer> mm", example)
    # answer_tag: tags 0.2 + correct 1.0 (not tag-only: no 0.1); has_unit 0.3; exact: the tag holds "30"
    assert result.components == pytest.approx({"answer_tag": 1.2, "has_unit": 0.5 * 0.3, "exact": 2.0 * 1.0})
    assert result.total == pytest.approx(1.2 + 0.15 + 2.0) and result.correct is True
    assert task.components == ("answer_tag", "has_unit", "exact")
    wrong = task.score("<answer>31</answer>", example)
    assert wrong.correct is False and wrong.total == pytest.approx(0.2 + 0.1)  # the tag only


def test_user_function_exceptions_and_nan_are_reward_errors_naming_the_entry(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(
        "def boom(completion, example):\n    raise KeyError('unit')\n\n"
        "def nan(completion, example):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"'bad_rewards:boom' raised KeyError: 'unit' \(bad_rewards.py:2 in boom\)"):
        task_on(tmp_path, rewards=["bad_rewards:boom"]).score("c", Example("p", "1"))
    with pytest.raises(RewardError, match="'bad_rewards:nan' returned nan"):
        task_on(tmp_path, rewards=["exact", "bad_rewards:nan"]).score("1", Example("p", "1"))


def test_eval_metrics_are_the_first_entrys_exact_match_and_each_entrys_mean(tmp_path):
    task = task_on(tmp_path, prompt_column="question", rewards=["answer_tag", "exact"], reward_weights=[1.0, 0.5])
    examples = [Example("p", "30"), Example("p", "30"), Example("p", "7")]
    completions = ["<answer>30</answer>", "<answer>30</answer> mm", "7"]  # 1.3 + 0.5, 1.2 + 0.5, 0 + 0.5
    metrics = task.eval_metrics(completions, examples)
    assert metrics == pytest.approx(
        {
            "exact_match": 2 / 3,
            "reward": (1.8 + 1.7 + 0.5) / 3,
            "reward_answer_tag": (1.3 + 1.2) / 3,
            "reward_exact": 0.5,
        }
    )


def test_relative_files_and_patterns_are_found_beside_the_config(tmp_path, monkeypatch):
    from llm_pg.data import user_code

    (tmp_path / "exp" / "parts").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    write_jsonl(tmp_path / "exp" / "parts" / "a.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "exp" / "parts" / "b.jsonl", ROWS[4:8])
    write_jsonl(tmp_path / "exp" / "test.jsonl", ROWS[8:10])
    monkeypatch.chdir(tmp_path / "run")
    monkeypatch.setattr(user_code, "_lookup_dirs", [str(tmp_path / "exp"), str(tmp_path / "run")])
    files = {"train": "parts/*.jsonl", "test": "test.jsonl"}
    task = DatasetTask(data_files=files, eval_split="test", prompt_column="question", eval_size=2)
    assert sorted(e.fields["id"] for e in task.train_examples) == list(range(8))
    assert [e.fields["id"] for e in task.eval_examples] == [8, 9]
    with pytest.raises(ValueError, match=r"data file 'nothing/\*.jsonl' not found \(looked in .*exp, .*run\)"):
        DatasetTask(data_files="nothing/*.jsonl", prompt_column="question").prepare()
