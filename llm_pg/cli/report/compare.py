"""Each setting of a sweep against its reference, over seeds: is a difference a finding or seed noise?

For a setting `b` and the reference `a` (groups of runs that differ only by `_seed<N>`), per metric `m` (final eval
EM, best eval EM, iterations to EM `TARGET`):

    diff = mean_seeds(m_b) - mean_seeds(m_a)

with a 95 % percentile-bootstrap interval: `RESAMPLES` times, draw each group's seeds with replacement (a group of
n seeds gives n draws), take the difference of the two means; the interval is the 2.5 % and 97.5 % quantiles of
those differences (numpy's seeded generator, `SEED`: the same runs give the same interval). A difference is
*beyond seed noise* when its interval excludes 0. With two seeds per group the interval spans the extreme pairwise
differences (each extreme resample has probability 1/16 > 2.5 %), so "beyond noise" then means every seed of the
setting lies on the same side of every seed of the reference. One seed in either group gives no interval.

A seed that never reached the target counts as its run's length for iterations-to-target: that cell is a bound,
not a measurement (marked †). Welch's t would need scipy, which the project does not depend on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_pg.cli.report.runs import TARGET, RunLog, summarize

RESAMPLES = 10_000
SEED = 0
LEVEL = 0.95
REFERENCE_NAMES = ("reference", "base", "baseline")  # a sweep's reference run, when `--reference` is not given
METRICS = [  # (summary key, column header, format)
    ("final_em", "final eval EM", "{:+.3f}"),
    ("best_em", "best eval EM", "{:+.3f}"),
    ("iters_to_target", f"iterations to EM {TARGET}", "{:+.1f}"),
]


def bootstrap_interval(
    reference: Sequence[float], setting: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, float, float]:
    """`(diff, low, high)`: `mean(setting) - mean(reference)` and its `LEVEL` percentile-bootstrap interval."""
    a, b = np.asarray(reference, dtype=float), np.asarray(setting, dtype=float)
    rng = np.random.default_rng(seed)
    means_a = a[rng.integers(0, len(a), size=(resamples, len(a)))].mean(1)  # [resamples]
    means_b = b[rng.integers(0, len(b), size=(resamples, len(b)))].mean(1)
    low, high = np.quantile(means_b - means_a, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(b.mean() - a.mean()), float(low), float(high)


def _values(runs: list[RunLog], key: str) -> tuple[list[float], bool]:
    """Per-seed values of a summary key, and whether one of them is a bound (iterations-to-target never reached)."""
    stats = [summarize(r) for r in runs]
    if key != "iters_to_target":
        return [s[key] for s in stats if s[key] is not None], False
    values = [s[key] if s[key] is not None else s["iterations"] for s in stats]
    return values, any(s[key] is None for s in stats)


def difference_cell(reference: list[RunLog], setting: list[RunLog], key: str, fmt: str) -> str:
    """`+0.125 [+0.050, +0.200]`, in bold when the interval excludes 0; `-` without two seeds on each side."""
    a, bound_a = _values(reference, key)
    b, bound_b = _values(setting, key)
    if len(a) < 2 or len(b) < 2:
        return "-"
    diff, low, high = bootstrap_interval(a, b)
    cell = f"{fmt.format(diff)} [{fmt.format(low)}, {fmt.format(high)}]"
    cell = f"**{cell}**" if low > 0 or high < 0 else cell
    return cell + (" †" if bound_a or bound_b else "")


def pick_reference(groups: dict[str, list[RunLog]], name: str | None = None) -> str | None:
    """The reference group: `name` when given (ValueError if no group has it), else the first of REFERENCE_NAMES
    present, else None."""
    if name is not None:
        if name not in groups:
            raise ValueError(f"--reference {name!r} is none of the groups: {', '.join(groups)}")
        return name
    return next((n for n in REFERENCE_NAMES if n in groups), None)


def comparison_table(groups: dict[str, list[RunLog]], reference: str) -> str:
    """Markdown: one row per setting, the difference to `reference` in each metric with its interval."""
    lines = [
        "| run | seeds | " + " | ".join(f"Δ {header} [95 % interval]" for _, header, _ in METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for name, runs in groups.items():
        if name == reference:
            continue
        cells = [difference_cell(groups[reference], runs, key, fmt) for key, _, fmt in METRICS]
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_note(reference: str, groups: dict[str, list[RunLog]]) -> str:
    seeds = len(groups[reference])
    return (
        f"_Against `{reference}` ({seeds} seeds): setting minus reference, mean over seeds, with a 95 % seeded "
        f"bootstrap interval over seeds ({RESAMPLES} resamples); **bold**: the interval excludes 0 (beyond seed "
        "noise); -: fewer than 2 seeds on a side; †: a seed never reached the target and counts as its run's length "
        "(a bound)._"
    )
