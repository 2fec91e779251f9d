"""The run's loggers: CSV always (`metrics.csv`), W&B unless switched off (offline without an API key)."""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import secrets
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from llm_pg.runs.directory import WANDB_ID, ensure_run_dir, write_text_atomic


class AtomicExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that it never deletes `metrics.csv` and every rewrite is atomic.

    Lightning's writer deletes an existing `metrics.csv` when it starts and rewrites the whole file in place when a
    new column appears: a kill or a full disk in either window loses the run's metrics. This one adopts the file it
    finds (its header becomes the column list, so rows are appended under it) and rewrites through a temp file,
    fsync and `os.replace`. A fresh start finds no file: `runs.directory.claim` and `runs.logs.trim_logs` have
    made sure the file there, if any, holds only rows this run replays.
    """

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file() and path.stat().st_size:
            with path.open(newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    def save(self) -> None:
        ensure_run_dir(self.metrics_file_path)  # still this run's directory (a moved one ends the run)
        keys = list(self.metrics_keys)
        try:
            super().save()
        except BaseException:  # nothing was written: the next save must still see the new columns as new
            self.metrics_keys = keys
            raise

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
        write_text_atomic(path, out.getvalue())


class ResumableCSVLogger(CSVLogger):
    """A CSVLogger writing `<run dir>/metrics.csv` with `AtomicExperimentWriter`: a resumed run appends to the rows
    already there (the CLI has dropped those of iterations after the checkpoint, `runs.logs.trim_logs`, so the
    replay writes each iteration's row once). Rows reach the file when the checkpoint callback flushes the loggers,
    after every iteration."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(save_dir=run_dir, name="", version="")

    @property
    @rank_zero_experiment
    def experiment(self) -> AtomicExperimentWriter:
        if self._experiment is None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = AtomicExperimentWriter(log_dir=self.log_dir)
        return self._experiment


_ID = re.compile(r"[0-9a-z]{8,64}")  # what an id read back from a run dir may be (the file is untrusted)


def uses_wandb(wandb_project: str | None) -> bool:
    """Whether a run logs to W&B: a project is named and `WANDB_MODE` is not `disabled`."""
    return bool(wandb_project) and os.environ.get("WANDB_MODE") != "disabled"


def path_wandb_id(run_dir: str | Path, wandb_project: str) -> str:
    """The W&B id runs had before their id was kept in the run dir: a hash of the project and the run dir's path
    (the same for every run ever started in that directory)."""
    return hashlib.sha1(f"{wandb_project}/{Path(run_dir).resolve()}".encode()).hexdigest()[:16]


def kept_wandb_id(run_dir: str | Path) -> str | None:
    """The id in `<run_dir>/wandb_id`, when it holds one (the file is untrusted: anything else is no id)."""
    path = Path(run_dir) / WANDB_ID
    try:
        kept = path.read_text(encoding="ascii")[:100].strip() if path.is_file() and not path.is_symlink() else ""
    except (OSError, UnicodeDecodeError):
        kept = ""
    return kept if _ID.fullmatch(kept) else None


def run_wandb_id(run_dir: str | Path, wandb_project: str, resume: bool) -> str:
    """The run's W&B id, kept in `<run_dir>/wandb_id` so that a resume continues the same W&B run and a fresh start
    in the same directory (after `--overwrite true`, or once the old directory is deleted) opens a new one instead
    of resuming the old run's curves (W&B would drop every step the old run had already logged).

    The id in the file when it holds one (a resume, or a fresh start replaying a run killed before its first
    checkpoint); else, for a resume of a run that logged to W&B before the file existed (its `wandb/` holds a run
    of that id), `path_wandb_id`, so its curves continue; else a new random id, written to the file (atomically)
    before W&B starts. Called in the process that owns the run dir, after `runs.directory.claim`."""
    kept = kept_wandb_id(run_dir)
    if kept is not None:
        return kept
    legacy = path_wandb_id(run_dir, wandb_project)
    logged = resume and any(p.name.endswith(f"-{legacy}") for p in (Path(run_dir) / "wandb").glob("*run-*"))
    run_id = legacy if logged else secrets.token_hex(8)
    write_text_atomic(Path(run_dir) / WANDB_ID, run_id + "\n")
    return run_id


def validate_wandb_id(run_dir: str | Path, wandb_project: str) -> str:
    """The W&B id of `llm-pg validate` on the run in `run_dir`: derived from the run's own id (read, never written),
    so that each run's validation is its own W&B run; `path_wandb_id` of `<run_dir>/validate` for a run without
    one."""
    kept = kept_wandb_id(run_dir)
    if kept is None:
        return path_wandb_id(Path(run_dir) / "validate", wandb_project)
    return hashlib.sha1(f"{kept}/validate".encode()).hexdigest()[:16]


def default_loggers(
    run_dir: str, run_name: str, wandb_project: str | None, wandb_id: str | None = None
) -> list[Logger]:
    """CSV in `run_dir`, plus W&B (`uses_wandb`) as the run `wandb_id` (`run_wandb_id`; default `path_wandb_id`),
    resumed when W&B knows it, so a resumed run continues its curves.

    W&B prints nothing of its own offline (the run's summary gives the `wandb sync` command) and only its run and
    project links online."""
    loggers: list[Logger] = [ResumableCSVLogger(run_dir)]
    if uses_wandb(wandb_project):
        import wandb

        offline = not os.environ.get("WANDB_API_KEY")
        logger = WandbLogger(
            project=wandb_project,
            name=run_name,
            id=wandb_id or path_wandb_id(run_dir, wandb_project),
            resume="allow",
            save_dir=run_dir,
            offline=offline,
            settings=wandb.Settings(silent=True) if offline else wandb.Settings(quiet=True),
        )
        # Lightning 2.6 always passes `anonymous` (None by default), which wandb 0.31 no longer has and warns about
        # on every run; leaving the key out is what wandb's warning asks for.
        logger._wandb_init.pop("anonymous", None)
        loggers.append(logger)
    return loggers
