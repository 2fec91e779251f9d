"""`llm-pg report RUN_DIR... [--out DIR]`: plots, a comparison table and sampled generations from run directories.

Reads only what every run writes (`metrics.csv`, `generations.jsonl`, `eval/iter_XXXXX.jsonl`, `config.yaml`), so
it needs no W&B. A run directory is untrusted input: a file that is not as the trainer writes it (a row cut short, a
field of the wrong type, a step that is no iteration, a config that is not a safe YAML mapping) makes that run
damaged, skipped with one line naming the file and line, and the others are still reported. Runs whose names
differ only by a `_seed<N>` suffix are one group: a line for the mean over seeds and a band from the lowest to
the highest seed. Writes into `--out`:

    report.md                 the table, whether each group learned (its gain over iteration 0, with an interval
                              over seeds), each setting against the reference over seeds (`compare.py`), the plots,
                              sampled generations and eval completions, ready to paste into a write-up
    overview.png              every plot on one page
    eval_exact_match.png, speed.png (iterations to reach `--target`, 0.9 by default), eval_exact_match_time.png
    (eval EM against training minutes: the comparison at equal wall clock), train_reward.png, kl.png,
    clip_fraction.png, grad_norm.png

A RUN_DIR without `metrics.csv` that holds run directories (a sweep's folder) stands for all of them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from llm_pg.cli.report.compare import (
    bootstrap_interval,
    bootstrap_mean,
    comparison_note,
    comparison_table,
    learning_table,
    pick_reference,
)
from llm_pg.cli.report.plots import band, plot, smoothed
from llm_pg.cli.report.runs import (
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
    "bootstrap_interval",
    "bootstrap_mean",
    "comparison_table",
    "group_runs",
    "learning_table",
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


def _number(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def _rows_table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """A markdown table of `rows` with the `(field, header)` columns some row has (prompt and completion always)."""
    kept = [(k, h) for k, h in columns if k in ("prompt", "completion") or any(k in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in kept) + " |", "|" + "---|" * len(kept)]
    for r in rows:
        cells = []
        for key, _ in kept:
            value = r.get(key)
            if key in ("prompt", "answer"):
                cells.append(_md(str(value), 80) if value is not None else "-")
            elif key == "completion":
                cells.append(_md(value))
            elif key in ("correct", "truncated"):
                cells.append(_yes(value))
            elif key == "length":
                cells.append(_number(value, "{:d}"))
            else:
                cells.append(_number(value, "{:+.2f}" if key == "advantage" else "{:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def generations(run: RunLog, samples: int) -> str:
    """The first `samples` rows (one prompt group first) of the first and the last logged iteration, with the gold
    answer, correctness, length, truncation and one column per reward component where the run logged them."""
    if not run.generations or samples <= 0:
        return "_no generations.jsonl_"
    iterations = sorted({row["iteration"] for row in run.generations})
    components = sorted({k for row in run.generations for k in row if k.startswith("reward_")})
    columns = [("prompt", "prompt"), ("answer", "answer"), ("completion", "completion"), ("reward", "reward")]
    columns += [(c, c.removeprefix("reward_")) for c in components]
    columns += [("correct", "correct"), ("advantage", "advantage"), ("length", "tokens"), ("truncated", "truncated")]
    parts = []
    for iteration in dict.fromkeys([iterations[0], iterations[-1]]):
        rows = [row for row in run.generations if row["iteration"] == iteration][:samples]
        parts += [f"Iteration {iteration}:", "", *_rows_table(rows, columns), ""]
    return "\n".join(parts)


def eval_completions(run: RunLog, samples: int) -> str:
    """The first `samples` completions of the run's last evaluation (greedy), with the gold answer and reward."""
    if run.evaluation is None or not run.evaluation[1] or samples <= 0:
        return "_no eval/iter_XXXXX.jsonl_"
    iteration, rows = run.evaluation
    columns = [("prompt", "prompt"), ("answer", "answer"), ("completion", "completion"), ("reward", "reward")]
    table = _rows_table(rows[:samples], [*columns, ("correct", "correct")])
    title = f"Evaluation at iteration {iteration} (the first {min(samples, len(rows))} of {len(rows)} prompts):"
    return "\n".join([title, "", *table, ""])


# ---- command -------------------------------------------------------------------------------------------


def note(target: float = TARGET) -> str:
    return (
        f"_Eval EM: greedy exact match on the held-out set; final: at the last evaluation. Iterations to EM "
        f"{target:g}: the first evaluation at or above it, per seed (evaluations run every `evaluation.every` "
        "iterations). "
        "Reward and KL: the last iteration's. Compute time: logged rollout, update and eval seconds (model loading "
        "excluded). With several seeds: mean ± std (population) over seeds._"
    )


LEARNING_NOTE = (
    "_Gain: the last eval EM minus the one at iteration 0 (the model before any update), per seed; its mean over "
    "seeds with a 95 % seeded bootstrap interval (bold: it excludes 0; with 3 seeds that is every seed gaining). "
    "Training minutes: rollout + update._"
)


def write_report(
    paths: Sequence[str | Path],
    out: str | Path,
    samples: int = 4,
    smooth: int = 0,
    overview_only: bool = False,
    reference: str | None = None,
    target: float = TARGET,
) -> tuple[Path, str]:
    """Read the runs, write the PNGs and report.md into `out`; returns the report's path and its table(s).

    `overview_only`: `overview.png` without the one-PNG-per-metric files (the report a run writes into its own
    directory at the end of `fit`). `reference`: the group the others are compared with (`compare.py`; default: a
    group named `reference`, `base` or `baseline`); the comparison is written when some group has several seeds.
    `target`: the eval exact match the to-target metrics count to."""
    out = Path(out)
    runs = []
    for path in run_dirs(paths):
        try:
            runs.append(read_run(path))
        except (DamagedRun, OSError) as error:  # one damaged run must not hide the others
            print(f"llm-pg report: skipping {path}: {error}", file=sys.stderr)
    if not runs:
        raise SystemExit("llm-pg report: no readable run among the ones given")
    from llm_pg.runs.directory import ensure_run_dir  # here: `llm-pg report --help` loads no Lightning

    ensure_run_dir(out)  # a run's own report: still its directory (`llm_pg.runs.directory`); elsewhere no check
    out.mkdir(parents=True, exist_ok=True)  # once there is something to write: a wrong input leaves nothing behind
    unordered = group_runs(runs)
    groups = {name: unordered[name] for name in speed_order(unordered, target)}
    longest = max((len(r.series.get("train/reward", {})) for r in runs), default=0)
    window = smooth if smooth > 0 else min(20, max(1, round(longest / 10)))
    pngs = plot(groups, out, window, overview_only, target)
    summary = table(groups, target)
    against = pick_reference(groups, reference) if len(groups) > 1 else None
    seeded = against is not None and any(len(g) > 1 for g in groups.values())
    comparison = comparison_table(groups, against, target) if seeded else ""
    learned = learning_table(groups) if any(len(g) > 1 for g in groups.values()) else ""
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
        note(target),
        "",
        *(
            ["## Learning: the last evaluation against iteration 0", "", learned, "", LEARNING_NOTE, ""]
            if learned
            else []
        ),
        *(
            [f"## Against the reference: {against}", "", comparison, "", comparison_note(against, groups), ""]
            if comparison
            else []
        ),
        *(["## Plots", "", *[f"![{png.removesuffix('.png')}]({png})\n" for png in pngs]] if pngs else []),
        "## Sampled generations",
        "",
        "The first rows (one prompt group) of the first and the last logged rollout, with the gold answer, reward "
        "(and its components), group advantage, completion tokens and truncation (no EOS).",
        "",
    ]
    for name, group in groups.items():
        lines += [f"### {name} ({group[0].path.name})", "", generations(group[0], samples)]
    lines += ["## Eval completions", "", "The first prompts of each group's last (greedy) evaluation.", ""]
    for name, group in groups.items():
        lines += [f"### {name} ({group[0].path.name})", "", eval_completions(group[0], samples)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    learning = f"\n\nLearning (last eval EM minus iteration 0):\n\n{learned}" if learned else ""
    return report, summary + learning + (f"\n\nAgainst {against}:\n\n{comparison}" if comparison else "")


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
    parser.add_argument(
        "--reference",
        default=None,
        help="the group the others are compared with over seeds (default: one named reference, base or baseline)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=TARGET,
        help=f"the eval exact match that iterations and training minutes to target count to (default {TARGET})",
    )
    args = parser.parse_args(list(argv))
    if not 0 < args.target <= 1:
        parser.error(f"--target {args.target:g} is no exact match: give one in (0, 1], e.g. --target 0.5")
    from llm_pg.runs.names import enclosing_run  # here: `llm-pg report --help` loads no Lightning

    run = enclosing_run(args.out)
    if run is not None:  # a run's report.md and overview.png are its own, and its folders hold its files alone
        print(
            f"llm-pg report: error: --out {args.out} lies in the run directory {run}, whose files are its own; write "
            "it outside, e.g. --out reports/NAME",
            file=sys.stderr,
        )
        return 2
    for path in args.runs:  # outputs never land inside what the report reads
        if Path(args.out).resolve().is_relative_to(Path(path).resolve()):
            print(
                f"llm-pg report: error: --out {args.out} lies inside {path}, which the report reads; write it "
                "outside, e.g. --out reports/NAME",
                file=sys.stderr,
            )
            return 2
    try:
        report, summary = write_report(
            args.runs, args.out, args.samples, args.smooth, reference=args.reference, target=args.target
        )
    except (ValueError, OSError) as error:  # a missing folder or reference: one line, not a traceback
        print(f"llm-pg report: error: {error}", file=sys.stderr)
        return 2
    print(f"{summary}\n\nwrote {report} and its plots")
    return 0
