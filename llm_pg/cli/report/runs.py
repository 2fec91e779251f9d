"""Reading run directories and the numbers `llm-pg report` tabulates: one `RunLog` per run, seeds grouped.

A run directory holds `metrics.csv` (one row per iteration for the train metrics, one per evaluation for the eval
metrics; `step` is the RL iteration) and `generations.jsonl`. Runs whose names differ only by `_seed<N>` form a
group; the table gives mean ± std (population) over a group's seeds.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

TIME_COLUMNS = ("time/rollout", "time/update", "time/eval")
TARGET = 0.9  # "iterations to reach 0.9 eval exact match" unless `llm-pg report --target` says otherwise
SEED = re.compile(r"_seed\d+$")
OLD_RUN = re.compile(r"\.old-\d{8}-\d{6}(-\d+)?$")


@dataclass
class RunLog:
    """One run's logged metrics: `series[column][step] = value` (the last row wins for a step logged twice, as
    after a resume), plus its sampled rollout rows and its last evaluation's completions."""

    path: Path
    series: dict[str, dict[int, float]]
    generations: list[dict] = field(default_factory=list)
    evaluation: tuple[int, list[dict]] | None = None  # the last evaluation's iteration and completions

    @property
    def group(self) -> str:
        return SEED.sub("", self.path.name)

    @property
    def seed(self) -> int:
        found = SEED.search(self.path.name)
        return int(found.group()[len("_seed") :]) if found else 0

    def values(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """Steps (RL iterations) and values of one column, sorted by step."""
        points = sorted(self.series.get(column, {}).items())
        return np.array([s for s, _ in points], dtype=float), np.array([v for _, v in points], dtype=float)


class DamagedRun(ValueError):
    """A run file that cannot be read as the trainer writes it; the message names the file and the line."""


def _read_metrics(file: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with file.open(newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row or None in row.values():  # more or fewer fields than the header: a row cut short
                raise DamagedRun(f"{file}: line {reader.line_num} does not match the header (cut short?)")
            try:
                step = float(row["step"])
                if not step.is_integer() or step < 0:
                    raise ValueError(f"step {row['step']!r} is not an iteration")
                for column, text in row.items():
                    if column != "step" and text != "":
                        series.setdefault(column, {})[int(step)] = float(text)
            except (KeyError, ValueError) as error:
                raise DamagedRun(f"{file}: line {reader.line_num}: {error}") from error
    return series


# The fields a reader relies on, with the types the trainer writes; a row may hold more (older runs fewer of the
# optional ones). bool is excluded from the numbers: JSON `true` is not a reward.
GENERATION_FIELDS = {"iteration": (int,), "prompt": (str,), "completion": (str,), "reward": (int, float)}
GENERATION_OPTIONAL = {
    "advantage": (int, float),
    "answer": (str, type(None)),
    "correct": (bool,),
    "length": (int,),
    "truncated": (bool,),
}
EVAL_FIELDS = {"prompt": (str,), "completion": (str,), "reward": (int, float)}
EVAL_OPTIONAL = {"answer": (str, type(None)), "correct": (bool,)}


def _type_error(row: object, required: dict, optional: dict) -> str | None:
    """Why `row` is not a row of the kind described (field -> allowed types), or None when it is."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for name in required:
        if name not in row:
            return f"no {name!r} field"
    reward_columns = {k: (int, float) for k in row if k.startswith("reward_")}
    for name, types in {**required, **optional, **reward_columns}.items():
        value = row.get(name)
        if name in row and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"{name!r} is {value!r}, not {' or '.join(t.__name__ for t in types)}"
    return None


def read_jsonl(file: Path, required: dict, optional: dict) -> list[dict]:
    """The rows of a JSONL file, each checked against the field types given; DamagedRun names the file and line."""
    rows = []
    try:
        text = file.read_text()
    except UnicodeDecodeError as error:
        raise DamagedRun(f"{file}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise DamagedRun(f"{file}: line {number} is not JSON ({error.msg}; cut short?)") from error
        problem = _type_error(row, required, optional)
        if problem is not None:
            raise DamagedRun(f"{file}: line {number} is not a row llm-pg wrote ({problem})")
        rows.append(row)
    return rows


def _read_generations(file: Path) -> list[dict]:
    return read_jsonl(file, GENERATION_FIELDS, GENERATION_OPTIONAL)


def read_eval(path: Path) -> tuple[int, list[dict]] | None:
    """The last evaluation's completions of a run (`eval/iter_XXXXX.jsonl` with the highest iteration) and its
    iteration, or None when the run wrote none."""
    files = sorted(path.glob("eval/iter_*.jsonl"))
    numbered = [(int(f.stem.removeprefix("iter_")), f) for f in files if f.stem.removeprefix("iter_").isdigit()]
    if not numbered:
        return None
    iteration, file = max(numbered)
    return iteration, read_jsonl(file, EVAL_FIELDS, EVAL_OPTIONAL)


def read_run(path: str | Path) -> RunLog:
    """A run directory's metrics.csv, generations.jsonl and (for kl_coef) config.yaml; DamagedRun names the file
    that cannot be read."""
    path = Path(path)
    try:
        series = _read_metrics(path / "metrics.csv")
    except UnicodeDecodeError as error:
        raise DamagedRun(f"{path / 'metrics.csv'}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    generations = _read_generations(path / "generations.jsonl") if (path / "generations.jsonl").is_file() else []
    evaluation = read_eval(path)
    if _kl_coef(path / "config.yaml") == 0:
        series.pop("train/kl", None)  # no reference model: the logged 0 is a placeholder, not a measurement
    return RunLog(path, series, generations, evaluation)


def _kl_coef(file: Path) -> object:
    """`model.init_args.kl_coef` of a run's config.yaml (None when absent). Loaded with `yaml.safe_load`: a tag
    such as `!!python/object` is refused, never run; a file that is not a YAML mapping is a DamagedRun."""
    if not file.is_file():
        return None
    try:
        config = yaml.safe_load(file.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DamagedRun(f"{file}: not a config llm-pg wrote ({reason})") from error
    model = config.get("model") if isinstance(config, dict) else None
    init_args = model.get("init_args") if isinstance(model, dict) else None
    if not isinstance(config, dict) or (model is not None and not isinstance(init_args, dict | None)):
        raise DamagedRun(f"{file}: not a config llm-pg wrote (no mapping model.init_args)")
    return (init_args or {}).get("kl_coef")


def run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """The run directories named, a sweep folder standing for the runs inside it."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / "metrics.csv").is_file():
            found.append(path)
        else:
            # `<run>.old-<time>` folders hold runs that `llm-pg fit --overwrite true` moved aside: not this sweep's.
            inner = sorted(p.parent for p in path.glob("*/metrics.csv") if not OLD_RUN.search(p.parent.name))
            if not inner:
                raise FileNotFoundError(f"{path}: no metrics.csv here or in its subfolders")
            found += inner
    return found


def group_runs(runs: Sequence[RunLog]) -> dict[str, list[RunLog]]:
    """Runs differing only by a `_seed<N>` suffix form a group (seeds in order); a name that two folders share
    gets its parent folder's name in front."""
    groups: dict[str, list[RunLog]] = {}
    parents: dict[str, set[Path]] = {}
    for run in runs:
        parents.setdefault(run.group, set()).add(run.path.parent)
    for run in runs:
        name = run.group if len(parents[run.group]) == 1 else f"{run.path.parent.name}/{run.group}"
        groups.setdefault(name, []).append(run)
    return {name: sorted(members, key=lambda r: r.seed) for name, members in groups.items()}


# ---- numbers -------------------------------------------------------------------------------------------


def training_minutes(run: RunLog) -> dict[int, float]:
    """Cumulative rollout + update minutes at each iteration (0 at iteration 0): the training clock without the
    evaluations, checkpoints and logging, so two settings that evaluate alike compare at equal training time."""
    rollout, update = run.series.get("time/rollout", {}), run.series.get("time/update", {})
    clock, total = {0: 0.0}, 0.0
    for step in sorted(set(rollout) | set(update)):
        total += rollout.get(step, 0.0) + update.get(step, 0.0)
        clock[step] = total / 60
    return clock


def summarize(run: RunLog, target: float = TARGET) -> dict[str, float | None]:
    """The table's numbers for one run; None where the run did not log the metric.

    `base_em` is the evaluation at iteration 0 (before any update), `early_em` the first one after it, `gain` the
    last minus the one at iteration 0; `minutes_to_target` is `training_minutes` at the first evaluation at or
    above `target`."""
    eval_steps, em = run.values("eval/exact_match")
    reached = eval_steps[em >= target]
    after_zero = em[eval_steps > 0]
    base = float(em[0]) if len(em) and eval_steps[0] == 0 else None
    _, kl = run.values("train/kl")
    _, reward = run.values("train/reward")
    _, clip = run.values("train/clip_fraction")
    seconds = sum(sum(run.series.get(c, {}).values()) for c in TIME_COLUMNS)
    clock = training_minutes(run)
    return {
        "final_em": float(em[-1]) if len(em) else None,
        "best_em": float(em.max()) if len(em) else None,
        "mean_em": float(em.mean()) if len(em) else None,
        "base_em": base,
        "early_em": float(after_zero[0]) if len(after_zero) else None,
        "gain": float(after_zero[-1]) - base if base is not None and len(after_zero) else None,
        "iters_to_target": float(reached[0]) if len(reached) else None,
        "minutes_to_target": clock.get(int(reached[0])) if len(reached) and len(clock) > 1 else None,
        "training_minutes": max(clock.values()) if len(clock) > 1 else None,
        "final_reward": float(reward[-1]) if len(reward) else None,
        "final_kl": float(kl[-1]) if len(kl) else None,
        "mean_clip": float(clip.mean()) if len(clip) else None,
        "minutes": seconds / 60,
        "iterations": float(max(run.series.get("train/reward", {0: 0}))),
    }


def columns(target: float = TARGET) -> list[tuple[str, str, str]]:
    """The summary table's `(summary key, header, format)` columns."""
    return [
        ("final_em", "final eval EM", "{:.3f}"),
        ("best_em", "best eval EM", "{:.3f}"),
        ("iters_to_target", f"iterations to EM {target:g}", "{:.0f}"),
        ("final_reward", "final reward", "{:.3f}"),
        ("final_kl", "final KL", "{:.4f}"),
        ("mean_clip", "mean clip fraction", "{:.3f}"),
        ("minutes", "compute time (min)", "{:.1f}"),
    ]


def _cell(values: list[float | None], fmt: str, key: str) -> str:
    if len(values) == 1:
        return "-" if values[0] is None else fmt.format(values[0])
    if key == "iters_to_target":  # per seed: a mean over the seeds that got there would flatter the run
        return ", ".join("-" if v is None else fmt.format(v) for v in values)
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    cell = f"{fmt.format(np.mean(present))} ± {fmt.format(np.std(present))}"
    return cell if len(present) == len(values) else f"{cell} ({len(present)}/{len(values)})"


def table(groups: dict[str, list[RunLog]], target: float = TARGET) -> str:
    """Markdown: one row per group (mean ± std over its seeds), in the legend's order."""
    header = columns(target)
    lines = [
        "| run | seeds | iterations | " + " | ".join(h for _, h, _ in header) + " |",
        "|---|---|---|" + "---|" * len(header),
    ]
    for name, runs in groups.items():
        stats = [summarize(r, target) for r in runs]
        iterations = ", ".join(sorted({f"{s['iterations']:.0f}" for s in stats}))
        cells = [_cell([s[key] for s in stats], fmt, key) for key, _, fmt in header]
        lines.append(f"| {name} | {len(runs)} | {iterations} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_order(groups: dict[str, list[RunLog]], target: float = TARGET) -> list[str]:
    """Fastest learner first: fewest iterations to the target (mean over seeds, a seed that never got there
    counting twice its run's length), then the higher mean eval exact match over the run."""

    def key(name: str) -> tuple[float, float]:
        stats = [summarize(r, target) for r in groups[name]]
        iters = [s["iters_to_target"] if s["iters_to_target"] is not None else 2 * s["iterations"] for s in stats]
        return float(np.mean(iters)), -float(np.mean([s["mean_em"] or 0.0 for s in stats]))

    return sorted(groups, key=key)
