"""A run that goes bad stops, in one line, and is never marked complete (llm_pg/runs/guards.py): divergence (every step
skipped as non-finite for `max_skipped_iterations` iterations, or a non-finite weight) and rewards that are not
finite numbers or raise. Checkpoint rotation keeps the last healthy copy."""

import math
import sys
import warnings

import lightning as L
import pytest
import torch
from conftest import ROOT, SMALL, DigitTask, fit

from llm_pg.cli.fit import main
from llm_pg.data.tasks.base import Example, Score
from llm_pg.runs.guards import DivergenceGuard, FlatRollouts, RunStopped

DIGITS = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]


class NaNGradients(L.Callback):
    """From iteration `start` on (1-based), every gradient of one trainable weight is NaN: each step is skipped."""

    def __init__(self, start: int = 3) -> None:
        self.start = start

    def on_train_start(self, trainer, module) -> None:
        param = next(p for p in module.policy.parameters() if p.requires_grad)
        param.register_hook(lambda grad: grad * math.nan if module.iteration + 1 >= self.start else grad)


class NaNWeightAfterStep(L.Callback):
    """The optimizer step of iteration `at` leaves a NaN in one trainable weight."""

    def __init__(self, at: int = 2) -> None:
        self.at = at

    def on_train_start(self, trainer, module) -> None:
        param = next(p for p in module.policy.parameters() if p.requires_grad)

        def poison(optimizer, args, kwargs) -> None:
            if module.iteration + 1 == self.at:
                with torch.no_grad():
                    param.view(-1)[0] = math.nan

        trainer.optimizers[0].register_step_post_hook(poison)


class NaNTask(DigitTask):
    def score(self, completion: str, example: Example) -> Score:
        share = super().score(completion, example).total  # NaN on training prompts only: eval at iteration 0 passes
        bonus = math.nan if ":" in example.prompt else 0.0
        return Score(total=share + bonus, correct=False, components={"digits": share, "bonus": bonus})


class RaisingTask(DigitTask):
    def score(self, completion: str, example: Example) -> Score:
        return Score(total=1.3 / len(completion.split("\x00\x00\x00")[1]), correct=False)  # IndexError


def callback(name: str, **init_args) -> str:
    return f"--trainer.callbacks+={{'class_path': 'test_guards.{name}', 'init_args': {init_args!r}}}"


def test_the_guard_counts_consecutive_bad_iterations_and_remembers_the_last_healthy_one():
    guard = DivergenceGuard(max_skipped_iterations=2)
    guard.check(1, [0.3, 0.2], 0.5, True, 3e-5)
    guard.check(2, [math.nan, 0.4], 0.5, True, 3e-5)  # one step of two skipped: still healthy
    guard.check(3, [math.inf, math.nan], 0.5, True, 3e-5)
    assert (guard.streak, guard.healthy_iteration) == (1, 2)
    guard.check(4, [0.1], 0.4, True, 3e-5)  # recovered: the streak starts again
    guard.check(5, [0.1], math.nan, True, 3e-5)  # this rank's loss alone decides nothing: ranks must agree
    assert (guard.streak, guard.healthy_iteration) == (0, 5)
    guard.check(6, [math.nan], math.nan, True, 3e-5)
    with pytest.raises(RunStopped, match=r"iterations 6-7: every optimizer step was skipped \(the loss is nan\)"):
        guard.check(7, [math.nan], math.nan, True, 3e-5)
    with pytest.raises(RunStopped, match=r"^iteration 3: every optimizer step .* iteration 2 or earlier"):
        guard = DivergenceGuard(1)
        guard.check(2, [0.2], 0.1, True, 3e-5)
        guard.check(3, [math.inf], 0.1, True, 3e-5)
    with pytest.raises(RunStopped, match=r"iteration 7: a trainable weight is not finite.*lower model.init_args.lr"):
        DivergenceGuard(3).check(7, [0.1], 0.1, False, 3e-5)
    DivergenceGuard(1).check(1, [], 0.0, True, 3e-5)  # no step at all (every group filtered) is not divergence


def test_skipped_steps_stop_the_run_keep_the_healthy_checkpoint_and_write_nothing_complete(
    tmp_path, random_model_dir, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    args = ["fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    args += [f"--model.init_args.model_name_or_path={random_model_dir}", "--run_name=run", *SMALL, *DIGITS]
    args += ["--model.init_args.iterations=10", "--checkpoint.every_n_iterations=1", "--checkpoint.keep_last=2"]
    with pytest.raises(SystemExit) as stop:
        main([*args, callback("NaNGradients", start=3)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg")]
    assert stop.value.code == 1, lines
    assert lines[-1].startswith("llm-pg: run stopped: iterations 3-5: every optimizer step was skipped"), lines
    assert "max_skipped_iterations=3" in lines[-1] and "iteration 2" in lines[-1]
    run = tmp_path / "run"
    assert not (run / "COMPLETE").exists() and not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*.ckpt")) == [
        "iter_00002.ckpt",  # the last healthy iteration, kept although keep_last=2 would have rotated it away
        "iter_00004.ckpt",
        "iter_00005.ckpt",
    ]
    steps = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()]
    column = steps[0].index("step")
    assert max(float(row[column]) for row in steps[1:]) == 5  # the bad iterations are logged, then it stopped


def test_a_non_finite_weight_stops_the_run_at_once(tmp_path, random_model_dir):
    with pytest.raises(RunStopped, match=r"^iteration 2: a trainable weight is not finite"):
        fit(tmp_path, random_model_dir, "--model.init_args.iterations=6", *DIGITS, callback("NaNWeightAfterStep", at=2))
    run = tmp_path / "run"
    assert not (run / "COMPLETE").exists() and not (run / "final").exists()


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        (
            "NaNTask",
            "task NaNTask gave a reward total of nan for row 0 of the rollout of iteration 1 (prompt 'Say digits 0:0'",
        ),
        (
            "RaisingTask",
            "task RaisingTask raised while scoring row 0 of evaluation at iteration 0 (prompt 'Say digits 0'",
        ),
    ],
)
def test_rewards_that_are_not_finite_or_raise_stop_the_run_at_that_rollout(
    tmp_path, random_model_dir, capsys, monkeypatch, task, expected
):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    args = ["fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    args += [f"--model.init_args.model_name_or_path={random_model_dir}", "--run_name=run", *SMALL]
    args += [f"--data.task=test_guards.{task}", "--data.task.init_args.eval_size=4", "--model.init_args.iterations=3"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 1
    start = err.index("llm-pg: run stopped:")
    message = err[start:]
    assert message.startswith(f"llm-pg: run stopped: {expected}"), message
    if task == "RaisingTask":  # the task's own frame, and none of ours
        assert 'test_guards.py", line' in message and "in score" in message and "IndexError" in message
        assert "llm_pg/" not in message
    else:
        assert len(message.strip().splitlines()) == 1
    run = tmp_path / "run"
    assert not (run / "COMPLETE").exists() and not (run / "final").exists()
    assert not list((run / "checkpoints").glob("*.ckpt"))  # stopped before the first update


def test_a_stopped_run_is_never_continued_or_completed_by_a_resume(tmp_path, random_model_dir):
    """Found in review: the stop was not saved, so `--ckpt_path last` on a run stopped at its last iteration found
    "nothing to train", evaluated the NaN policy and wrote final/ and COMPLETE."""
    with pytest.raises(RunStopped):
        fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *DIGITS, callback("NaNWeightAfterStep", at=2))
    with pytest.raises(RunStopped, match=r"^this checkpoint is of a run that stopped \(iteration 2: a trainable"):
        fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *DIGITS, "--ckpt_path=last")
    run = tmp_path / "run"
    assert not (run / "COMPLETE").exists() and not (run / "final").exists()


def test_rollouts_without_any_advantage_warn_once_per_streak():
    flat = FlatRollouts(patience=3)
    assert [flat.update(i, 1.0, 0.0, 0.0) for i in (1, 2)] == [None, None]
    message = flat.update(3, 1.0, 0.0, 0.0)
    assert message.startswith("iterations 1-3: every group's rewards were equal (train/frac_zero_std_groups 1.0, ")
    assert "train/accuracy 0)" in message and "start from a model that sometimes succeeds" in message
    assert flat.update(4, 1.0, 0.0, 0.0) is None  # once per streak
    assert flat.update(5, 0.75, 0.2, 0.1) is None and flat.streak == 0  # a group with spread ends it
    assert [flat.update(i, 1.0, 1.3, 1.0) for i in (6, 7, 8, 9)] == [None] * 4  # solved: nothing to warn about
    assert [flat.update(i, 1.0, 0.5, 0.5) for i in (10, 11)] == [None, None]
    assert flat.update(12, 1.0, 0.5, 0.5).startswith("iterations 10-12:")  # half the prompts never solved


def test_a_run_whose_groups_are_all_flat_says_so(tmp_path, random_model_dir):
    """A random model never writes format_copy's tags: every reward is 0, every advantage 0. The run goes on (it is
    not an error) and warns once, after the third such rollout; a run with spread (DigitTask) does not."""
    with pytest.warns(UserWarning, match=r"iterations 1-3: every group's rewards were equal .*train/reward 0, "):
        fit(tmp_path / "flat", random_model_dir, "--model.init_args.iterations=3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "digits", random_model_dir, "--model.init_args.iterations=3", *DIGITS)
    assert not [w for w in caught if "every group's rewards were equal" in str(w.message)]
