"""Modules and data files a config names are found beside it, then in the working directory, without PYTHONPATH."""

import csv
import json
import os
import sys
import time

import pytest
from conftest import DigitTask

from llm_pg.data import user_code
from llm_pg.data.tasks.base import Example
from llm_pg.data.user_code import add_config_dirs, config_files, find_file, lookup_dirs

SMALL = [  # 2 prompts x 4 completions of 8 tokens, one iteration, no W&B
    "--model.init_args.iterations=1",
    "--data.prompts_per_step=2",
    "--model.init_args.group_size=4",
    "--model.init_args.minibatch_size=4",
    "--model.init_args.grad_accum_steps=2",
    "--model.init_args.max_new_tokens=8",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
]


@pytest.fixture
def fresh_path(monkeypatch):
    """sys.path and the recorded lookup directories as they were, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(user_code, "_lookup_dirs", [])
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_config_files_reads_both_spellings():
    words = ["fit", "--config", "a/x.yaml", "--config=b/y.yaml", "--model.lr=1", "--config"]
    assert [str(p) for p in config_files(words)] == ["a/x.yaml", "b/y.yaml"]


def test_config_dirs_then_cwd_go_at_the_end_of_sys_path_once(tmp_path, monkeypatch, fresh_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    before = list(sys.path)
    added = add_config_dirs(["fit", "--config", str(tmp_path / "exp" / "c.yaml"), "--config=../exp/d.yaml"])
    assert added == [str(tmp_path / "exp"), str(tmp_path / "run")]
    assert sys.path == [*before, *added]  # appended: a yaml.py beside the config cannot shadow PyYAML
    assert lookup_dirs() == added
    assert add_config_dirs(["fit", "--config", str(tmp_path / "exp" / "c.yaml")]) == []  # already there


def test_find_file_looks_beside_the_config_then_in_the_working_directory(tmp_path, monkeypatch, fresh_path):
    for folder in ("exp", "run"):
        (tmp_path / folder).mkdir()
    (tmp_path / "exp" / "both.jsonl").write_text("{}")
    (tmp_path / "run" / "both.jsonl").write_text("{}")
    (tmp_path / "run" / "cwd_only.jsonl").write_text("{}")
    monkeypatch.chdir(tmp_path / "run")
    assert find_file("both.jsonl") == str(tmp_path / "run" / "both.jsonl")  # before the entry point: cwd only
    add_config_dirs(["fit", f"--config={tmp_path / 'exp' / 'c.yaml'}"])
    assert find_file("both.jsonl") == str(tmp_path / "exp" / "both.jsonl")
    assert find_file("cwd_only.jsonl") == str(tmp_path / "run" / "cwd_only.jsonl")
    assert find_file("nowhere.jsonl") is None
    assert find_file(str(tmp_path / "run" / "both.jsonl")) == str(tmp_path / "run" / "both.jsonl")


def write_experiment(folder, reward_module: str, body: str, split_files: bool = False) -> str:
    """A config, its data file(s) and its reward module in `folder`; returns the config's path. With `split_files`,
    train.jsonl rows have `"split": "train"` and test.jsonl rows `"split": "test"`; else one file, rows.jsonl."""
    folder.mkdir()
    rows = {"train": [{"q": n, "n": n, "split": "train"} for n in (-41, 7, 512, 90, -3, 66)]}
    if split_files:
        rows["test"] = [{"q": n, "n": n, "split": "test"} for n in (5, -6)]
    for split, items in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (folder / f"{reward_module}.py").write_text(body)
    config = {
        "model": {"class_path": "llm_pg.modules.GRPOModule", "init_args": {"model_name_or_path": "tiny"}},
        "data": {
            "task": {
                "class_path": "llm_pg.data.tasks.DatasetTask",
                "init_args": {
                    "data_files": {split: f"{split}.jsonl" for split in rows},
                    "eval_split": "test" if split_files else None,
                    "prompt_template": "Copy: {q}",
                    "answer_column": "n",
                    "eval_size": 2,
                    "rewards": ["answer_tag", f"{reward_module}:score"],
                    "reward_weights": [1.0, 0.5],
                },
            }
        },
        "trainer": {"accelerator": "cpu", "devices": 1},
    }
    (folder / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    return str(folder / "config.yaml")


def run_llm_pg(tmp_path, config: str, *overrides: str) -> int:
    """`llm-pg fit --config CONFIG` in this process, from a working directory that is not the config's."""
    from llm_pg.cli.fit import main

    before = os.getcwd()
    os.chdir(tmp_path / "elsewhere")
    try:
        main(["fit", f"--config={config}", f"--runs_root={tmp_path / 'runs'}", "--run_name=run", *SMALL, *overrides])
    except SystemExit as stop:
        return int(stop.code or 0)
    finally:
        os.chdir(before)  # later tests resolve paths from the repository root
    return 0


def test_a_reward_function_and_data_file_beside_the_config_train_without_pythonpath(tmp_path, monkeypatch, fresh_path):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    body = "def score(completion, example):\n    return 0.8 if example.answer in completion else 0.0\n"
    config = write_experiment(tmp_path / "exp", "beside_config_rewards", body)
    assert run_llm_pg(tmp_path, config) == 0
    with open(tmp_path / "runs" / "run" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/reward")]
    assert len(rows) == 1
    total = float(rows[0]["train/reward"])
    parts = float(rows[0]["train/reward_answer_tag"]) + float(rows[0]["train/reward_score"])
    assert total == pytest.approx(parts, abs=1e-6)
    assert (tmp_path / "runs" / "run" / "COMPLETE").exists()


TRAIN_ONLY = {  # reward functions that fail on training rows only: the eval at iteration 0 passes
    "raising_rewards": (
        "def score(completion, example):\n    return {'test': 1.0}[example.fields['split']]\n",
        "reward function 'raising_rewards:score' raised KeyError: 'train' (raising_rewards.py:2 in score); row 0 of "
        "the rollout of iteration 1 (prompt 'Copy: ",
    ),
    "nan_rewards": (
        "def score(completion, example):\n    return float('nan') if example.fields['split'] == 'train' else 0.0\n",
        "reward function 'nan_rewards:score' returned nan: rewards must be finite numbers; row 0 of the rollout of "
        "iteration 1",
    ),
}


def stopped_line(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg: run stopped:")]


@pytest.mark.parametrize("module", TRAIN_ONLY)
def test_a_raising_or_nan_reward_function_stops_the_run_in_one_line(tmp_path, capsys, fresh_path, module):
    (tmp_path / "elsewhere").mkdir()
    body, expected = TRAIN_ONLY[module]
    config = write_experiment(tmp_path / "exp", module, body, split_files=True)
    assert run_llm_pg(tmp_path, config) == 1
    stopped = stopped_line(capsys)
    assert len(stopped) == 1 and expected in stopped[0], stopped
    assert not (tmp_path / "runs" / "run" / "COMPLETE").exists()


def test_a_reward_function_failing_in_the_first_evaluation_stops_the_run_in_one_line(tmp_path, capsys, fresh_path):
    (tmp_path / "elsewhere").mkdir()
    body = "def score(completion, example):\n    return float('nan')\n"
    config = write_experiment(tmp_path / "exp", "nan_everywhere_rewards", body, split_files=True)
    assert run_llm_pg(tmp_path, config) == 1
    stopped = stopped_line(capsys)
    assert len(stopped) == 1, stopped
    assert "reward function 'nan_everywhere_rewards:score' returned nan" in stopped[0]
    assert "evaluation at iteration 0" in stopped[0]
    assert not (tmp_path / "runs" / "run" / "COMPLETE").exists()


def test_a_data_problem_is_one_line_before_training(tmp_path, capsys, fresh_path):
    (tmp_path / "elsewhere").mkdir()
    config = write_experiment(tmp_path / "exp", "unused_rewards", "def score(completion, example):\n    return 0.0\n")
    assert run_llm_pg(tmp_path, config, "--data.task.init_args.answer_column=number") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg: error:")]
    assert len(errors) == 1
    assert "answer_column names column 'number', which split 'train' of" in errors[0]
    assert "train.jsonl" in errors[0] and "(columns: q, n, split)" in errors[0]
    assert not (tmp_path / "runs" / "run").exists()  # before the run directory is made


@pytest.mark.slow
def test_resuming_over_edited_data_is_refused_naming_the_data(tmp_path, monkeypatch, capsys, fresh_path):
    (tmp_path / "elsewhere").mkdir()
    body = "def score(completion, example):\n    return 0.8 if example.answer in completion else 0.0\n"
    config = write_experiment(tmp_path / "exp", "edited_data_rewards", body)
    assert run_llm_pg(tmp_path, config, "--model.init_args.iterations=1") == 0
    unchanged = ["--model.init_args.iterations=2", "--ckpt_path=last"]
    data = tmp_path / "exp" / "train.jsonl"
    original = data.read_text()
    data.write_text(original.replace('"n": 7,', '"n": 8,'))  # one answer edited between the stop and the resume
    capsys.readouterr()
    assert run_llm_pg(tmp_path, config, *unchanged) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg: error:")]
    assert line.startswith(
        "llm-pg: error: data.task: the data ({'train': 'train.jsonl'}) is not the data "
        f"{tmp_path / 'runs' / 'run' / 'checkpoints' / 'last.ckpt'} was trained on (its rows' fingerprint "
    )
    assert "resume with the data it was trained on, or start a new run (--run_name)" in line
    with open(tmp_path / "runs" / "run" / "metrics.csv") as f:
        assert [row["step"] for row in csv.DictReader(f) if row.get("train/reward")] == ["1"]  # nothing trained
    data.write_text(original)  # the data it was trained on: the resume goes on
    assert run_llm_pg(tmp_path, config, *unchanged) == 0


ISOLATED = {  # reward functions that hang, exit or crash their process: each stops the run in one line
    "hanging_rewards": (
        "import time\n\ndef score(completion, example):\n    while True:\n        time.sleep(0.05)\n",
        "task DatasetTask did not return within data.reward_timeout=3 s while scoring row 0 of evaluation at "
        "iteration 0",
        'hanging_rewards.py", line 5 in score',
    ),
    "exiting_rewards": (
        "import sys\n\ndef score(completion, example):\n    sys.exit(0)\n",
        "task DatasetTask called sys.exit(0) in exiting_rewards:score (",
        "exiting_rewards.py line 4) while scoring row 0 of evaluation at iteration 0",
    ),
    "interrupting_rewards": (  # the function the task called is named; the line is where the interrupt came from
        "def _check(text):\n    raise KeyboardInterrupt\n\n\n"
        "def score(completion, example):\n    return _check(completion)\n",
        "task DatasetTask raised KeyboardInterrupt in interrupting_rewards:score (",
        "interrupting_rewards.py line 2) while scoring row 0 of evaluation at iteration 0",
    ),
    "crashing_rewards": (
        "import os\n\ndef score(completion, example):\n    os._exit(3)\n",
        "task DatasetTask's reward worker failed while scoring row 0 of evaluation at iteration 0",
        "the worker process ended (exit code 3: os._exit or a crash in native code)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("module", ISOLATED)
def test_a_reward_that_hangs_exits_or_crashes_stops_the_run_in_one_line(tmp_path, capsys, fresh_path, module):
    (tmp_path / "elsewhere").mkdir()
    body, start, detail = ISOLATED[module]
    config = write_experiment(tmp_path / "exp", module, body)
    started = time.perf_counter()
    assert run_llm_pg(tmp_path, config, "--data.reward_timeout=3", "--data.reward_workers=1") == 1
    assert time.perf_counter() - started < 120  # not for ever
    stopped = stopped_line(capsys)
    assert len(stopped) == 1 and start in stopped[0] and detail in stopped[0], stopped
    assert not (tmp_path / "runs" / "run" / "COMPLETE").exists()


def test_in_process_scoring_still_stops_at_a_sys_exit(tmp_path, capsys, fresh_path):
    (tmp_path / "elsewhere").mkdir()
    body, _, _ = ISOLATED["exiting_rewards"]
    config = write_experiment(tmp_path / "exp", "exiting_in_process_rewards", body)
    assert run_llm_pg(tmp_path, config, "--data.reward_workers=0") == 1
    stopped = stopped_line(capsys)
    start = "task DatasetTask called sys.exit(0) in exiting_in_process_rewards:score ("
    assert len(stopped) == 1 and start in stopped[0] and "exiting_in_process_rewards.py line 4)" in stopped[0], stopped


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("def score(completion, example)\n    return 0.0\n", "broken_rewards.py:1: SyntaxError: expected ':'"),
        ("import math\nBASE = math.nope\n", "broken_rewards.py:2: AttributeError: module 'math' has no attribute"),
    ],
)
def test_a_reward_module_that_fails_to_import_is_one_line_naming_file_and_line(
    tmp_path, capsys, fresh_path, body, problem
):
    (tmp_path / "elsewhere").mkdir()
    config = write_experiment(tmp_path / "exp", "broken_rewards", body)
    assert run_llm_pg(tmp_path, config) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("llm-pg: error: "), errors
    assert "reward 'broken_rewards:score': importing broken_rewards failed: " in errors[0] and problem in errors[0]


class UnloadableTask(DigitTask):
    """A task whose copy cannot be rebuilt in a worker (its data stayed behind)."""

    def __setstate__(self, state):
        raise ValueError("the data file is not here")


class ExitOnFirstTask(DigitTask):
    def score(self, completion, example):
        if example.prompt.endswith(":0"):
            raise SystemExit(3)
        return super().score(completion, example)


def test_workers_report_a_task_they_cannot_load_and_stop_scoring_after_a_failure():
    from llm_pg.data.isolation import Failure, TaskScorer

    examples = [Example(prompt=f"Say digits 0:{i}", answer="") for i in range(6)]
    scorer = TaskScorer(UnloadableTask(), workers=1, timeout=5)
    try:
        first, *rest = scorer.score(["1"] * 6, examples)
    finally:
        scorer.close()
    assert first == Failure("died", "the reward worker could not load the task: ValueError: the data file is not here")
    assert {r.kind for r in rest} == {"skipped"}
    scorer = TaskScorer(ExitOnFirstTask(), workers=1, timeout=5)
    try:
        results = scorer.score(["1"] * 6, examples)
    finally:
        scorer.close()
    assert results[0].kind == "exit" and {r.kind for r in results[1:]} == {"skipped"}
    assert results[0].detail.startswith("called sys.exit(3) in test_user_modules:ExitOnFirstTask.score (")
