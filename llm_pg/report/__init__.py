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
import sys
from collections.abc import Sequence
from pathlib import Path

from llm_pg.report.plots import band, plot, smoothed
from llm_pg.report.runs import (
    TARGET,
    DamagedRun,
    RunLog,
    group_runs,
    read_run,
    run_dirs,
    speed_order,
    summarize,
    table,
)

__all__ = [
    "DamagedRun",
    "RunLog",
    "band",
    "group_runs",
    "main",
    "read_run",
    "run_dirs",
    "smoothed",
    "speed_order",
    "summarize",
    "table",
    "write_report",
]
MARKDOWN_SPECIALS = set("\\`*_[]<>|&~#!")


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


NOTE = (
    f"_Eval EM: greedy exact match on the held-out set; final: at the last evaluation. Iterations to EM {TARGET}: "
    "the first evaluation at or above it, per seed (evaluations run every `eval_every` iterations). Reward and KL: "
    "the last iteration's. Compute time: logged rollout, update and eval seconds (model loading excluded). With "
    "several seeds: mean ± std (population) over seeds._"
)


def write_report(
    paths: Sequence[str | Path], out: str | Path, samples: int = 4, smooth: int = 0, overview_only: bool = False
) -> tuple[Path, str]:
    """Read the runs, write the PNGs and report.md into `out`; returns the report's path and its table.

    `overview_only`: `overview.png` without the one-PNG-per-metric files (the report a run writes into its own
    directory at the end of `fit`)."""
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
    pngs = plot(groups, out, window, overview_only)
    summary = table(groups)
    lines = [
        "# Run report",
        "",
        f"One run: `{runs[0].path.name}`."
        if len(runs) == 1
        else f"{len(runs)} runs in {len(groups)} groups (names that differ only by `_seed<N>`), fastest learner first.",
        "",
        "![overview](overview.png)",
        "",
        summary,
        "",
        NOTE,
        "",
        *(["## Plots", "", *[f"![{png.removesuffix('.png')}]({png})\n" for png in pngs]] if pngs else []),
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
