"""`llm-pg report`: its numbers are the CSVs' numbers, seeds group into bands, and the PNGs get written.

The module fixture trains two short real runs through `llm-pg sweep` (one `llm-pg fit` process each; about 15 s
in all)."""

import csv
import json
import os

import numpy as np
import pytest
import yaml
from conftest import ROOT, SMALL

from llm_pg.cli import report, sweep


def write_csv(path, rows: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    columns = sorted({k for row in rows for k in row})
    with (path / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def fake_run(path, em: list[float], reward: list[float], clip: bool = True) -> None:
    """A run with an eval every 2 iterations and a train row per iteration, as the trainer logs them."""
    rows = [{"step": 2 * i, "eval/exact_match": v, "time/eval": 1.0} for i, v in enumerate(em)]
    for step, r in enumerate(reward, 1):
        row = {"step": step, "train/reward": r, "train/kl": 0.01 * step, "train/grad_norm": 1.0, "time/update": 2.0}
        rows.append(row | ({"train/clip_fraction": 0.1 * step} if clip else {}))
    write_csv(path, rows)


# ---- fast: synthetic metrics ---------------------------------------------------------------------------


def test_summary_reads_final_best_first_crossing_and_times(tmp_path):
    fake_run(tmp_path / "a", em=[0.1, 0.95, 0.9, 0.85], reward=[0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
    stats = report.summarize(report.read_run(tmp_path / "a"))
    assert stats["final_em"] == 0.85 and stats["best_em"] == 0.95
    assert stats["iters_to_target"] == 2  # the eval at iteration 2 is the first at or above 0.9
    assert stats["final_reward"] == 1.2 and stats["final_kl"] == pytest.approx(0.06)
    assert stats["mean_clip"] == pytest.approx(0.35)
    assert stats["minutes"] == pytest.approx((4 * 1.0 + 6 * 2.0) / 60)
    assert stats["iterations"] == 6
    # Iteration 0's eval is the base; the first after it (iteration 2) is the early one; the gain is last - base.
    assert stats["base_em"] == 0.1 and stats["early_em"] == 0.95 and stats["gain"] == pytest.approx(0.75)
    # Training minutes: the update's 2 s per iteration, no eval: 0.9 reached at iteration 2 after 4 s, of 12 s.
    assert stats["minutes_to_target"] == pytest.approx(4 / 60) and stats["training_minutes"] == pytest.approx(12 / 60)
    assert report.summarize(report.read_run(tmp_path / "a"), target=0.96)["minutes_to_target"] is None
    assert report.summarize(report.read_run(tmp_path / "a"), target=0.05)["minutes_to_target"] == 0.0  # iteration 0


def test_a_run_evaluated_only_after_updates_has_no_base_and_no_gain(tmp_path):
    rows = [{"step": 2, "eval/exact_match": 0.5}, {"step": 4, "eval/exact_match": 0.7}]
    rows += [{"step": s, "train/reward": 0.1, "time/rollout": 3.0, "time/update": 3.0} for s in (1, 2, 3, 4)]
    write_csv(tmp_path / "r", rows)
    stats = report.summarize(report.read_run(tmp_path / "r"), target=0.6)
    assert stats["base_em"] is None and stats["gain"] is None and stats["early_em"] == 0.5
    assert stats["minutes_to_target"] == pytest.approx(24 / 60)  # rollout and update, iterations 1-4


def test_a_run_without_reference_model_has_no_kl(tmp_path):
    fake_run(tmp_path / "a", em=[0.5], reward=[0.1, 0.2])
    (tmp_path / "a" / "config.yaml").write_text("model:\n  init_args:\n    kl_coef: 0.0\n")
    run = report.read_run(tmp_path / "a")
    assert "train/kl" not in run.series and report.summarize(run)["final_kl"] is None


def test_a_step_logged_twice_after_a_resume_keeps_the_later_row(tmp_path):
    write_csv(tmp_path / "r", [{"step": 1, "train/reward": 0.1}, {"step": 2, "train/reward": 0.2},
                               {"step": 2, "train/reward": 0.7}])  # fmt: skip
    steps, values = report.read_run(tmp_path / "r").values("train/reward")
    assert steps.tolist() == [1, 2] and values.tolist() == [0.1, 0.7]


def test_seeds_form_one_group_with_a_min_max_band_and_mean_std_cells(tmp_path):
    fake_run(tmp_path / "x_seed0", em=[0.0, 0.5, 1.0], reward=[0.0, 0.2, 0.4, 0.6])
    fake_run(tmp_path / "x_seed1", em=[0.0, 0.3, 0.8], reward=[0.2, 0.4, 0.6, 0.8], clip=False)
    fake_run(tmp_path / "y", em=[0.0, 0.1, 0.2], reward=[0.0, 0.0, 0.1, 0.1])
    groups = report.group_runs([report.read_run(tmp_path / n) for n in ("y", "x_seed1", "x_seed0")])
    assert sorted(groups) == ["x", "y"] and len(groups["x"]) == 2
    steps, mean, low, high = report.band(groups["x"], "train/reward", window=1)
    assert steps.tolist() == [1, 2, 3, 4]
    assert np.allclose(mean, [0.1, 0.3, 0.5, 0.7]) and np.allclose(low, [0, 0.2, 0.4, 0.6])
    assert np.allclose(high, [0.2, 0.4, 0.6, 0.8])
    assert report.speed_order(groups) == ["x", "y"]  # x reached 0.9 (one seed); y never did
    row = next(line for line in report.table(groups).splitlines() if line.startswith("| x |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:5] == ["x", "2", "4", "0.900 ± 0.100", "0.900 ± 0.100"]
    assert cells[5] == "4, -"  # iterations to 0.9, per seed
    assert cells[8] == "0.250 ± 0.000 (1/2)"  # clip fraction: logged by one seed only


def test_smoothing_is_a_trailing_mean():
    assert report.smoothed(np.array([0.0, 2.0, 4.0, 6.0]), 2).tolist() == [0.0, 1.0, 3.0, 5.0]
    assert report.smoothed(np.array([1.0, 3.0]), 1).tolist() == [1.0, 3.0]


def test_markdown_cells_show_tags_and_pipes_as_written():
    cell = report._md("<answer>7</answer> | x\ny")
    assert cell == "\\<answer\\>7\\</answer\\> \\| x⏎y"


def test_a_folder_of_runs_stands_for_its_runs(tmp_path):
    fake_run(tmp_path / "sweep" / "a_seed0", em=[0.0], reward=[0.0])
    fake_run(tmp_path / "sweep" / "b_seed0", em=[0.0], reward=[0.0])
    assert [p.name for p in report.run_dirs([tmp_path / "sweep"])] == ["a_seed0", "b_seed0"]
    with pytest.raises(FileNotFoundError):
        report.run_dirs([tmp_path / "sweep" / "nothing"])


def test_a_damaged_run_is_skipped_with_a_line_naming_its_file_and_the_rest_is_reported(tmp_path, capsys):
    for name in ("a_seed0", "b_seed0", "c_seed0"):
        fake_run(tmp_path / "sweep" / name, em=[0.2, 0.6], reward=[0.5, 1.3])
    fake_run(tmp_path / "sweep" / "a_seed0.old-20261201-044512", em=[0.0], reward=[0.0])  # moved aside: not a run
    csv_file = tmp_path / "sweep" / "b_seed0" / "metrics.csv"
    csv_file.write_bytes(csv_file.read_bytes()[:-9])  # the last row cut short
    jsonl = tmp_path / "sweep" / "c_seed0" / "generations.jsonl"
    first = json.dumps({"iteration": 0, "prompt": "p", "completion": "x", "reward": 1.3})
    jsonl.write_text(first + '\n{"iteration": 1, "pro')
    _, summary = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == [
        f"llm-pg report: skipping {tmp_path / 'sweep' / 'b_seed0'}: {csv_file}: line 5 does not match the header "
        "(cut short?)",
        f"llm-pg report: skipping {tmp_path / 'sweep' / 'c_seed0'}: {jsonl}: line 2 is not JSON "
        "(Unterminated string starting at; cut short?)",
    ]
    assert [line.split(" | ")[0] for line in summary.splitlines()[2:]] == ["| a"]


def _skips(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def _good_and(tmp_path, name: str):
    """A sweep folder with a good run `good` and a run `name` to damage; returns the damaged run's directory."""
    for run in ("good", name):
        fake_run(tmp_path / "sweep" / run, em=[0.2, 0.6], reward=[0.5, 1.3])
    return tmp_path / "sweep" / name


def _reported(summary: str) -> list[str]:
    return [line.split(" | ")[0] for line in summary.splitlines()[2:]]


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"iteration": "0", "prompt": "p", "completion": "c", "reward": 1.3}, "'iteration' is '0', not int"),
        ({"iteration": 0, "prompt": 7, "completion": "c", "reward": 1.3}, "'prompt' is 7, not str"),
        ({"iteration": 0, "prompt": "p", "completion": "c", "reward": True}, "'reward' is True, not int or float"),
        ({"iteration": 0, "prompt": "p", "completion": "c", "reward": 1.3, "reward_tags": "x"}, "'reward_tags' is"),
        ([0, "p", "c", 1.3], "a JSON list, not an object"),
        ({"iteration": 0, "prompt": "p", "reward": 1.3}, "no 'completion' field"),
    ],
)
def test_a_run_with_type_wrong_generation_rows_is_damaged_and_the_others_are_reported(tmp_path, capsys, row, problem):
    bad = _good_and(tmp_path, "bad")
    good_row = {"iteration": 0, "prompt": "p", "completion": "c", "reward": 1.3, "advantage": 0.5}
    (bad / "generations.jsonl").write_text(json.dumps(good_row) + "\n" + json.dumps(row) + "\n")
    _, summary = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    [line] = _skips(capsys)
    assert line.startswith(f"llm-pg report: skipping {bad}: {bad / 'generations.jsonl'}: line 2 is not a row llm-pg ")
    assert problem in line
    assert _reported(summary) == ["| good"]


@pytest.mark.parametrize(("cell", "problem"), [("inf", "step 'inf' is not an iteration"), ("1.5", "step '1.5'"),
                                               ("-2", "step '-2'"), ("abc", "could not convert")])  # fmt: skip
def test_a_run_with_a_bad_metrics_cell_is_damaged_naming_the_line(tmp_path, capsys, cell, problem):
    bad = _good_and(tmp_path, "bad")
    file = bad / "metrics.csv"
    lines = file.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[2].split(",")
    cells[header.index("step") if cell != "abc" else header.index("train/reward")] = cell
    file.write_text("\n".join([*lines[:2], ",".join(cells), *lines[3:]]) + "\n")
    _, summary = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    [line] = _skips(capsys)
    assert line.startswith(f"llm-pg report: skipping {bad}: {file}: line 3: ") and problem in line
    assert _reported(summary) == ["| good"]


def test_a_run_with_a_bad_eval_file_is_damaged_and_good_eval_rows_are_shown(tmp_path, capsys):
    bad = _good_and(tmp_path, "bad")
    good = tmp_path / "sweep" / "good"
    (good / "eval").mkdir()
    row = {"prompt": "Copy: 41", "answer": "41", "completion": "<answer>41</answer>", "reward": 1.3, "correct": True}
    (good / "eval" / "iter_00000.jsonl").write_text(json.dumps(row | {"completion": "41", "reward": 0.0}) + "\n")
    (good / "eval" / "iter_00004.jsonl").write_text(json.dumps(row) + "\n")
    (bad / "eval").mkdir()
    (bad / "eval" / "iter_00004.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row | {"correct": 1}) + "\n")
    report_md, _ = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    [line] = _skips(capsys)
    eval_file = bad / "eval" / "iter_00004.jsonl"
    assert (
        line
        == f"llm-pg report: skipping {bad}: {eval_file}: line 2 is not a row llm-pg wrote ('correct' is 1, not bool)"
    )
    text = report_md.read_text()
    assert "Evaluation at iteration 4 (the first 1 of 1 prompts):" in text
    assert "| Copy: 41 | 41 | \\<answer\\>41\\</answer\\> | 1.30 | yes |" in text


def test_a_config_that_is_not_a_safe_yaml_mapping_is_one_line_and_never_runs(tmp_path, capsys):
    bad = _good_and(tmp_path, "bad")
    marker = tmp_path / "ran"
    for text, problem in [
        (f"model: !!python/object/apply:os.system ['touch {marker}']\n", "could not determine a constructor"),
        ("- a\n- list\n", "no mapping model.init_args"),
        ("model:\n  init_args: [1]\n", "no mapping model.init_args"),
    ]:
        (bad / "config.yaml").write_text(text)
        _, summary = report.write_report([tmp_path / "sweep"], tmp_path / "out")
        [line] = _skips(capsys)
        assert line.startswith(f"llm-pg report: skipping {bad}: {bad / 'config.yaml'}: not a config llm-pg wrote (")
        assert problem in line and _reported(summary) == ["| good"]
    assert not marker.exists()


def test_report_of_a_missing_folder_is_one_line_exit_2(tmp_path, capsys):
    assert report.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert (
        capsys.readouterr().err
        == f"llm-pg report: error: {tmp_path / 'nothing'}: no metrics.csv here or in its subfolders\n"
    )


def test_generation_rows_show_gold_answer_correct_length_truncation_and_components(tmp_path):
    fake_run(tmp_path / "r", em=[0.5], reward=[0.5])
    row = {"iteration": 0, "prompt": "Copy: 7", "answer": "7", "completion": "<answer>7", "reward": 0.2,
           "reward_correct": 0.0, "reward_tags": 0.2, "correct": False, "advantage": -0.71, "length": 9,
           "truncated": True}  # fmt: skip
    (tmp_path / "r" / "generations.jsonl").write_text(json.dumps(row) + "\n")
    text = report.generations(report.read_run(tmp_path / "r"), 4)
    lines = text.splitlines()
    assert (
        lines[2]
        == "| prompt | answer | completion | reward | correct | tags | correct | advantage | tokens | truncated |"
    )
    assert lines[4] == "| Copy: 7 | 7 | \\<answer\\>7 | 0.20 | 0.00 | 0.20 | no | -0.71 | 9 | yes |"


# ---- each setting against the reference, over seeds ----------------------------------------------------


def test_bootstrap_interval_by_hand():
    # A constant reference: only the setting's resampled mean varies, over {0.25, 0.5, 0.75} with probabilities
    # 1/4, 1/2, 1/4; each extreme holds more than 2.5 %, so the interval is the extremes minus 0.5.
    assert report.bootstrap_interval([0.5, 0.5], [0.25, 0.75]) == pytest.approx((0.0, -0.25, 0.25))
    # Two seeds each: the 2.5 % tail sits in the extreme resample (both low: probability 1/16), so the interval is
    # [min b - max a, max b - min a] = [1.0 - 0.2, 1.2 - 0.0].
    assert report.bootstrap_interval([0.0, 0.2], [1.0, 1.2]) == pytest.approx((1.0, 0.8, 1.2))
    # Three seeds, no spread: a point.
    assert report.bootstrap_interval([1.0, 1.0, 1.0], [0.3, 0.3, 0.3]) == pytest.approx((-0.7, -0.7, -0.7))
    # Seeded: the same inputs give the same interval.
    a, b = [0.1, 0.4, 0.35, 0.8], [0.5, 0.6, 0.9]
    assert report.bootstrap_interval(a, b) == report.bootstrap_interval(a, b)


def test_comparison_against_the_reference_marks_what_is_beyond_seed_noise(tmp_path):
    fake_run(tmp_path / "reference_seed0", em=[0.3, 0.9, 1.0], reward=[1.0] * 4)  # 0.9 at iteration 2
    fake_run(tmp_path / "reference_seed1", em=[0.3, 0.8, 0.9], reward=[1.0] * 4)  # at iteration 4
    fake_run(tmp_path / "lr_seed0", em=[0.3, 0.4, 0.3], reward=[1.0] * 4)  # never: counts as 4
    fake_run(tmp_path / "lr_seed1", em=[0.3, 0.5, 0.4], reward=[1.0] * 4)
    fake_run(tmp_path / "clip_seed0", em=[0.3, 0.9, 0.95], reward=[1.0] * 4)
    fake_run(tmp_path / "clip_seed1", em=[0.3, 0.8, 0.85], reward=[1.0] * 4)
    fake_run(tmp_path / "single", em=[0.3, 0.9, 0.1], reward=[1.0] * 4)
    groups = report.group_runs([report.read_run(p) for p in sorted(tmp_path.iterdir())])
    rows = {line.split(" | ")[0][2:]: line for line in report.comparison_table(groups, "reference").splitlines()[2:]}
    assert set(rows) == {"lr", "clip", "single"}
    # final EM: lr (0.3, 0.4) vs reference (1.0, 0.9): mean -0.6, extremes 0.3 - 1.0 and 0.4 - 0.9.
    # best EM: (0.4, 0.5) vs (1.0, 0.9): -0.5 [-0.6, -0.4]. Early (iteration 2): (0.4, 0.5) vs (0.9, 0.8): -0.4.
    # Iterations: (4, 4) vs (2, 4): +1 [0, +2], a bound. Training minutes (2 s an iteration): lr never got there
    # (counts as its 8 s), the reference after 4 s and 8 s: +2 s [0 s, +4 s] = +0.03 [+0.00, +0.07] minutes.
    assert rows["lr"] == (
        "| lr | 2 | **-0.600 [-0.700, -0.500]** | **-0.500 [-0.600, -0.400]** | **-0.400 [-0.500, -0.300]** "
        "| +1.0 [+0.0, +2.0] † | +0.03 [+0.00, +0.07] † |"
    )
    # clip: final (0.95, 0.85) vs (1.0, 0.9): -0.05 [-0.15, +0.05]: seed noise. Iterations (2, never: 4) vs (2, 4).
    assert rows["clip"] == (
        "| clip | 2 | -0.050 [-0.150, +0.050] | -0.050 [-0.150, +0.050] | +0.000 [-0.100, +0.100] "
        "| +0.0 [-2.0, +2.0] † | +0.00 [-0.07, +0.07] † |"
    )
    assert rows["single"] == "| single | 1 | - | - | - | - | - |"
    # Whether each group learned: its gain over iteration 0 per seed, with a one-sample interval over seeds.
    learned = {line.split(" | ")[0][2:]: line for line in report.learning_table(groups).splitlines()[2:]}
    assert (
        learned["reference"]
        == "| reference | 2 | 0.300 | 0.850 | 0.950 | +0.700, +0.600 | **+0.650 [+0.600, +0.700]** | 0.03 |"
    )
    assert learned["lr"] == "| lr | 2 | 0.300 | 0.450 | 0.350 | +0.000, +0.100 | +0.050 [+0.000, +0.100] | 0.03 |"
    assert learned["single"] == "| single | 1 | 0.300 | 0.900 | 0.100 | -0.200 | - | 0.03 |"


def test_bootstrap_mean_by_hand():
    # Three values: each extreme resample (all three draws the same value) has probability 1/27 > 2.5 %, so the
    # interval is the lowest to the highest value.
    assert report.bootstrap_mean([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0, 3.0))
    assert report.bootstrap_mean([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5, 0.5))
    # Many values: the interval narrows well inside the range.
    mean, low, high = report.bootstrap_mean(list(range(20)))
    assert mean == 9.5 and 5 < low < 9.5 < high < 14


def test_the_report_writes_the_comparison_when_settings_have_seeds(tmp_path, capsys):
    for name, em in [("reference_seed0", 0.9), ("reference_seed1", 1.0), ("x_seed0", 0.2), ("x_seed1", 0.3)]:
        fake_run(tmp_path / "sweep" / name, em=[0.1, em], reward=[1.0, 1.0])
    report_md, summary = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    text = report_md.read_text()
    assert "## Against the reference: reference" in text
    assert "| x | 2 | **-0.700 [-0.800, -0.600]** |" in text and "Against reference:" in summary
    assert "## Learning: the last evaluation against iteration 0" in text and "Learning (last eval" in summary
    assert "![eval_exact_match_time](eval_exact_match_time.png)" in text
    assert (tmp_path / "out" / "eval_exact_match_time.png").read_bytes()[:4] == b"\x89PNG"
    assert report.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o2"), "--reference", "nope"]) == 2
    assert "--reference 'nope' is none of the groups" in capsys.readouterr().err


def test_the_target_is_the_users_and_must_be_an_exact_match(tmp_path, capsys):
    for name, em in [("reference_seed0", 0.6), ("reference_seed1", 0.7), ("x_seed0", 0.2), ("x_seed1", 0.3)]:
        fake_run(tmp_path / "sweep" / name, em=[0.1, em], reward=[1.0, 1.0])
    assert report.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o"), "--target", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "iterations to EM 0.5 |" in out and "Δ training minutes to EM 0.5 [95 % interval]" in out
    assert "| reference | 2 | 2 | 0.650 ± 0.050 | 0.650 ± 0.050 | 2, 2 |" in out  # reached at iteration 2
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit) as exit_:
            report.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o3"), "--target", bad])
        assert exit_.value.code == 2
        assert f"--target {float(bad):g} is no exact match: give one in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()


# ---- real runs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory, random_model_dir):
    """Two 3-iteration GRPO runs on a random model with the digit-share task (varied rewards), via `llm-pg sweep`."""
    root = tmp_path_factory.mktemp("sweep")
    small = dict(arg.removeprefix("--").split("=", 1) for arg in SMALL)
    overrides = {
        "model.init_args.model_name_or_path": random_model_dir,
        "model.init_args.iterations": 3,
        "data.task": "conftest.DigitTask",
        **{k: yaml.safe_load(v) for k, v in small.items()},
        "model.init_args.evaluation.every": 2,
    }
    spec = {
        "base": str(ROOT / "configs/tiny/format_copy_grpo.yaml"),
        "seeds": [0],
        "overrides": overrides,
        "runs": {"base": {}, "kl_coef0.5": {"model.init_args.kl_coef": 0.5, "model.init_args.ppo_epochs": 3}},
    }
    (root / "mini.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.MonkeyPatch.context() as patch:  # the `llm-pg fit` processes import conftest.DigitTask
        patch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        patch.setenv("OMP_NUM_THREADS", "1")  # a tiny model gains nothing from threads and loses much on a busy CPU
        assert sweep.main([str(root / "mini.yaml"), "--runs_root", str(root / "runs")]) == 0
    return root


def csv_rows(run_dir) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_report_of_real_runs_writes_pngs_and_a_table_matching_the_csvs(swept, tmp_path):
    runs = swept / "runs" / "mini"
    assert report.main([str(runs), "--out", str(tmp_path / "report")]) == 0
    names = ("overview", "eval_exact_match", "speed", "eval_exact_match_time", "train_reward", "kl", "clip_fraction")
    for name in (*names, "grad_norm"):
        png = (tmp_path / "report" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    text = (tmp_path / "report" / "report.md").read_text()
    for label in ("base", "kl_coef0.5"):
        rows = csv_rows(runs / f"{label}_seed0")
        evals = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
        reached = [f"{r['step']:.0f}" for r in rows if r.get("eval/exact_match", 0) >= 0.9]
        train = [r for r in rows if "train/reward" in r]
        seconds = sum(r.get(c, 0.0) for r in rows for c in ("time/rollout", "time/update", "time/eval"))
        last = train[-1]
        expected = [label, "1", "3", f"{evals[-1]:.3f}", f"{max(evals):.3f}", (reached or ["-"])[0]]
        expected += [f"{last['train/reward']:.3f}", f"{last['train/kl']:.4f}"]
        expected += [f"{np.mean([r['train/clip_fraction'] for r in train]):.3f}", f"{seconds / 60:.1f}"]
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        assert [c.strip() for c in row.split("|")[1:-1]] == expected
        first = json.loads((runs / f"{label}_seed0" / "generations.jsonl").read_text().splitlines()[0])
        correct = "yes" if first["correct"] else "no"
        truncated = "yes" if first["truncated"] else "no"
        assert f"| {correct} | {first['advantage']:+.2f} | {first['length']} | {truncated} |" in text
    assert "![overview](overview.png)" in text and "## Sampled generations" in text
    assert "## Eval completions" in text and "Evaluation at iteration 3" in text


@pytest.mark.slow
def test_real_runs_log_the_new_metrics_every_iteration_and_full_generation_rows(swept):
    run = swept / "runs" / "mini" / "base_seed0"
    train = [r for r in csv_rows(run) if "train/reward" in r]
    assert len(train) == 3
    for row in train:
        assert row["train/completion_len_min"] <= row["train/completion_len"] <= row["train/completion_len_max"]
        assert row["train/clip_fraction_low"] + row["train/clip_fraction_high"] == pytest.approx(
            row["train/clip_fraction"], abs=1e-6
        )
        assert row["time/tokens_per_s"] > 0 and row["train/advantage_abs_mean"] >= 0
        assert 0 <= row["train/truncated_frac"] <= 1 and "memory/peak_gb" not in row  # a CPU run
    generations = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert {"iteration", "answer", "correct", "length", "truncated", "advantage"} <= set(generations[0])


@pytest.mark.slow
def test_sweep_again_skips_the_finished_runs(swept, capsys):
    assert sweep.main([str(swept / "mini.yaml"), "--runs_root", str(swept / "runs")]) == 0
    assert capsys.readouterr().out.count("(done, skipped)") == 2


def test_every_table_of_report_md_renders(tmp_path):
    from test_docs import problems

    for name, em in [("reference_seed0", 0.9), ("reference_seed1", 1.0), ("x_seed0", 0.2), ("x_seed1", 0.3)]:
        fake_run(tmp_path / "sweep" / name, em=[0.1, em], reward=[1.0, 1.0])
        row = {"iteration": 0, "prompt": "Copy: 7 | 8", "answer": "7", "completion": "<answer>7</answer>\n"}
        row |= {"reward": 1.3, "reward_tags": 0.2, "correct": True, "advantage": 0.5, "length": 9, "truncated": False}
        (tmp_path / "sweep" / name / "generations.jsonl").write_text(json.dumps(row) + "\n")
        (tmp_path / "sweep" / name / "eval").mkdir()
        (tmp_path / "sweep" / name / "eval" / "iter_00002.jsonl").write_text(json.dumps(row) + "\n")
    report_md, _ = report.write_report([tmp_path / "sweep"], tmp_path / "out")
    text = report_md.read_text()
    assert text.count("|---|") >= 6 and problems(text) == []


def test_a_report_out_inside_what_it_reads_is_refused(tmp_path, capsys):
    (tmp_path / "sweep" / "a").mkdir(parents=True)
    (tmp_path / "sweep" / "a" / "metrics.csv").write_text("step,train/reward\n1,0.5\n")
    assert report.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "sweep" / "a" / "report")]) == 2
    assert capsys.readouterr().err == (
        f"llm-pg report: error: --out {tmp_path / 'sweep' / 'a' / 'report'} lies inside {tmp_path / 'sweep'}, which "
        "the report reads; write it outside, e.g. --out reports/NAME\n"
    )
    assert sorted(p.name for p in (tmp_path / "sweep").rglob("*")) == ["a", "metrics.csv"]


def test_a_report_out_that_is_another_run_is_refused(tmp_path, capsys):
    """Found in review: `llm-pg report runs/t --out runs/a` replaced run a's own report.md and overview.png."""
    for name in ("a", "t"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text("step,train/reward\n1,0.5\n")
    (tmp_path / "a" / "report.md").write_text("a's own\n")
    (tmp_path / "a" / ".lock").write_text("1 host token\n")
    for out in (tmp_path / "a", tmp_path / "a" / "final"):  # the run, or a folder of it
        assert report.main([str(tmp_path / "t"), "--out", str(out)]) == 2
        assert f"lies in the run directory {tmp_path / 'a'}, whose files are its own" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".lock", "metrics.csv", "report.md"]
    assert (tmp_path / "a" / "report.md").read_text() == "a's own\n"
