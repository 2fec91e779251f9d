"""The end of `llm-pg fit`: a few lines saying what the run did, and the run's own report and overview plot.

Everything is read back from the run's `metrics.csv`, so a resumed run's summary covers all of its iterations:

    eval EM    first evaluation (iteration 0: the pre-RL baseline) -> last, and the best with its iteration
    reward     mean of `train/reward` over the first k iterations -> over the last k (k = min(3, iterations // 2))
    time       wall = `time/elapsed` at the last iteration (the training clock, resumes included) + the evaluations
               before the first and after the last iteration (outside that clock); per iteration: mean
               `time/rollout`, mean `time/update`, sum of `time/eval` / iterations, and the rest (checkpoints,
               logging). Model loading is not counted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.loggers import WandbLogger

from llm_pg.cli.report import write_report
from llm_pg.cli.report.runs import read_run
from llm_pg.runs.directory import ensure_run_dir

REWARD_WINDOW = 3  # iterations averaged at each end of the reward curve: one iteration's mean is noisy


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The summary's numbers from `<run_dir>/metrics.csv`; a key is None when the run logged nothing for it."""
    run = read_run(run_dir)
    steps, reward = run.values("train/reward")
    eval_steps, em = run.values("eval/exact_match")
    iterations = int(steps.max()) if len(steps) else 0
    k = max(1, min(REWARD_WINDOW, len(reward) // 2))
    best = int(np.argmax(em)) if len(em) else None  # the first evaluation reaching the best value
    seconds = {c: run.series.get(f"time/{c}", {}) for c in ("rollout", "update", "eval", "elapsed")}
    evaluation = seconds["eval"]
    if seconds["elapsed"]:
        outside = [evaluation.get(0, 0.0)] + ([evaluation.get(iterations, 0.0)] if iterations else [])
        wall = seconds["elapsed"][max(seconds["elapsed"])] + sum(outside)
    else:  # a run logged before `time/elapsed` existed: the phases it timed
        wall = sum(sum(values.values()) for name, values in seconds.items() if name != "elapsed")
    per_iteration = max(iterations, 1)
    return {
        "iterations": iterations,
        "em_first": (int(eval_steps[0]), float(em[0])) if len(em) else None,
        "em_last": (int(eval_steps[-1]), float(em[-1])) if len(em) else None,
        "em_best": (int(eval_steps[best]), float(em[best])) if best is not None else None,
        "reward_window": k,
        "reward_first": float(reward[:k].mean()) if len(reward) else None,
        "reward_last": float(reward[-k:].mean()) if len(reward) else None,
        "wall_seconds": wall,
        "rollout_per_iteration": float(np.mean(list(seconds["rollout"].values()))) if seconds["rollout"] else 0.0,
        "update_per_iteration": float(np.mean(list(seconds["update"].values()))) if seconds["update"] else 0.0,
        "eval_per_iteration": sum(evaluation.values()) / per_iteration,
        "wall_per_iteration": wall / per_iteration,
    }


def summary_lines(numbers: dict[str, Any], run_dir: Path, plot: Path | None, wandb_dir: Path | None) -> list[str]:
    """The lines printed at the end of a run, from `summarize_run`'s numbers."""
    n, k = numbers["iterations"], numbers["reward_window"]
    phases = {name: numbers[f"{name}_per_iteration"] for name in ("rollout", "update", "eval")}
    other = max(0.0, numbers["wall_per_iteration"] - sum(phases.values()))
    split = ", ".join(f"{name} {value:.2f}" for name, value in [*phases.items(), ("other", other)])
    wall, each = numbers["wall_seconds"], numbers["wall_per_iteration"]
    lines = [f"llm-pg: {n} iterations in {wall:.1f} s: {each:.2f} s each ({split})"]
    if numbers["em_first"] is not None:
        (s0, v0), (s1, v1), (sb, vb) = numbers["em_first"], numbers["em_last"], numbers["em_best"]
        change = f"{v0:.3f} (iteration {s0}) -> {v1:.3f} (iteration {s1})"
        lines.append(f"  eval exact match  {change}; best {vb:.3f} (iteration {sb})")
    if numbers["reward_first"] is not None:
        first = "iteration 1" if k == 1 else f"iterations 1-{k}"
        last = f"iteration {n}" if k == 1 else f"iterations {n - k + 1}-{n}"
        lines.append(
            f"  mean reward       {numbers['reward_first']:.3f} ({first}) -> {numbers['reward_last']:.3f} ({last})"
        )
    lines.append(f"  run directory     {_shown(run_dir)}")
    if plot is not None:
        lines.append(f"  plot              {_shown(plot)} (report.md beside it)")
    if wandb_dir is not None:
        lines.append(f"  W&B (offline)     upload: wandb sync {_shown(wandb_dir)}")
    return lines


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies inside it (shorter, and what the user typed)."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else str(path)


def offline_wandb_dir(trainer: L.Trainer) -> Path | None:
    """The offline W&B run's directory (`wandb sync` uploads it), or None without an offline W&B run."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger.experiment.offline:
            return Path(logger.experiment.dir).parent  # `dir` is the run's files/ folder
    return None


def finish_run(trainer: L.Trainer, run_dir: Path) -> dict[str, Any] | None:
    """Write `report.md` and `overview.png` into the run directory (as `llm-pg report` does) and print the summary;
    returns the numbers. Rank zero only: the CLI calls it once training has ended and `COMPLETE` is written."""
    ensure_run_dir(run_dir)  # still this run's directory (a moved one ends the run: `llm_pg.runs.directory`)
    try:
        numbers = summarize_run(run_dir)
        report, _ = write_report([run_dir], run_dir, overview_only=True)
    except (OSError, ValueError, RuntimeError) as error:  # the run is finished and saved: its report must not fail it
        print(f"llm-pg: no summary or report for {run_dir} ({error}); `llm-pg report` retries", flush=True)
        return None
    plot = report.with_name("overview.png")
    print("\n".join(summary_lines(numbers, run_dir, plot, offline_wandb_dir(trainer))), flush=True)
    return numbers
