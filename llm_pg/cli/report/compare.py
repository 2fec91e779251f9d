"""Each setting of a sweep against its reference, over seeds: is a difference a finding or seed noise?

For a setting `b` and the reference `a` (groups of runs that differ only by `_seed<N>`), per metric `m` (final eval
EM, best eval EM, the first eval EM after iteration 0, iterations and training minutes to EM `target`):

    diff = mean_seeds(m_b) - mean_seeds(m_a)

with a 95 % percentile-bootstrap interval: `RESAMPLES` times, draw each group's seeds with replacement (a group of
n seeds gives n draws), take the difference of the two means; the interval is the 2.5 % and 97.5 % quantiles of
those differences (numpy's seeded generator, `SEED`: the same runs give the same interval). A difference is
*beyond seed noise* when its interval excludes 0. With two seeds per group the interval spans the extreme pairwise
differences (each extreme resample has probability 1/16 > 2.5 %), so "beyond noise" then means every seed of the
setting lies on the same side of every seed of the reference. One seed in either group gives no interval.

A seed that never reached the target counts as its run's length (in iterations, or in training minutes) for the
to-target metrics: that cell is a bound, not a measurement (marked †). Welch's t would need scipy, which the project
does not depend on.

Whether a group learned at all is `learning_table`: per seed, the last eval EM minus the one at iteration 0 (the
same model before any update), and the mean of those gains with a one-sample percentile-bootstrap interval. With
three seeds each extreme resample has probability 1/27 > 2.5 %, so the interval is the lowest to the highest seed's
gain, and "excludes 0" means every seed gained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_pg.cli.report.runs import TARGET, RunLog, summarize

RESAMPLES = 10_000
SEED = 0
LEVEL = 0.95
REFERENCE_NAMES = ("reference", "base", "baseline")  # a sweep's reference run, when `--reference` is not given
BOUNDED = {"iters_to_target": "iterations", "minutes_to_target": "training_minutes"}  # never reached: the run's end


def metrics(target: float = TARGET) -> list[tuple[str, str, str]]:
    """The compared `(summary key, column header, format)`."""
    return [
        ("final_em", "final eval EM", "{:+.3f}"),
        ("best_em", "best eval EM", "{:+.3f}"),
        ("early_em", "first eval EM after iteration 0", "{:+.3f}"),
        ("iters_to_target", f"iterations to EM {target:g}", "{:+.1f}"),
        ("minutes_to_target", f"training minutes to EM {target:g}", "{:+.2f}"),
    ]


def _resampled_means(values: Sequence[float], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """`[resamples]` means of `values` drawn with replacement (n draws from n values)."""
    v = np.asarray(values, dtype=float)
    return v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(1)


def _interval(samples: np.ndarray) -> tuple[float, float]:
    low, high = np.quantile(samples, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(low), float(high)


def bootstrap_interval(
    reference: Sequence[float], setting: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, float, float]:
    """`(diff, low, high)`: `mean(setting) - mean(reference)` and its `LEVEL` percentile-bootstrap interval."""
    rng = np.random.default_rng(seed)
    means_a = _resampled_means(reference, rng, resamples)  # drawn first, then the setting's: the same stream
    means_b = _resampled_means(setting, rng, resamples)
    return float(np.mean(setting) - np.mean(reference)), *_interval(means_b - means_a)


def bootstrap_mean(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """`(mean, low, high)`: the mean of `values` and its `LEVEL` percentile-bootstrap interval (one sample)."""
    means = _resampled_means(values, np.random.default_rng(seed), resamples)
    return float(np.mean(values)), *_interval(means)


def _values(runs: list[RunLog], key: str, target: float = TARGET) -> tuple[list[float], bool]:
    """Per-seed values of a summary key, and whether one of them is a bound (a to-target metric never reached)."""
    stats = [summarize(r, target) for r in runs]
    if key not in BOUNDED:
        return [s[key] for s in stats if s[key] is not None], False
    end = BOUNDED[key]
    values = [s[key] if s[key] is not None else s[end] for s in stats]
    if any(v is None for v in values):  # the run logged no time: nothing to compare
        return [], False
    return values, any(s[key] is None for s in stats)


def difference_cell(reference: list[RunLog], setting: list[RunLog], key: str, fmt: str, target: float = TARGET) -> str:
    """`+0.125 [+0.050, +0.200]`, in bold when the interval excludes 0; `-` without two seeds on each side."""
    a, bound_a = _values(reference, key, target)
    b, bound_b = _values(setting, key, target)
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


def comparison_table(groups: dict[str, list[RunLog]], reference: str, target: float = TARGET) -> str:
    """Markdown: one row per setting, the difference to `reference` in each metric with its interval."""
    compared = metrics(target)
    lines = [
        "| run | seeds | " + " | ".join(f"Δ {header} [95 % interval]" for _, header, _ in compared) + " |",
        "|---|---|" + "---|" * len(compared),
    ]
    for name, runs in groups.items():
        if name == reference:
            continue
        cells = [difference_cell(groups[reference], runs, key, fmt, target) for key, _, fmt in compared]
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def learning_table(groups: dict[str, list[RunLog]]) -> str:
    """Markdown: per group that evaluated at iteration 0 and later, the eval EM at iteration 0, the first after it
    and the last (means over seeds), the gain (last minus iteration 0) per seed and its mean with a 95 % bootstrap
    interval over seeds (bold when it excludes 0), and the training minutes per iteration; empty when no group
    has both evaluations."""
    lines = [
        "| run | seeds | EM at iteration 0 | first EM after it | last EM | gain per seed | gain [95 % interval] "
        "| training min / iteration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups.items():
        stats = [s for s in map(summarize, runs) if s["gain"] is not None]
        if not stats:
            continue
        gains = [s["gain"] for s in stats]
        cell = "-"
        if len(gains) > 1:
            mean, low, high = bootstrap_mean(gains)
            cell = f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"
            cell = f"**{cell}**" if low > 0 or high < 0 else cell
        paces = [s["training_minutes"] / s["iterations"] for s in stats if s["training_minutes"] and s["iterations"]]
        pace = f"{np.mean(paces):.2f}" if paces else "-"
        lines.append(
            f"| {name} | {len(stats)} | {np.mean([s['base_em'] for s in stats]):.3f} "
            f"| {np.mean([s['early_em'] for s in stats]):.3f} | {np.mean([s['final_em'] for s in stats]):.3f} "
            f"| {', '.join(f'{g:+.3f}' for g in gains)} | {cell} | {pace} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def comparison_note(reference: str, groups: dict[str, list[RunLog]]) -> str:
    seeds = len(groups[reference])
    return (
        f"_Against `{reference}` ({seeds} seeds): setting minus reference, mean over seeds, with a 95 % seeded "
        f"bootstrap interval over seeds ({RESAMPLES} resamples); **bold**: the interval excludes 0 (beyond seed "
        "noise); -: fewer than 2 seeds on a side; †: a seed never reached the target and counts as its run's length "
        "(a bound). Training minutes: rollout + update time up to that evaluation (no evaluations, checkpoints or "
        "logging), the comparison at equal wall clock._"
    )
