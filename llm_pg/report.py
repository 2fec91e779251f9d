"""`llm-pg report RUN_DIR... [--out DIR]`: plots, a comparison table and sampled generations from run directories.

Reads only what every run writes (`metrics.csv`, `generations.jsonl`), so it needs no W&B. Runs whose names
differ only by a `_seed<N>` suffix are one group: a line for the mean over seeds and a band from the lowest to
the highest seed. Writes into `--out`:

    report.md                 the table, the plots and sampled generations, ready to paste into a write-up
    overview.png              every plot on one page
    eval_exact_match.png, speed.png (iterations to reach 0.9), train_reward.png, kl.png, clip_fraction.png,
    grad_norm.png

A RUN_DIR without `metrics.csv` that holds run directories (a sweep's folder) stands for all of them.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

PLOTS = {  # metrics.csv column -> (file stem, title, y label)
    "eval/exact_match": ("eval_exact_match", "Eval exact match (greedy)", "exact match"),
    "train/reward": ("train_reward", "Rollout reward (mean over samples)", "reward"),
    "train/kl": ("kl", "KL to the reference (k3, per token)", "KL (log scale)"),
    "train/clip_fraction": ("clip_fraction", "Clip fraction (GRPO)", "fraction of tokens"),
    "train/grad_norm": ("grad_norm", "Gradient norm before clipping", "norm (log scale)"),
}
LOG_SCALE = {"train/kl", "train/grad_norm"}  # their spikes span orders of magnitude
TIME_COLUMNS = ("time/rollout", "time/update", "time/eval")
TARGET = 0.9  # "iterations to reach 0.9 eval exact match"
SEED = re.compile(r"_seed\d+$")
OLD_RUN = re.compile(r"\.old-\d{8}-\d{6}(-\d+)?$")
MARKDOWN_SPECIALS = set("\\`*_[]<>|&~#!")


@dataclass
class RunLog:
    """One run's logged metrics: `series[column][step] = value` (the last row wins for a step logged twice, as
    after a resume), plus its sampled rollout rows."""

    path: Path
    series: dict[str, dict[int, float]]
    generations: list[dict] = field(default_factory=list)

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
                step = int(float(row["step"]))
                for column, text in row.items():
                    if column != "step" and text != "":
                        series.setdefault(column, {})[step] = float(text)
            except (KeyError, ValueError) as error:
                raise DamagedRun(f"{file}: line {reader.line_num}: {error!r}") from error
    return series


def _read_generations(file: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as error:
            raise DamagedRun(f"{file}: line {number} is not JSON ({error.msg}; cut short?)") from error
    return rows


def read_run(path: str | Path) -> RunLog:
    """A run directory's metrics.csv, generations.jsonl and (for kl_coef) config.yaml; DamagedRun names the file
    that cannot be read."""
    path = Path(path)
    series = _read_metrics(path / "metrics.csv")
    generations = _read_generations(path / "generations.jsonl") if (path / "generations.jsonl").is_file() else []
    try:
        config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    except yaml.YAMLError as error:
        raise DamagedRun(f"{path / 'config.yaml'}: not YAML ({error})") from error
    if ((config or {}).get("model") or {}).get("init_args", {}).get("kl_coef") == 0:
        series.pop("train/kl", None)  # no reference model: the logged 0 is a placeholder, not a measurement
    return RunLog(path, series, generations)


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


# ---- numbers -------------------------------------------------------------------------------------------


def summarize(run: RunLog) -> dict[str, float | None]:
    """The table's numbers for one run; None where the run did not log the metric."""
    eval_steps, em = run.values("eval/exact_match")
    reached = eval_steps[em >= TARGET]
    _, kl = run.values("train/kl")
    _, reward = run.values("train/reward")
    _, clip = run.values("train/clip_fraction")
    seconds = sum(sum(run.series.get(c, {}).values()) for c in TIME_COLUMNS)
    return {
        "final_em": float(em[-1]) if len(em) else None,
        "best_em": float(em.max()) if len(em) else None,
        "mean_em": float(em.mean()) if len(em) else None,
        "iters_to_target": float(reached[0]) if len(reached) else None,
        "final_reward": float(reward[-1]) if len(reward) else None,
        "final_kl": float(kl[-1]) if len(kl) else None,
        "mean_clip": float(clip.mean()) if len(clip) else None,
        "minutes": seconds / 60,
        "iterations": float(max(run.series.get("train/reward", {0: 0}))),
    }


COLUMNS = [  # (summary key, table header, format)
    ("final_em", "final eval EM", "{:.3f}"),
    ("best_em", "best eval EM", "{:.3f}"),
    ("iters_to_target", f"iterations to EM {TARGET}", "{:.0f}"),
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


def table(groups: dict[str, list[RunLog]]) -> str:
    """Markdown: one row per group (mean ± std over its seeds), in the legend's order."""
    lines = [
        "| run | seeds | iterations | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for name, runs in groups.items():
        stats = [summarize(r) for r in runs]
        iterations = ", ".join(sorted({f"{s['iterations']:.0f}" for s in stats}))
        cells = [_cell([s[key] for s in stats], fmt, key) for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | {len(runs)} | {iterations} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_order(groups: dict[str, list[RunLog]]) -> list[str]:
    """Fastest learner first: fewest iterations to the target (mean over seeds, a seed that never got there
    counting twice its run's length), then the higher mean eval exact match over the run."""

    def key(name: str) -> tuple[float, float]:
        stats = [summarize(r) for r in groups[name]]
        iters = [s["iters_to_target"] if s["iters_to_target"] is not None else 2 * s["iterations"] for s in stats]
        return float(np.mean(iters)), -float(np.mean([s["mean_em"] or 0.0 for s in stats]))

    return sorted(groups, key=key)


# ---- plots ---------------------------------------------------------------------------------------------


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing rolling mean over `window` points (shorter at the start), so a curve never runs ahead."""
    return np.array([values[max(0, i - window + 1) : i + 1].mean() for i in range(len(values))])


def band(runs: list[RunLog], column: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean, min and max over the group's seeds, at the steps every seed logged."""
    curves = []
    for run in runs:
        steps, values = run.values(column)
        curves.append(dict(zip(steps, smoothed(values, window), strict=True)))
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    stacked = np.array([[c[s] for s in steps] for c in curves]).reshape(len(curves), len(steps))
    return np.array(steps), stacked.mean(0), stacked.min(0), stacked.max(0)


def legend_label(name: str, runs: list[RunLog]) -> str:
    """`kl_coef0.2: final EM 0.93, 0.9 at iteration 12` (means over seeds), the legend's one-glance summary."""
    stats = [summarize(r) for r in runs]
    final = [s["final_em"] for s in stats if s["final_em"] is not None]
    if not final:
        return name
    reached = [s["iters_to_target"] for s in stats if s["iters_to_target"] is not None]
    speed = f"{TARGET} at iteration {np.mean(reached):.0f}" if len(reached) == len(stats) else f"{TARGET} not reached"
    if reached and len(reached) < len(stats):
        speed = f"{TARGET} reached by {len(reached)}/{len(stats)} seeds"
    return f"{name}: final EM {np.mean(final):.2f}, {speed}"


def _draw(ax, groups: dict[str, list[RunLog]], column: str, style: dict[str, tuple], window: int) -> bool:
    """One line per group (mean over seeds) with a min-max band; False when no run logged the column."""
    from matplotlib.ticker import MaxNLocator

    drawn = False
    is_eval = column.startswith("eval/")
    for name, runs in groups.items():
        have = [r for r in runs if r.series.get(column)]
        if not have:
            continue
        color, label = style[name]
        steps, mean, low, high = band(have, column, 1 if is_eval else window)
        ax.plot(steps, mean, color=color, lw=1.8, marker="o" if is_eval else None, ms=3.5, label=label)
        if len(have) > 1:
            ax.fill_between(steps, low, high, color=color, alpha=0.12, lw=0)
        drawn = True
    if is_eval and drawn:
        ax.axhline(TARGET, color="0.5", ls=":", lw=1)
    ax.set(title=_title(column, window), xlabel="RL iteration", ylabel=PLOTS[column][2])
    if column in LOG_SCALE and drawn:
        ax.set_yscale("log", nonpositive="mask")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return drawn


def _title(column: str, window: int) -> str:
    title = PLOTS[column][1]
    return title if column.startswith("eval/") or window <= 1 else f"{title}\nrolling mean over {window} iterations"


def _draw_speed(ax, groups: dict[str, list[RunLog]], style: dict[str, tuple]) -> None:
    """Iterations to reach the target, fastest group on top: a bar for the mean over the seeds that got there, a
    dot per seed, a cross at the run's end for a seed that never did."""
    names = list(groups)[::-1]  # barh stacks bottom-up
    for y, name in enumerate(names):
        stats = [summarize(r) for r in groups[name]]
        reached = [s["iters_to_target"] for s in stats if s["iters_to_target"] is not None]
        missed = [s["iterations"] for s in stats if s["iters_to_target"] is None]
        if reached:
            ax.barh(y, np.mean(reached), color=style[name][0], alpha=0.35)
        ax.scatter(reached, [y] * len(reached), color=style[name][0], s=20, zorder=3)
        ax.scatter(missed, [y] * len(missed), color=style[name][0], marker="x", s=40, zorder=3)
    ax.set_yticks(range(len(names)), names)
    for label, name in zip(ax.get_yticklabels(), names, strict=True):
        label.set_color(style[name][0])
    title = (
        f"Iterations to reach eval exact match {TARGET}\n(bar: mean over the seeds that did; x: a seed that never did)"
    )
    ax.set(title=title, xlabel="RL iteration")
    ax.grid(axis="x", alpha=0.3)


def plot(groups: dict[str, list[RunLog]], out: Path, window: int) -> list[str]:
    """One PNG per metric that some run logged, `speed.png`, and `overview.png` with all of them; returns the
    names of the PNGs besides the overview."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    style = {
        name: (palette[i % len(palette)], legend_label(name, runs)) for i, (name, runs) in enumerate(groups.items())
    }
    seeds = any(len(r) > 1 for r in groups.values())
    legend = "fastest learner first" + ("; line: mean over seeds, band: min to max" if seeds else "")
    columns = [c for c in PLOTS if any(r.series.get(c) for runs in groups.values() for r in runs)]
    has_eval = "eval/exact_match" in columns
    written = []
    for column in columns:
        fig, ax = plt.subplots(figsize=(9, 4.8))
        _draw(ax, groups, column, style, window)
        ax.legend(title=legend, fontsize=9, title_fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.savefig(out / f"{PLOTS[column][0]}.png", dpi=120, bbox_inches="tight")
        written.append(f"{PLOTS[column][0]}.png")
        plt.close(fig)
    if has_eval:
        fig, ax = plt.subplots(figsize=(7, 1.5 + 0.35 * len(groups)))
        _draw_speed(ax, groups, style)
        fig.savefig(out / "speed.png", dpi=120, bbox_inches="tight")
        written.insert(1, "speed.png")
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, column in zip(axes.flat, columns, strict=False):
        _draw(ax, groups, column, style, window)
    if has_eval:
        _draw_speed(axes.flat[len(columns)], groups, style)
    for ax in axes.flat[len(columns) + has_eval :]:
        ax.axis("off")
    rows = -(-len(groups) // 3)  # the legend under the plots, three entries a row
    fig.legend(*axes.flat[0].get_legend_handles_labels(), title=legend, loc="lower center", ncol=3, fontsize=10)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.04, 1, 1))
    fig.savefig(out / "overview.png", dpi=110)
    plt.close(fig)
    return written


# ---- generations ---------------------------------------------------------------------------------------


def _md(text: str, limit: int = 240) -> str:
    """Text shown as written inside a markdown table cell: punctuation escaped (tags, pipes), newlines as ⏎."""
    text = text if len(text) <= limit else text[:limit] + " …"
    text = "".join("\\" + c if c in MARKDOWN_SPECIALS else c for c in text)
    return text.replace("\r", "").replace("\n", "⏎") or "(empty)"


def generations(run: RunLog, samples: int) -> str:
    """The first `samples` rows (one prompt group first) of the first and the last logged iteration."""
    if not run.generations or samples <= 0:
        return "_no generations.jsonl_"
    iterations = sorted({row["iteration"] for row in run.generations})
    parts = []
    for iteration in dict.fromkeys([iterations[0], iterations[-1]]):
        rows = [row for row in run.generations if row["iteration"] == iteration][:samples]
        parts.append(f"Iteration {iteration}:\n\n| prompt | completion | reward | advantage |\n|---|---|---|---|")
        parts += [
            f"| {_md(r['prompt'], 80)} | {_md(r['completion'])} | {r['reward']:.2f} | {r['advantage']:+.2f} |"
            for r in rows
        ]
        parts.append("")
    return "\n".join(parts)


# ---- command -------------------------------------------------------------------------------------------


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


NOTE = (
    f"_Eval EM: greedy exact match on the held-out set; final: at the last evaluation. Iterations to EM {TARGET}: "
    "the first evaluation at or above it, per seed (evaluations run every `eval_every` iterations). Reward and KL: "
    "the last iteration's. Compute time: logged rollout, update and eval seconds (model loading excluded). With "
    "several seeds: mean ± std (population) over seeds._"
)


def write_report(paths: Sequence[str | Path], out: str | Path, samples: int = 4, smooth: int = 0) -> tuple[Path, str]:
    """Read the runs, write the PNGs and report.md into `out`; returns the report's path and its table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for path in run_dirs(paths):
        try:
            runs.append(read_run(path))
        except (DamagedRun, OSError) as error:  # one damaged run must not hide the others
            print(f"llm-pg report: skipping {path}: {error}", file=sys.stderr)
    if not runs:
        raise SystemExit("llm-pg report: no readable run among the ones given")
    unordered = group_runs(runs)
    groups = {name: unordered[name] for name in speed_order(unordered)}
    longest = max((len(r.series.get("train/reward", {})) for r in runs), default=0)
    window = smooth if smooth > 0 else min(20, max(1, round(longest / 10)))
    pngs = plot(groups, out, window)
    summary = table(groups)
    lines = [
        "# Run report",
        "",
        f"{len(runs)} runs in {len(groups)} groups (names that differ only by `_seed<N>`), fastest learner first.",
        "",
        "![overview](overview.png)",
        "",
        summary,
        "",
        NOTE,
        "",
        "## Plots",
        "",
        *[f"![{png.removesuffix('.png')}]({png})\n" for png in pngs],
        "## Sampled generations",
        "",
        "The first rows (one prompt group) of the first and the last logged rollout, with reward and group advantage.",
        "",
    ]
    for name, group in groups.items():
        lines += [f"### {name} ({group[0].path.name})", "", generations(group[0], samples)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report, summary


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (or folders of run directories, e.g. a sweep's)")
    parser.add_argument("--out", default="report", help="output folder (default: ./report)")
    parser.add_argument("--samples", type=int, default=4, help="generation rows per run and iteration (default 4)")
    parser.add_argument(
        "--smooth",
        type=int,
        default=0,
        help="rolling-mean window for the per-iteration curves; 0 (default): a tenth of the run, at most 20; 1: raw",
    )
    args = parser.parse_args(list(argv))
    report, summary = write_report(args.runs, args.out, args.samples, args.smooth)
    print(f"{summary}\n\nwrote {report} and its plots")
    return 0
