"""What a resume keeps of a run's logs: before a run continues from the checkpoint of iteration `k`, the rows that
later iterations logged are dropped, so the replay writes each iteration's rows exactly once.

Every rewrite goes through a temp file, fsync and `os.replace` (`runs.directory.write_text_atomic`): a kill or a full
disk at any moment leaves the old file or the new one, never none. Only files of this trainer's own names are
touched (`metrics.csv`, `generations.jsonl`, `eval/iter_XXXXX.jsonl`, `COMPLETE`); anything else a user put in the
run directory stays.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from llm_pg.runs.directory import COMPLETE, RunDirError, write_text_atomic

EVAL_FILE = re.compile(r"^iter_(\d+)\.jsonl$")


def trim_logs(directory: str | Path, iteration: int | None, final: bool = False) -> None:
    """Drop what iterations after `iteration` logged (None: a fresh start, which keeps no row).

    `metrics.csv` keeps rows with `step <= iteration` (and drops a row cut short by a kill);
    `generations.jsonl` keeps rows with `iteration <= iteration` (a row's `iteration` is the 1-based iteration that
    sampled it, the `step` that logged it; a file written while the count started at 0, recognised by its rows of
    iteration 0, is renumbered first, so one file never mixes the two); `eval/iter_j.jsonl` files with `j > iteration`
    go, and so does `COMPLETE` (the run is training again). `final`: the checkpoint is the run's last iteration, whose
    end-of-training evaluation the resume runs again, so that evaluation's row goes too.

    The CLI calls it with None only for a directory that holds no trained iteration
    (`runs.directory.trained_contents`), so a fresh start drops at most the iteration-0 evaluation a killed first
    iteration left.
    """
    directory = Path(directory)
    keep_up_to = -1 if iteration is None else iteration
    metrics, generations = directory / "metrics.csv", directory / "generations.jsonl"
    kept_metrics = _kept_csv(metrics, keep_up_to, final) if metrics.is_file() else None  # refused: nothing changed
    (directory / COMPLETE).unlink(missing_ok=True)  # first: a kill below leaves a run that is not finished
    if kept_metrics is not None:
        write_text_atomic(metrics, kept_metrics)
    if generations.is_file():
        write_text_atomic(generations, "".join(_kept_generations(generations, keep_up_to)))
    for path in (directory / "eval").glob("iter_*.jsonl"):
        found = EVAL_FILE.match(path.name)
        if found and path.is_file() and int(found.group(1)) > keep_up_to:
            path.unlink()


def _kept_generations(path: Path, iteration: int) -> list[str]:
    """The lines of `generations.jsonl` that iterations up to `iteration` logged, 1-based. A file whose rows count
    from 0 (written before the counter was 1-based: its first logged iteration, always kept, is 0) has every row's
    `iteration` raised by one; a line cut short by a kill is dropped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row["iteration"], int):
                rows.append((row, line))
        except (ValueError, KeyError, TypeError):
            continue
    shift = 1 if any(row["iteration"] == 0 for row, _ in rows) else 0
    kept = []
    for row, line in rows:
        if row["iteration"] + shift <= iteration:
            kept.append((json.dumps(row | {"iteration": row["iteration"] + 1}) if shift else line) + "\n")
    return kept


def _kept_csv(path: Path, iteration: int, final: bool) -> str | None:
    """The text of `metrics.csv` with the rows up to `iteration` (None: nothing to rewrite)."""
    text = path.read_text(errors="replace")
    if not text.strip():
        return None  # cut before its header was written: the logger starts it afresh
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if "step" not in rows[0]:
        raise RunDirError(
            f"{path} has no step column, so it is not this trainer's log; move it out of the run directory"
        )
    header, step = rows[0], rows[0].index("step")
    evaluation = [i for i, name in enumerate(header) if name.startswith("eval/") or name == "time/eval"]
    kept = [header]
    for row in rows[1:]:
        try:
            if len(row) != len(header) or float(row[step]) > iteration:
                continue
        except ValueError:
            continue
        logged = {i for i, value in enumerate(row) if value != "" and i != step}
        if final and float(row[step]) == iteration and logged and logged <= set(evaluation):
            continue  # the final evaluation, which the resume repeats
        kept.append(row)
    out = io.StringIO(newline="")
    csv.writer(out).writerows(kept)  # Lightning's CSV writer ends lines with \r\n too
    return out.getvalue()
