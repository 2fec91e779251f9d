"""Scoring a rollout in reward workers against scoring it in the trainer's process (`llm_pg.data.isolation`).

A user reward of a set CPU cost per completion (a pure-Python loop standing in for a symbolic checker) scores
`--rows` completions, in-process and in `--workers` spawned workers, interleaved, `--repeats` times each. Prints the
median and the spread of each, and the workers' one-time start-up (spawn and import, paid once per fit).

    .venv/bin/python benchmarks/reward_workers.py [--rows 384] [--ms 2] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from llm_pg.data.isolation import TaskScorer
from llm_pg.data.tasks.base import Example, Score, Task


class SlowTask(Task):
    """Rewards that cost `ms` milliseconds of Python each (a user's checker; not llm_pg's own, so isolated)."""

    name = "slow"
    components = ("value",)

    def __init__(self, ms: float = 2.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ms = ms

    def train_example(self, index: int, seed: int) -> Example:
        return Example(prompt=f"{index}", answer="")

    def build_eval_set(self) -> list[Example]:
        return [Example(prompt="0", answer="")]

    def score(self, completion: str, example: Example) -> Score:
        end = time.perf_counter() + self.ms / 1000
        total = 0
        while time.perf_counter() < end:
            total += len(completion)
        value = (total % 7) / 7
        return Score(value, value > 0.5, {"value": value})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=384, help="completions per scoring (8 prompts x 48, say)")
    parser.add_argument("--ms", type=float, default=2.0, help="CPU milliseconds per completion")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    task = SlowTask(ms=args.ms)
    texts = [f"completion {i} " * 20 for i in range(args.rows)]
    examples = [Example(prompt=str(i), answer="") for i in range(args.rows)]
    inline, pooled = TaskScorer(task, workers=0), TaskScorer(task, workers=args.workers)
    start = time.perf_counter()
    pooled.score(texts[:1], examples[:1])  # spawns the workers and imports the task in each
    startup = time.perf_counter() - start
    times: dict[str, list[float]] = {"in-process": [], f"{args.workers} workers": []}
    try:
        for _ in range(args.repeats):  # interleaved: both sides see the same machine
            for name, scorer in zip(times, (inline, pooled), strict=True):
                start = time.perf_counter()
                scores = scorer.score(texts, examples)
                times[name].append(time.perf_counter() - start)
                assert all(isinstance(s, Score) for s in scores)
    finally:
        pooled.close()
    print(f"{args.rows} completions at {args.ms:g} ms each; workers' start-up {startup:.2f} s (once per fit)")
    for name, values in times.items():
        print(f"  {name:>12}: median {statistics.median(values):.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    speedup = statistics.median(times["in-process"]) / statistics.median(times[f"{args.workers} workers"])
    print(f"  speed-up {speedup:.2f}x")


if __name__ == "__main__":
    main()
