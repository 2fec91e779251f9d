"""The run's loggers: CSV always (`metrics.csv`), W&B unless switched off (offline without an API key)."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from llm_pg.runs.directory import write_text_atomic


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


def default_loggers(run_dir: str, run_name: str, wandb_project: str | None) -> list[Logger]:
    """CSV in `run_dir`, plus W&B with a run id fixed by the run name, so a resumed run continues its curves.

    W&B prints nothing of its own offline (the run's summary gives the `wandb sync` command) and only its run and
    project links online."""
    loggers: list[Logger] = [ResumableCSVLogger(run_dir)]
    if wandb_project and os.environ.get("WANDB_MODE") != "disabled":
        import wandb

        offline = not os.environ.get("WANDB_API_KEY")
        logger = WandbLogger(
            project=wandb_project,
            name=run_name,
            id=hashlib.sha1(f"{wandb_project}/{Path(run_dir).resolve()}".encode()).hexdigest()[:16],
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
