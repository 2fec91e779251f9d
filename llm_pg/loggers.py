"""The run's loggers: CSV always (`metrics.csv`), W&B unless switched off (offline without an API key)."""

from __future__ import annotations

import csv
import hashlib
import os
import warnings
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

# The run dir always holds files when the CSV logger starts (its `.lock`; a resumed run's logs): `llm_pg.runs.claim`
# has already checked that this run owns it, so Lightning's warning about a non-empty directory says nothing here.
NOT_EMPTY = r"Experiment logs directory .* exists and is not empty"


class ResumableCSVLogger(CSVLogger):
    """A CSVLogger writing `<run dir>/metrics.csv` that, when `resume` is set, keeps the rows already there.

    Lightning's CSVLogger deletes an existing metrics.csv when it starts; a resumed run must append. Before
    a resume the CLI has dropped the rows of iterations after the checkpoint (`llm_pg.runs.trim_logs`), so
    the replay writes each iteration's row once. Rows reach the file when the checkpoint callback flushes
    the loggers, before every checkpoint write.
    """

    def __init__(self, run_dir: str, resume: bool = False) -> None:
        super().__init__(save_dir=run_dir, name="", version="")
        self.resume = resume

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._experiment is None:
            path = Path(self.log_dir) / "metrics.csv"
            kept = path.read_bytes() if self.resume and path.is_file() else None
            with warnings.catch_warnings():  # only around the writer's creation, the one place it warns
                warnings.filterwarnings("ignore", message=NOT_EMPTY)
                experiment = super().experiment  # creating the writer deletes an existing metrics.csv
            if kept:
                path.write_bytes(kept)
                with path.open(newline="") as f:
                    experiment.metrics_keys = next(csv.reader(f))
        return self._experiment


def default_loggers(run_dir: str, run_name: str, wandb_project: str | None, resume: bool) -> list[Logger]:
    """CSV in `run_dir`, plus W&B with a run id fixed by the run name, so a resumed run continues its curves.

    W&B prints nothing of its own offline (the run's summary gives the `wandb sync` command) and only its run and
    project links online."""
    loggers: list[Logger] = [ResumableCSVLogger(run_dir, resume=resume)]
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
