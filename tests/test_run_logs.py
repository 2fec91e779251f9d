"""Logs are written like checkpoints, and nothing a run trained is ever deleted (llm_pg/runs/logs.py,
llm_pg/runs/loggers.py, the CLI's refusal to start afresh over a trained run)."""

import errno
import sys

import pytest
from conftest import ROOT, SMALL

from llm_pg.cli.fit import main, run_cli
from llm_pg.runs.directory import trained_contents
from llm_pg.runs.loggers import ResumableCSVLogger
from llm_pg.runs.logs import trim_logs

DIGITS = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]
ROWS = "eval/exact_match,step,train/reward\r\n0.25,0,\r\n,1,0.5\r\n,2,0.75\r\n"


def snapshot(path) -> dict[str, bytes]:
    """The run's files and their bytes; not `.lock`, which records its latest holder (pid, host, a fresh token)."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_resumed_logger_never_deletes_or_rewrites_metrics_csv(tmp_path, monkeypatch):
    """Before, the logger read metrics.csv, let Lightning delete it, and wrote it back: a full disk (injected at
    that write) lost every row. Now nothing is deleted or rewritten when the logger starts."""
    (tmp_path / "metrics.csv").write_bytes(ROWS.encode())
    monkeypatch.setattr("pathlib.Path.write_bytes", full_disk)
    monkeypatch.setattr("pathlib.Path.write_text", full_disk)
    logger = ResumableCSVLogger(str(tmp_path))
    writer = logger.experiment
    assert (tmp_path / "metrics.csv").read_bytes() == ROWS.encode()
    assert writer.metrics_keys == ["eval/exact_match", "step", "train/reward"]
    writer.log_metrics({"train/reward": 1.3}, step=3)
    writer.save()  # appended under the header it found
    assert (tmp_path / "metrics.csv").read_bytes().endswith(b",3,1.3\r\n")


def test_a_full_disk_during_a_header_rewrite_leaves_the_old_metrics_whole(tmp_path, monkeypatch):
    """A new column makes the writer rewrite the file: a full disk at that exact write keeps the old file."""
    import llm_pg.runs.directory

    (tmp_path / "metrics.csv").write_bytes(ROWS.encode())
    writer = ResumableCSVLogger(str(tmp_path)).experiment
    writer.log_metrics({"train/kl": 0.01}, step=3)  # a column the file does not have yet
    real_fsync = llm_pg.runs.directory.os.fsync
    monkeypatch.setattr(llm_pg.runs.directory.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.save()
    assert (tmp_path / "metrics.csv").read_bytes() == ROWS.encode()
    assert not list(tmp_path.glob(".metrics.csv.tmp-*"))
    monkeypatch.setattr(llm_pg.runs.directory.os, "fsync", real_fsync)
    writer.metrics = [{"train/kl": 0.01, "step": 3}]
    writer.save()
    text = (tmp_path / "metrics.csv").read_bytes().decode()
    assert text.splitlines()[0] == "eval/exact_match,step,train/kl,train/reward" and text.endswith(",3,0.01,\r\n")
    assert text.count("\r\n") == 5  # header and four rows, each row under the new header


def test_a_full_disk_during_a_trim_leaves_the_old_metrics_whole(tmp_path, monkeypatch):
    import llm_pg.runs.directory

    (tmp_path / "metrics.csv").write_bytes(ROWS.encode())
    monkeypatch.setattr(llm_pg.runs.directory.os, "fsync", full_disk)
    with pytest.raises(OSError):
        trim_logs(tmp_path, 1)
    assert (tmp_path / "metrics.csv").read_bytes() == ROWS.encode()
    monkeypatch.undo()
    trim_logs(tmp_path, 1)
    assert (tmp_path / "metrics.csv").read_bytes() == b"eval/exact_match,step,train/reward\r\n0.25,0,\r\n,1,0.5\r\n"


def test_trim_touches_only_the_trainers_own_files(tmp_path):
    (tmp_path / "eval").mkdir()
    for name in ("iter_00001.jsonl", "iter_00005.jsonl", "iter_x.jsonl", "notes.txt"):
        (tmp_path / "eval" / name).write_text("{}\n")
    trim_logs(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["iter_00001.jsonl", "iter_x.jsonl", "notes.txt"]
    (tmp_path / "metrics.csv").write_text("loss,epoch\n1,2\n")  # not this trainer's log: refused, not deleted
    (tmp_path / "COMPLETE").write_text("{}\n")
    with pytest.raises(ValueError, match="has no step column"):
        trim_logs(tmp_path, 2)
    assert (tmp_path / "metrics.csv").read_text() == "loss,epoch\n1,2\n"
    assert (tmp_path / "COMPLETE").is_file()  # a refused resume changes nothing (found in review: it went)


def test_what_says_a_run_trained_there(tmp_path):
    assert trained_contents(tmp_path) == []
    (tmp_path / "metrics.csv").write_text(ROWS.replace(",2,0.75\r\n", ""))  # a run killed in its first save
    assert trained_contents(tmp_path) == []
    (tmp_path / "metrics.csv").write_text(ROWS)
    assert trained_contents(tmp_path) == ["metrics.csv with rows up to iteration 2"]
    assert trained_contents(tmp_path, first_save=2) == []
    (tmp_path / "final").mkdir()
    (tmp_path / "COMPLETE").write_text("{}")
    assert trained_contents(tmp_path)[:2] == ["COMPLETE", "final/"]


def test_a_finished_run_whose_checkpoints_were_deleted_is_never_retrained_over(
    tmp_path, random_model_dir, capsys, monkeypatch
):
    import shutil

    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    args = ["fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    args += [f"--model.init_args.model_name_or_path={random_model_dir}", "--run_name=run", *SMALL, *DIGITS]
    args += ["--model.init_args.iterations=2"]
    run_cli(args)
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints")  # freeing disk, as users do
    before = snapshot(run)
    with pytest.raises(SystemExit) as stop:
        main([*args, "--ckpt_path=last"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg")]
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert f"run dir {run} holds a trained run (COMPLETE, final/, metrics.csv with rows up to iteration 2)" in lines[0]
    assert "--overwrite true" in lines[0] and "--run_name" in lines[0]
    assert snapshot(run) == before  # nothing deleted, nothing retrained


def test_another_runs_checkpoint_never_trims_a_trained_run(tmp_path, random_model_dir, capsys, monkeypatch):
    """Found in review: `--run_name B --ckpt_path runs/A/checkpoints/iter_...` trimmed B's rows and overwrote it."""
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    base = ["fit", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    base += [
        f"--model.init_args.model_name_or_path={random_model_dir}",
        *SMALL,
        *DIGITS,
        "--checkpoint.every_n_iterations=1",
    ]
    run_cli([*base, "--run_name=a", "--model.init_args.iterations=1"])
    run_cli([*base, "--run_name=b", "--model.init_args.iterations=2"])
    before = snapshot(tmp_path / "b")
    with pytest.raises(SystemExit) as stop:
        main(
            [
                *base,
                "--run_name=b",
                "--model.init_args.iterations=2",
                f"--ckpt_path={tmp_path}/a/checkpoints/iter_00001.ckpt",
            ]
        )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg")]
    assert stop.value.code == 2 and "is not this run's" in lines[0], lines
    assert snapshot(tmp_path / "b") == before


def test_the_first_save_counts_the_runs_own_cadence(tmp_path):
    """A run trained with last_every_n_iterations=5, killed in its first write, is replayed (rows up to 5), even
    when the resume gives the default cadence (found in review)."""
    from types import SimpleNamespace

    from llm_pg.cli.fit import _first_save

    (tmp_path / "config.yaml").write_text("checkpoint:\n  every_n_iterations: 10\n  last_every_n_iterations: 5\n")
    assert _first_save(SimpleNamespace(last_every_n_iterations=1, every_n_iterations=10), tmp_path) == 5
    (tmp_path / "config.yaml").write_text("!!python/object/apply:os.system ['true']\n")  # never run, just ignored
    assert _first_save(SimpleNamespace(last_every_n_iterations=1, every_n_iterations=10), tmp_path) == 1
