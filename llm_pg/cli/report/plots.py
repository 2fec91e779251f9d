"""The report's plots: one line per group of seeds (mean) with a min-max band, per metric, and one overview page."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llm_pg.cli.report.runs import TARGET, RunLog, summarize, training_minutes

PLOTS = {  # metrics.csv column -> (file stem, title, y label)
    "eval/exact_match": ("eval_exact_match", "Eval exact match (greedy)", "exact match"),
    "train/reward": ("train_reward", "Rollout reward (mean over samples)", "reward"),
    "train/kl": ("kl", "KL to the reference (k3, per token)", "KL (log scale)"),
    "train/clip_fraction": ("clip_fraction", "Clip fraction (GRPO)", "fraction of tokens"),
    "train/grad_norm": ("grad_norm", "Gradient norm before clipping", "norm (log scale)"),
}
OVERVIEW_EXTRA = {  # the overview's last panel when there is no speed comparison to draw
    "train/completion_len": ("completion_len", "Completion length (mean over samples)", "tokens"),
}
LOG_SCALE = {"train/kl", "train/grad_norm"}  # their spikes span orders of magnitude


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


def legend_label(name: str, runs: list[RunLog], target: float = TARGET) -> str:
    """`kl_coef0.2: final EM 0.93, 0.9 at iteration 12` (means over seeds), the legend's one-glance summary."""
    stats = [summarize(r, target) for r in runs]
    final = [s["final_em"] for s in stats if s["final_em"] is not None]
    if not final:
        return name
    reached = [s["iters_to_target"] for s in stats if s["iters_to_target"] is not None]
    speed = (
        f"{target:g} at iteration {np.mean(reached):.0f}" if len(reached) == len(stats) else f"{target:g} not reached"
    )
    if reached and len(reached) < len(stats):
        speed = f"{target:g} reached by {len(reached)}/{len(stats)} seeds"
    return f"{name}: final EM {np.mean(final):.2f}, {speed}"


def _draw(
    ax, groups: dict[str, list[RunLog]], column: str, style: dict[str, tuple], window: int, target: float = TARGET
) -> bool:
    """One line per group (mean over seeds) with a min-max band; False when no run logged the column."""
    from matplotlib.ticker import MaxNLocator

    drawn, positive = False, False
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
        drawn, positive = True, positive or bool((high > 0).any())
    if is_eval and drawn:
        ax.axhline(target, color="0.5", ls=":", lw=1)
    ax.set(title=_title(column, window), xlabel="RL iteration", ylabel=(PLOTS | OVERVIEW_EXTRA)[column][2])
    if column in LOG_SCALE and positive:  # a log axis needs a positive value (a run's KL can be 0 throughout)
        ax.set_yscale("log", nonpositive="mask")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return drawn


def _title(column: str, window: int) -> str:
    title = (PLOTS | OVERVIEW_EXTRA)[column][1]
    return title if column.startswith("eval/") or window <= 1 else f"{title}\nrolling mean over {window} iterations"


def _draw_speed(ax, groups: dict[str, list[RunLog]], style: dict[str, tuple], target: float = TARGET) -> None:
    """Iterations to reach the target, fastest group on top: a bar for the mean over the seeds that got there, a
    dot per seed, a cross at the run's end for a seed that never did."""
    names = list(groups)[::-1]  # barh stacks bottom-up
    for y, name in enumerate(names):
        stats = [summarize(r, target) for r in groups[name]]
        reached = [s["iters_to_target"] for s in stats if s["iters_to_target"] is not None]
        missed = [s["iterations"] for s in stats if s["iters_to_target"] is None]
        if reached:
            ax.barh(y, np.mean(reached), color=style[name][0], alpha=0.35)
        ax.scatter(reached, [y] * len(reached), color=style[name][0], s=20, zorder=3)
        ax.scatter(missed, [y] * len(missed), color=style[name][0], marker="x", s=40, zorder=3)
    ax.set_yticks(range(len(names)), names)
    for label, name in zip(ax.get_yticklabels(), names, strict=True):
        label.set_color(style[name][0])
    title = f"Iterations to reach eval exact match {target:g}\n(bar: mean over the seeds that did;\n"
    title += "x: a seed that never did)"
    ax.set(title=title, xlabel="RL iteration")
    ax.grid(axis="x", alpha=0.3)


def against_time(runs: list[RunLog]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Eval EM against training minutes: at the evaluations every seed ran, the mean over seeds of `training_minutes`
    there, and the mean, min and max EM."""
    steps, mean, low, high = band(runs, "eval/exact_match", 1)
    clocks = [training_minutes(r) for r in runs]
    minutes = np.array([np.mean([c.get(int(s), np.nan) for c in clocks]) for s in steps])
    return minutes, mean, low, high


def _draw_time(ax, groups: dict[str, list[RunLog]], style: dict[str, tuple], target: float = TARGET) -> bool:
    """Eval EM against training minutes (the comparison at equal wall clock); False when no run has both."""
    drawn = False
    for name, runs in groups.items():
        have = [r for r in runs if r.series.get("eval/exact_match") and len(training_minutes(r)) > 1]
        if not have:
            continue
        minutes, mean, low, high = against_time(have)
        kept = ~np.isnan(minutes)
        ax.plot(minutes[kept], mean[kept], color=style[name][0], lw=1.8, marker="o", ms=3.5, label=style[name][1])
        if len(have) > 1:
            ax.fill_between(minutes[kept], low[kept], high[kept], color=style[name][0], alpha=0.12, lw=0)
        drawn = True
    ax.axhline(target, color="0.5", ls=":", lw=1)
    title = "Eval exact match (greedy) against training time\n(rollout + update minutes, mean over seeds)"
    ax.set(title=title, xlabel="training minutes", ylabel="exact match")
    ax.grid(alpha=0.3)
    return drawn


def plot(
    groups: dict[str, list[RunLog]], out: Path, window: int, overview_only: bool = False, target: float = TARGET
) -> list[str]:
    """`overview.png` with every plot on one page and, unless `overview_only`, one PNG per metric that some run
    logged, `speed.png` and `eval_exact_match_time.png`; returns the names of the PNGs besides the overview.

    The overview's sixth panel is the speed comparison when there are several groups to compare, else (one run, as
    at the end of `fit`) the completion length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    style = {
        name: (palette[i % len(palette)], legend_label(name, runs, target))
        for i, (name, runs) in enumerate(groups.items())
    }
    seeds = any(len(r) > 1 for r in groups.values())
    legend = ("fastest learner first" if len(groups) > 1 else "run") + (
        "; line: mean over seeds, band: min to max" if seeds else ""
    )
    logged = {c for runs in groups.values() for r in runs for c, values in r.series.items() if values}
    columns = [c for c in PLOTS if c in logged]
    has_eval = "eval/exact_match" in columns
    written = []
    for column in [] if overview_only else columns:
        fig, ax = plt.subplots(figsize=(9, 4.8))
        _draw(ax, groups, column, style, window, target)
        ax.legend(title=legend, fontsize=9, title_fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.savefig(out / f"{PLOTS[column][0]}.png", dpi=120, bbox_inches="tight")
        written.append(f"{PLOTS[column][0]}.png")
        plt.close(fig)
    if has_eval and not overview_only:
        fig, ax = plt.subplots(figsize=(7, 1.5 + 0.35 * len(groups)))
        _draw_speed(ax, groups, style, target)
        fig.savefig(out / "speed.png", dpi=120, bbox_inches="tight")
        written.insert(1, "speed.png")
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(9, 4.8))
        if _draw_time(ax, groups, style, target):
            ax.legend(title=legend, fontsize=9, title_fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.savefig(out / "eval_exact_match_time.png", dpi=120, bbox_inches="tight")
            written.insert(2, "eval_exact_match_time.png")
        plt.close(fig)
    speed = has_eval and len(groups) > 1
    panels = columns + ([] if speed else [c for c in OVERVIEW_EXTRA if c in logged])
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, column in zip(axes.flat, panels, strict=False):
        _draw(ax, groups, column, style, window, target)
    if speed:
        _draw_speed(axes.flat[len(panels)], groups, style, target)
    for ax in axes.flat[len(panels) + speed :]:
        ax.axis("off")
    rows = -(-len(groups) // 3)  # the legend under the plots, three entries a row
    fig.legend(*axes.flat[0].get_legend_handles_labels(), title=legend, loc="lower center", ncol=3, fontsize=10)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.04, 1, 1))
    fig.savefig(out / "overview.png", dpi=100)
    plt.close(fig)
    return written
