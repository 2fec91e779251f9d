"""Run safety end to end on a random two-layer model: owned run dirs, signals, config checks on resume, one-line
errors and logs that replay cleanly (llm_pg/runs/directory.py, llm_pg/cli/fit.py, llm_pg/callbacks/checkpoint.py)."""

import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from conftest import ROOT, SMALL, DigitTask, fit

from llm_pg.callbacks.checkpoint import read_header, verify
from llm_pg.cli.fit import RunInterrupted, main
from llm_pg.data.tasks.base import Example
from llm_pg.runs.config import config_changes
from llm_pg.runs.directory import RunDirError, RunLock, is_complete, is_rank_zero
from llm_pg.runs.guards import RunStopped
from llm_pg.runs.logs import trim_logs

DIGITS = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]


class SendSignal(L.Callback):
    """Sends `signum` to this process when iteration `at` has finished (the signal arrives mid-run)."""

    def __init__(self, at: int = 2, signum: int = int(signal.SIGTERM)) -> None:
        self.at, self.signum = at, signum

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if module.iteration == self.at:
            os.kill(os.getpid(), self.signum)


def rows(run_dir) -> list[dict]:
    """metrics.csv without the timing columns, which differ between any two runs."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if v and not k.startswith(("time/", "memory/"))} for r in csv.DictReader(f)]


def generations(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


def test_a_finished_run_is_not_overwritten_and_overwrite_moves_it_aside(tmp_path, random_model_dir):
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *DIGITS)
    run = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in (run / "metrics.csv", run / "generations.jsonl")}
    assert is_complete(run)
    with pytest.raises(RunDirError, match=r"already holds a run: continue it with --ckpt_path last.*--overwrite true"):
        fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *DIGITS)
    assert {p: (run / p).read_bytes() for p in before} == before  # nothing appended, nothing replaced
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--overwrite=true", *DIGITS)
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / "metrics.csv").read_bytes() == before["metrics.csv"]
    assert (aside / "COMPLETE").is_file() and (aside / "final").is_dir()
    assert [r["step"] for r in rows(run) if "train/reward" in r] == ["1"]
    assert not list(tmp_path.rglob("*-v1*")), "ModelCheckpoint's versioning must never trigger"


def test_wandb_runs_follow_the_run_a_resume_continues_its_id_and_an_overwrite_opens_a_new_one(
    tmp_path, random_model_dir, monkeypatch
):
    """W&B offline: the run's W&B id is the one in `wandb_id`; `--overwrite true` starts a new W&B run instead of
    resuming the old one's (whose steps W&B would keep, dropping the new run's); `--ckpt_path last` continues it."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    wandb = ["--wandb_project=llm_pg_test", *DIGITS]

    def offline_ids(directory) -> set[str]:
        return {p.name.rsplit("-", 1)[-1] for p in (directory / "wandb").glob("offline-run-*")}

    def fit_and_finish(*overrides: str) -> None:  # one process per fit outside tests: W&B's run ends with it
        import wandb as wandb_module

        try:
            fit(tmp_path, random_model_dir, *overrides, *wandb)
        finally:
            wandb_module.finish()

    fit_and_finish("--model.init_args.iterations=1")
    first = (run / "wandb_id").read_text().strip()
    assert offline_ids(run) == {first}
    fit_and_finish("--model.init_args.iterations=1", "--overwrite=true")
    second = (run / "wandb_id").read_text().strip()
    (aside,) = tmp_path.glob("run.old-*")
    assert second != first and offline_ids(run) == {second} and offline_ids(aside) == {first}
    fit_and_finish("--model.init_args.iterations=2", "--ckpt_path=last")
    assert (run / "wandb_id").read_text().strip() == second
    assert offline_ids(run) == {second} and len(list((run / "wandb").glob("offline-run-*"))) == 2


@pytest.mark.slow
def test_a_second_process_on_the_same_run_dir_fails_at_once_and_a_dead_ones_lock_is_free(tmp_path, random_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from llm_pg.runs.directory import RunLock; "
         "RunLock.acquire(sys.argv[1]); "
         "print('locked', flush=True); time.sleep(60)", str(run)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        with pytest.raises(RunDirError, match=rf"in use by pid {holder.pid} on "):
            fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--ckpt_path=last", *DIGITS)
        assert time.perf_counter() - start < 30  # at once, not after loading a model (generous bound)
    finally:
        holder.kill()
        holder.wait()
    assert (run / ".lock").read_text().split()[0] == str(holder.pid)  # a dead process's lock file stays...
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--ckpt_path=last", *DIGITS)  # ...and is free
    assert is_complete(run)


def test_only_rank_zero_owns_the_run(monkeypatch, tmp_path):
    assert is_rank_zero()
    monkeypatch.setenv("LOCAL_RANK", "1")  # as Lightning's DDP launcher starts rank 1
    assert not is_rank_zero()
    lock = RunLock.acquire(tmp_path)
    lock.release()
    RunLock.acquire(tmp_path).release()  # released means free again, in this process too


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_the_iteration_exits_nonzero_and_the_resume_matches_an_uninterrupted_run(
    tmp_path, random_model_dir, signum, code
):
    common = ["--model.init_args.iterations=3", "--checkpoint.every_n_iterations=10", *DIGITS]
    straight = fit(tmp_path / "straight", random_model_dir, *common).model
    stop = f"--trainer.callbacks+={{'class_path': 'test_run_safety.SendSignal', 'init_args': {{'signum': {signum}}}}}"
    sigint_before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup / a background job
    with pytest.raises(RunInterrupted) as stopped:
        fit(tmp_path / "b", random_model_dir, *common, stop)
    run = tmp_path / "b" / "run"
    assert stopped.value.exit_code == code
    assert f"stopped by {signal.Signals(signum).name}; iteration 2 is saved" in str(stopped.value)
    assert str(stopped.value).endswith("--ckpt_path last") and "\n" not in str(stopped.value)
    assert signal.getsignal(signal.SIGINT) is sigint_before  # handlers restored
    assert read_header(run / "checkpoints" / "last.ckpt")[0] == 2  # every iteration, not every 10
    assert not (run / "final").exists() and not is_complete(run)
    resumed = fit(tmp_path / "b", random_model_dir, *common, "--ckpt_path=last").model
    assert resumed.iteration == 3 and is_complete(run)
    for name, weight in straight.policy.state_dict().items():
        assert torch.equal(weight, resumed.policy.state_dict()[name]), name
    assert rows(run) == rows(tmp_path / "straight" / "run")  # each iteration exactly once, in order
    assert generations(run) == generations(tmp_path / "straight" / "run")


@pytest.mark.slow
def test_resume_skips_damaged_checkpoints_and_replays_each_iteration_once(tmp_path, random_model_dir, capsys):
    common = ["--model.init_args.iterations=3", "--checkpoint.every_n_iterations=1", "--checkpoint.keep_last=2"]
    fit(tmp_path, random_model_dir, *common, *DIGITS)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    complete = rows(run), generations(run)
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["iter_00002.ckpt", "iter_00003.ckpt", "last.ckpt"]
    data = bytearray((ckpts / "last.ckpt").read_bytes())
    data[-6000:-1904] = bytes(b ^ 0xFF for b in data[-6000:-1904])  # 4 KiB flipped inside the last tensor
    (ckpts / "last.ckpt").write_bytes(bytes(data))
    (ckpts / "iter_00003.ckpt").write_bytes((ckpts / "iter_00003.ckpt").read_bytes()[:1000])  # truncated
    capsys.readouterr()
    resumed = fit(tmp_path, random_model_dir, *common, "--ckpt_path=last", *DIGITS).model
    out = capsys.readouterr().out
    assert f"skipped {ckpts / 'last.ckpt'} (sha256 mismatch" in out and f"skipped {ckpts / 'iter_00003.ckpt'}" in out
    assert f"resuming from {ckpts / 'iter_00002.ckpt'}" in out
    assert resumed.iteration == 3
    assert (rows(run), generations(run)) == complete  # iteration 3's rows dropped, then written once by the replay
    (ckpts / "last.ckpt").unlink()
    for path in ckpts.glob("iter_*.ckpt"):
        path.write_bytes(b"")
    with pytest.raises(RunDirError, match=r"no checkpoint in .* verifies"):
        fit(tmp_path, random_model_dir, *common, "--ckpt_path=last", *DIGITS)


def test_resuming_under_other_training_settings_stops_with_a_diff(tmp_path, random_model_dir, monkeypatch):
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", *DIGITS)
    loaded = []
    monkeypatch.setattr("llm_pg.modules.components.load_policy", lambda *a, **k: loaded.append(1))
    changed = ["--model.init_args.lr=1e-3", "--model.init_args.group_size=2", "--model.init_args.iterations=2"]
    with pytest.raises(RunDirError) as error:
        fit(tmp_path, random_model_dir, *changed, "--ckpt_path=last", *DIGITS)
    message = str(error.value)
    assert "model.init_args.group_size: 4 -> 2; model.init_args.lr: 0.0003 -> 0.001" in message
    assert "iterations" not in message and "\n" not in message and not loaded  # before any model loads


def test_allowed_resume_changes_are_not_reported():
    stored = {
        "model": {"init_args": {"lr": 3e-4, "iterations": 2, "evaluation": {"every": 5}}},
        "trainer": {"devices": 1},
    }
    current = {
        "model": {"init_args": {"lr": 3e-4, "iterations": 9, "evaluation": {"every": 1}}},
        "trainer": {"devices": 2},
    }
    current["checkpoint"] = {"keep_last": 5}
    assert config_changes(stored, current) == ["trainer.devices: 1 -> 2"]
    # A key newer than the checkpoint is no change at its default (it reproduces the older code), else it is one.
    current["trainer"]["devices"], current["model"]["init_args"]["advantage"] = 1, "grpo"
    assert config_changes(stored, current, {"model.init_args.advantage": "grpo"}) == []
    current["model"]["init_args"]["advantage"] = "rloo"
    assert config_changes(stored, current, {"model.init_args.advantage": "grpo"}) == [
        "model.init_args.advantage: <unset> -> rloo"
    ]


def test_class_defaults_come_from_the_configured_classes():
    from llm_pg.runs.config import class_defaults

    config = {
        "model": {"class_path": "llm_pg.modules.GRPOModule"},
        "data": {"task": {"class_path": "conftest.DigitTask"}},
    }
    defaults = class_defaults(config)
    assert defaults["model.init_args.clip_eps"] == 0.2 and defaults["model.init_args.kl_coef"] == 0.05
    assert defaults["data.prompts_per_step"] == 8


def test_trim_logs_keeps_rows_up_to_the_checkpoint_and_drops_a_cut_row(tmp_path):
    (tmp_path / "metrics.csv").write_bytes(b"eval/x,step,train/r\r\n0.1,0,\r\n,1,0.3\r\n,2,0.7\r\n,3,0.9\r\n,4,")
    lines = [json.dumps({"iteration": i, "reward": 0.1 * i}) for i in range(4)]
    (tmp_path / "generations.jsonl").write_text("\n".join(lines) + '\n{"iteration": 4, "rew')
    (tmp_path / "eval").mkdir()
    for i in (0, 2, 4):
        (tmp_path / "eval" / f"iter_{i:05d}.jsonl").write_text("{}\n")
    (tmp_path / "COMPLETE").write_text("{}")
    trim_logs(tmp_path, 2)
    assert (tmp_path / "metrics.csv").read_bytes() == b"eval/x,step,train/r\r\n0.1,0,\r\n,1,0.3\r\n,2,0.7\r\n"
    # The rows count from 0 (a file from before the counter was 1-based): renumbered 1-4, then those <= 2 kept.
    kept = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [(row["iteration"], row["reward"]) for row in kept] == [(1, 0.0), (2, 0.1)]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["iter_00000.jsonl", "iter_00002.jsonl"]
    assert not (tmp_path / "COMPLETE").exists()
    # A 1-based file is trimmed as it is, byte for byte, and trimming again changes nothing.
    lines = [json.dumps({"iteration": i, "reward": 0.5}) for i in (1, 2, 3)]
    (tmp_path / "generations.jsonl").write_text("\n".join(lines) + "\n")
    trim_logs(tmp_path, 2)
    trim_logs(tmp_path, 2)
    assert (tmp_path / "generations.jsonl").read_text() == "\n".join(lines[:2]) + "\n"


def _main_error(capsys, *args) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.init_args.group_size=1", "group_size must be >= 2"),
        ("--model.init_args.lr=abc", "Parser key \"lr\": Expected a <class 'float'>. Got value: abc"),
        ("--checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
        ("--checkpoint.every_n_iterations=0", "checkpoint.every_n_iterations must be >= 1"),
        ("--data.prompts_per_step=0", "prompts_per_step must be >= 1"),
    ],
)
def test_config_errors_print_one_line_and_exit_2(tmp_path, capsys, monkeypatch, override, message):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")  # restored after the test, which --debug sets to 1
    config = f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"
    code, lines = _main_error(capsys, "fit", config, f"--runs_root={tmp_path}", "--wandb_project=null", override)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith("llm-pg: error:") and "Traceback" not in lines[0]
    with pytest.raises((ValueError, SystemExit)):  # --debug shows the real exception
        main(["fit", config, f"--runs_root={tmp_path}", "--wandb_project=null", override, "--debug"])


def test_a_run_dir_refusal_is_one_line_too(tmp_path, capsys, monkeypatch, random_model_dir):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("step\n")
    args = ["fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    code, lines = _main_error(capsys, *args, "--run_name=run", *SMALL)
    assert code == 2 and len(lines) == 1 and f"run dir {tmp_path / 'run'} already holds a run" in lines[0]


def test_checkpoints_verify_and_hold_the_run_config(tmp_path, random_model_dir):
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", "--model.init_args.lr=0.002", *DIGITS)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert verify(last) is None
    iteration, config = read_header(last)
    assert iteration == 1 and config["model"]["init_args"]["lr"] == 0.002 and config["run_name"] == "run"


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_ends_bitwise_equal(tmp_path, random_model_dir):
    """benchmarks/kill_resume.py with one kill: SIGKILL while last.ckpt is being written, in subprocesses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kill_resume", ROOT / "benchmarks" / "kill_resume.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = [f"--model.init_args.model_name_or_path={random_model_dir}", *SMALL, *DIGITS]
    assert bench.run(bench.fit_command(tmp_path, "reference", 3, small)) == 0
    command = bench.fit_command(tmp_path, "killed", 3, small)
    kill = bench.start_and_kill(command, tmp_path / "killed" / "checkpoints", signal.SIGKILL, 1, 0.0, write=True)
    assert kill["code"] == -signal.SIGKILL and kill["write"]
    assert bench.resume_until_done(bench.fit_command(tmp_path, "killed", 3, small, resume=True)) == 1
    assert bench.same_run(tmp_path / "reference", tmp_path / "killed") == {
        "weights": True,
        "metrics": True,
        "generations": True,
    }
    assert not list((tmp_path / "killed" / "checkpoints").glob(".*tmp-*"))  # the resume's writes replaced it


@pytest.mark.slow
def test_a_run_whose_dir_is_moved_stops_without_writing_into_a_new_run_there_and_resumes_where_it_went(
    tmp_path, random_model_dir
):
    """A live run's directory is moved and a new run claims a directory at the same path: the old process exits
    (`RUN_DIR_GONE`) at its next write instead of writing its metrics, generations or checkpoints into the new run,
    and the moved directory resumes to the end."""
    from llm_pg.runs.directory import RUN_DIR_GONE

    run, moved = tmp_path / "run", tmp_path / "moved"
    command = [
        sys.executable, "-m", "llm_pg.cli.fit", "fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        f"--model.init_args.model_name_or_path={random_model_dir}", f"--runs_root={tmp_path}", "--run_name=run",
        *SMALL, *DIGITS, "--model.init_args.iterations=40",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "last.ckpt").is_file():
            assert process.poll() is None and time.monotonic() < deadline, "the run never saved a checkpoint"
            time.sleep(0.05)
        os.rename(run, moved)
        run.mkdir()
        new_run = RunLock.acquire(run)  # a new run of the same name
        try:
            _, err = process.communicate(timeout=120)
            assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing of the old run written here
        finally:
            new_run.release()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == RUN_DIR_GONE, err[-2000:]
    assert f"run dir {run} was moved or replaced" in err and f"it is now {moved}" in err
    assert not is_complete(moved) and verify(moved / "checkpoints" / "last.ckpt") is None
    fit(tmp_path, random_model_dir, "--run_name=moved", "--model.init_args.iterations=40", "--ckpt_path=last", *DIGITS)
    assert is_complete(moved)
    assert [int(r["step"]) for r in rows(moved) if "train/reward" in r] == list(range(1, 41))


def test_validate_leaves_a_trained_runs_files_alone(tmp_path, random_model_dir):
    from llm_pg.cli.fit import run_cli

    fit(tmp_path, random_model_dir, "--model.init_args.iterations=1", *DIGITS)
    run = tmp_path / "run"
    before = {name: (run / name).read_bytes() for name in ("metrics.csv", "config.yaml")}
    config = f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"
    model = f"--model.init_args.model_name_or_path={random_model_dir}"
    run_cli(["validate", config, model, f"--runs_root={tmp_path}", "--run_name=run", "--wandb_project=null", *DIGITS])
    assert {name: (run / name).read_bytes() for name in before} == before
    assert (run / "validate" / "metrics.csv").is_file()


def test_each_iteration_is_saved_before_the_next_rollout_starts(tmp_path, random_model_dir, monkeypatch):
    from llm_pg.callbacks import checkpoint as ckpt
    from llm_pg.callbacks.rollout import RolloutCallback

    events = []
    rollout, save = RolloutCallback.on_train_batch_start, ckpt.atomic_save
    monkeypatch.setattr(RolloutCallback, "on_train_batch_start", lambda *a: events.append("rollout") or rollout(*a))
    monkeypatch.setattr(
        ckpt, "atomic_save", lambda c, p: events.append(f"save {c['llm_pg']['iteration']}") or save(c, p)
    )
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", "--checkpoint.every_n_iterations=10", *DIGITS)
    assert events == ["rollout", "save 1", "rollout", "save 2", "rollout", "save 3"]  # last.ckpt every iteration


class Crash(L.Callback):
    """Raises (as an out-of-memory error or a lost machine would stop the run) in the rollout after iteration `at`,
    when that iteration's rows are flushed to metrics.csv."""

    def __init__(self, at: int = 3) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, *args) -> None:
        if module.iteration == self.at:
            raise RuntimeError("simulated crash")


def test_last_ckpt_every_n_iterations_flushes_every_iteration_and_saves_on_signals(
    tmp_path, random_model_dir, monkeypatch
):
    # last.ckpt every 2 iterations (a checkpoint too large to write every iteration): saved after 2, 4 and the
    # last (5); metrics.csv holds every finished iteration's row before the next rollout all the same.
    from llm_pg.callbacks import checkpoint as ckpt
    from llm_pg.callbacks.rollout import RolloutCallback

    events = []
    run = tmp_path / "run"

    def rollout(*args):
        flushed = len([r for r in rows(run) if "train/loss" in r]) if (run / "metrics.csv").exists() else 0
        events.append(f"rollout ({flushed} rows)")
        return original_rollout(*args)

    original_rollout, save = RolloutCallback.on_train_batch_start, ckpt.atomic_save
    monkeypatch.setattr(RolloutCallback, "on_train_batch_start", rollout)
    monkeypatch.setattr(
        ckpt, "atomic_save", lambda c, p: events.append(f"save {c['llm_pg']['iteration']}") or save(c, p)
    )
    cadence = ["--checkpoint.every_n_iterations=10", "--checkpoint.last_every_n_iterations=2", *DIGITS]
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=5", *cadence)
    assert events == [
        "rollout (0 rows)", "rollout (1 rows)", "save 2", "rollout (2 rows)", "rollout (3 rows)", "save 4",
        "rollout (4 rows)", "save 5",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "crash"])
def test_a_sparse_last_ckpt_resumes_into_the_uninterrupted_run(tmp_path, random_model_dir, stop):
    # last.ckpt every 2 iterations, stopped after iteration 3: SIGTERM still saves iteration 3; a crash leaves
    # iteration 2's checkpoint, and the resume drops iteration 3's logged rows and trains it again. Either way the
    # run ends as one never stopped: the same weights, each iteration's row once, in order.
    common = ["--model.init_args.iterations=4", "--checkpoint.last_every_n_iterations=2", *DIGITS]
    straight = fit(tmp_path / "straight", random_model_dir, *common).model
    callback = "test_run_safety.SendSignal" if stop == "sigterm" else "test_run_safety.Crash"
    stopper = f"--trainer.callbacks+={{'class_path': '{callback}', 'init_args': {{'at': 3}}}}"
    with pytest.raises(RunInterrupted if stop == "sigterm" else RuntimeError):
        fit(tmp_path / "b", random_model_dir, *common, stopper)
    run = tmp_path / "b" / "run"
    assert read_header(run / "checkpoints" / "last.ckpt")[0] == (3 if stop == "sigterm" else 2)
    if stop == "crash":
        assert [float(r["step"]) for r in rows(run) if "train/loss" in r] == [1, 2, 3]  # 3 flushed, not saved
    resumed = fit(tmp_path / "b", random_model_dir, *common, "--ckpt_path=last").model
    assert resumed.iteration == 4 and is_complete(run)
    for name, weight in straight.policy.state_dict().items():
        assert torch.equal(weight, resumed.policy.state_dict()[name]), name
    assert rows(run) == rows(tmp_path / "straight" / "run")
    assert generations(run) == generations(tmp_path / "straight" / "run")


def test_a_last_ckpt_cadence_below_one_is_refused_in_one_line():
    from llm_pg.callbacks.checkpoint import IterationCheckpoint

    with pytest.raises(
        ValueError, match=r"^checkpoint\.last_every_n_iterations must be >= 1, got 0; 1 \(the default\)"
    ):
        IterationCheckpoint(last_every_n_iterations=0)


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--config", "configs/tiny/format_copy_grpo.yaml", "--overwrite", "true"],  # as `make demo` starts it
        ["fit", "--config", "configs/tiny/format_copy_grpo.yaml", "--overwrite=true"],
        ["fit", "--overwrite", "true", "--config", "configs/tiny/format_copy_grpo.yaml", "--ckpt_path=last"],
        ["fit", "--ckpt_path", "last", "--config", "configs/tiny/format_copy_grpo.yaml"],
    ],
)
def test_the_resume_line_is_a_command_that_works(args):
    from llm_pg.cli.fit import RunSession

    message = str(RunSession(args).interrupted(signal.SIGINT))
    assert message == (
        "llm-pg: stopped by SIGINT; no iteration finished. "
        "Resume: llm-pg fit --config configs/tiny/format_copy_grpo.yaml --ckpt_path last"
    )


def test_ctrl_c_is_not_called_sigterm_in_lightnings_log_line(caplog):
    from llm_pg.callbacks.checkpoint import LIGHTNING_SIGNALS, SIGNAL_NAME

    logger = logging.getLogger(LIGHTNING_SIGNALS)
    logger.addFilter(SIGNAL_NAME)
    try:
        with caplog.at_level(logging.INFO, logger=LIGHTNING_SIGNALS):
            logger.info("[rank: 0] Received SIGTERM: %d", signal.SIGINT)
            logger.info("Received SIGTERM: %d", signal.SIGTERM)
    finally:
        logger.removeFilter(SIGNAL_NAME)
    assert [r.getMessage() for r in caplog.records] == ["[rank: 0] Received SIGINT", "Received SIGTERM"]


@pytest.mark.parametrize(
    ("flag", "shown"),
    [
        ("--trainer.max_steps=3", "trainer.max_steps=3"),
        ("--trainer.max_time=00:00:00:15", "trainer.max_time='00:00:00:15'"),
        ("--trainer.max_epochs=1", "trainer.max_epochs=1"),
        ("--trainer.fast_dev_run=true", "trainer.fast_dev_run=True"),
    ],
)
def test_a_lightning_limit_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, flag, shown):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    config = f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"
    with pytest.raises(SystemExit) as stopped:
        main(["fit", config, f"--runs_root={tmp_path}", "--run_name=run", "--wandb_project=null", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"llm-pg: error: {shown} would stop the run before its model.init_args.iterations=30 and leave it looking "
        "finished; a run's length is model.init_args.iterations"
    )
    assert not (tmp_path / "run").exists()


class LongPromptTask(DigitTask):
    """DigitTask whose stream example 1 is a broken data row: a prompt of 20,000 characters."""

    def train_example(self, index: int, seed: int) -> Example:
        if index == 1:
            return Example(prompt="Say digits " + "12345 " * 3400, answer="")
        return super().train_example(index, seed)


def test_a_prompt_beyond_the_models_context_stops_the_run_naming_it_before_any_tensor(tmp_path, random_model_dir):
    task = ["--data.task=test_run_safety.LongPromptTask", "--data.task.init_args.eval_size=4"]
    with pytest.raises(RunStopped) as stopped:
        fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", *task)
    message = str(stopped.value)
    assert message.startswith("the prompt 'Say digits 12345 12345 ") and "(iteration 1's rollout) has " in message
    assert message.endswith(
        "tokens, and with max_new_tokens=8 the model's context of 512 tokens leaves room for at most 504; set "
        "model.init_args.max_prompt_tokens (each prompt keeps its last tokens) or fix the data row"
    )
    assert "\n" not in message and not is_complete(tmp_path / "run")
    # With max_prompt_tokens the prompt keeps its last tokens and the run trains.
    fit(tmp_path / "cut", random_model_dir, "--model.init_args.iterations=1", "--model.init_args.max_prompt_tokens=64",
        *task)  # fmt: skip
    assert is_complete(tmp_path / "cut" / "run")


def test_a_checkpoint_file_never_replaces_the_command_lines_settings(tmp_path, random_model_dir):
    fit(tmp_path / "a", random_model_dir, "--model.init_args.iterations=2", *DIGITS)
    other = str(tmp_path / "a" / "run" / "checkpoints" / "last.ckpt")
    changed = ["--model.init_args.lr=1e-3", "--model.init_args.iterations=3", f"--ckpt_path={other}"]
    with pytest.raises(RunDirError) as error:
        fit(tmp_path / "b", random_model_dir, *changed, *DIGITS)
    assert "was trained with other settings: model.init_args.lr: 0.0003 -> 0.001" in str(error.value)
    # Only the length changed (allowed under a constant rate): the run trains to this command line's 3 iterations.
    resumed = fit(tmp_path / "b", random_model_dir, "--model.init_args.iterations=3", f"--ckpt_path={other}", *DIGITS)
    assert resumed.model.hparams.iterations == 3 and resumed.model.iteration == 3
    assert resumed.model.hparams.lr == 3e-4
