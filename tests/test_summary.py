"""The end of `llm-pg fit`: the summary's numbers are metrics.csv's, and the run directory gets its report and plot."""

import csv

import pytest
from conftest import fit

from llm_pg.cli.summary import summarize_run, summary_lines


def csv_columns(path) -> dict[str, dict[int, float]]:
    """`{column: {step: value}}` read with the csv module alone (the later row wins, as after a resume)."""
    columns: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for name, text in row.items():
                if name != "step" and text:
                    columns.setdefault(name, {})[int(float(row["step"]))] = float(text)
    return columns


@pytest.fixture(scope="module")
def finished(tmp_path_factory, random_model_dir):
    """A 4-iteration GRPO run, evaluated at 0, 2 and 4, on a random model (its rewards vary within groups)."""
    root = tmp_path_factory.mktemp("summary")
    cli = fit(root, random_model_dir, "--model.init_args.iterations=4", "--model.init_args.evaluation.every=2")
    return cli, root / "run"


def test_fit_writes_its_report_and_overview_plot(finished):
    _, run_dir = finished
    png = (run_dir / "overview.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = (run_dir / "report.md").read_text()
    assert "![overview](overview.png)" in text and "| run |" in text


def test_summary_numbers_are_the_metrics_csv_numbers(finished):
    cli, run_dir = finished
    columns = csv_columns(run_dir / "metrics.csv")
    reward, em = columns["train/reward"], columns["eval/exact_match"]
    assert sorted(reward) == [1, 2, 3, 4] and sorted(em) == [0, 2, 4]
    numbers = cli.summary
    assert numbers == summarize_run(run_dir)  # what fit printed is what the files say
    assert numbers["iterations"] == 4
    assert numbers["em_first"] == (0, em[0]) and numbers["em_last"] == (4, em[4])
    best = max(em.values())
    assert numbers["em_best"] == (min(s for s, v in em.items() if v == best), best)
    assert numbers["reward_window"] == 2  # min(3, 4 // 2)
    assert numbers["reward_first"] == pytest.approx((reward[1] + reward[2]) / 2)
    assert numbers["reward_last"] == pytest.approx((reward[3] + reward[4]) / 2)
    rollout, update = columns["time/rollout"], columns["time/update"]
    assert numbers["rollout_per_iteration"] == pytest.approx(sum(rollout.values()) / 4)
    assert numbers["update_per_iteration"] == pytest.approx(sum(update.values()) / 4)
    assert numbers["eval_per_iteration"] == pytest.approx(sum(columns["time/eval"].values()) / 4)
    # The training clock at the last iteration plus the evaluations outside it (before iteration 1, after 4).
    wall = columns["time/elapsed"][4] + columns["time/eval"][0] + columns["time/eval"][4]
    assert numbers["wall_seconds"] == pytest.approx(wall)
    lines = summary_lines(numbers, run_dir, run_dir / "overview.png", None)
    assert lines[0].startswith(f"llm-pg: 4 iterations in {wall:.1f} s: {wall / 4:.2f} s each (rollout ")
    assert f"{em[0]:.3f} (iteration 0) -> {em[4]:.3f} (iteration 4)" in lines[1]
    assert (
        f"{numbers['reward_first']:.3f} (iterations 1-2) -> {numbers['reward_last']:.3f} (iterations 3-4)" in lines[2]
    )
    assert any(line.endswith("overview.png (report.md beside it)") for line in lines)


def test_summary_of_a_resumed_run_covers_every_iteration(tmp_path):
    """Rows of a first attempt (iterations 1-3, eval at 0) and a resume (4-6, eval at 6): one summary of all six."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/exact_match": 0.25, "time/eval": 1.5}]
    rewards = [0.1, 0.3, 0.2, 1.2, 1.3, 1.1]
    for step, reward in enumerate(rewards, 1):
        elapsed = 2.0 * step  # the training clock continues across the resume (restored from the checkpoint)
        rows.append(
            {"step": step, "train/reward": reward, "time/rollout": 1.2, "time/update": 0.6, "time/elapsed": elapsed}
        )
    rows.append({"step": 6, "eval/exact_match": 0.75, "time/eval": 0.5})
    with (run / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for row in rows for k in row}))
        writer.writeheader()
        writer.writerows(rows)
    numbers = summarize_run(run)
    assert numbers["iterations"] == 6 and numbers["reward_window"] == 3
    assert numbers["reward_first"] == pytest.approx(0.2) and numbers["reward_last"] == pytest.approx(1.2)
    assert numbers["em_first"] == (0, 0.25) and numbers["em_last"] == (6, 0.75) and numbers["em_best"] == (6, 0.75)
    assert numbers["wall_seconds"] == pytest.approx(12.0 + 1.5 + 0.5)
    assert numbers["eval_per_iteration"] == pytest.approx(2.0 / 6)
    line = summary_lines(numbers, run, None, None)[0]
    assert line == "llm-pg: 6 iterations in 14.0 s: 2.33 s each (rollout 1.20, update 0.60, eval 0.33, other 0.20)"


# ---- the progress line's last print matches the summary ----------------------------------------------------


def _trainer_and_module(iteration: int, total: int):
    from types import SimpleNamespace

    # What training_step logged for the progress bar: its `eval_em` is the evaluation before this iteration's end.
    trainer = SimpleNamespace(loggers=[], progress_bar_metrics={"reward": 1.3, "eval_em": 0.375})
    module = SimpleNamespace(iteration=iteration, total_iterations=total, latest_eval={})
    return trainer, module


def test_the_last_plain_line_shows_the_final_evaluation(capsys):
    from llm_pg.callbacks.progress import IterationLines

    lines = IterationLines(every_s=3600.0)
    trainer, module = _trainer_and_module(iteration=0, total=4)
    lines.on_train_start(trainer, module)
    module.iteration, module.latest_eval = 4, {"exact_match": 0.375}
    lines.on_train_batch_end(trainer, module, None, None, 3)  # the bar's hook runs before the eval callback's
    module.latest_eval = {"exact_match": 1.0}  # EvalCallback: the evaluation that ends iteration 4
    lines.on_fit_end(trainer, module)  # after every callback's on_train_end
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert len(printed) == 1 and printed[0].startswith("iteration 4/4 (100%)")
    assert printed[0].endswith("reward 1.300  eval_em 1.000")


def test_the_rich_bar_ends_on_the_final_evaluation(monkeypatch):
    from llm_pg.callbacks.progress import IterationProgressBar

    bar = IterationProgressBar()
    trainer, module = _trainer_and_module(iteration=4, total=4)
    module.latest_eval = {"exact_match": 0.875}
    assert bar.get_metrics(trainer, module) == {"reward": 1.3, "eval_em": 0.875}
    shown = []
    monkeypatch.setattr(bar, "_update_metrics", lambda t, m: shown.append(bar.get_metrics(t, m)))
    bar.on_fit_end(trainer, module)
    assert shown == [{"reward": 1.3, "eval_em": 0.875}]
