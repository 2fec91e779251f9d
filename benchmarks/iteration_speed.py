"""Seconds per RL iteration, by phase, for a config (default: the tiny format_copy GRPO demo).

    .venv/bin/python benchmarks/iteration_speed.py [--config C] [--iterations N] [--threads T]

Prints the mean and max of time/rollout, time/update and time/eval from the run's metrics.csv and
the wall time of the whole fit (model loading included). A figure to compare, never an assertion.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time

os.environ.setdefault("WANDB_MODE", "disabled")

from llm_pg.cli.fit import run_cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny/format_copy_grpo.yaml")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs:
        start = time.perf_counter()
        run_cli(
            [
                "fit",
                f"--config={args.config}",
                f"--model.init_args.iterations={args.iterations}",
                f"--torch_threads={args.threads}",
                f"--runs_root={runs}",
                "--run_name=bench",
                "--trainer.enable_progress_bar=false",
            ]
        )
        wall = time.perf_counter() - start
        with open(os.path.join(runs, "bench", "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    print(f"{args.config}: {args.iterations} iterations, torch threads {args.threads}, wall {wall:.1f} s")
    for column in ("time/rollout", "time/update", "time/eval"):
        values = [float(r[column]) for r in rows if r.get(column)]
        print(f"  {column:<13} mean {statistics.mean(values):6.3f} s   max {max(values):6.3f} s   n={len(values)}")


if __name__ == "__main__":
    main()
