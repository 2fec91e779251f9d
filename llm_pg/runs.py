"""Run directories: where a run writes, who owns it, when it is finished, and what a resume keeps.

A run directory `<runs_root>/<run_name>/` belongs to one run. `claim` makes that so: it takes `<dir>/.lock`
(an `fcntl.flock` on a file holding the owner's pid and host, released by the kernel when the process ends,
so a killed run leaves no stale lock) and refuses a fresh start into a directory that already holds a run.
`COMPLETE` is written last, after `final/`, and only when training reached its last iteration: it, not
`final/`, says a run is finished. On resume from iteration `k`, `trim_logs` drops every logged row of a later
iteration, so the replay writes each iteration's rows exactly once.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import lightning as L

LOCK, COMPLETE = ".lock", "COMPLETE"
OWNERSHIP_HELP = "continue it with --ckpt_path last, pick a new --run_name, or --overwrite true (moves it aside)"


class RunDirError(ValueError):
    """A run directory cannot be used as asked; the message says why and the ways out."""


def run_dir(trainer: L.Trainer) -> Path:
    """Where a run writes its files: the first logger's directory, else the trainer's root dir.

    Not `trainer.log_dir`: that broadcasts, and rank-zero-only callers would deadlock under DDP.
    """
    log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
    return Path(log_dir or trainer.default_root_dir)


def is_rank_zero() -> bool:
    """True in the process that owns the run: not a rank Lightning's DDP launcher (or torchrun) started."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def has_contents(path: str | Path) -> bool:
    """The directory exists and holds anything besides its lock file."""
    path = Path(path)
    return path.is_dir() and any(p.name != LOCK for p in path.iterdir())


def is_complete(path: str | Path) -> bool:
    """A run is finished when it wrote `COMPLETE` (after `final/`, at the end of its last iteration)."""
    return (Path(path) / COMPLETE).is_file()


def mark_complete(path: str | Path, iteration: int) -> None:
    write_text_atomic(Path(path) / COMPLETE, json.dumps({"iteration": iteration, "time": time.time()}) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory, fsync, `os.replace`: readers see the old text or the new, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry lives in the directory, not the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # some filesystems (network, FUSE) refuse fsync on a directory
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class RunLock:
    """An exclusive lock on a run directory for the life of this process (or until `release`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, directory: str | Path) -> RunLock:
        directory = Path(directory)
        path = directory / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except OSError as error:  # held by another process; or no flock here: trust a live pid on this host
            held = error.errno in (errno.EWOULDBLOCK, errno.EACCES) or _owner_alive(path)
        if held:
            os.close(fd)
            raise RunDirError(f"run dir {directory} is in use by {_owner(path)}; wait for it or pick a new --run_name")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def _owner(path: Path) -> str:
    try:
        pid, host = path.read_text().split()[:2]
    except (OSError, ValueError):
        return "another process"
    return f"pid {pid} on {host}"


def _owner_alive(path: Path) -> bool:
    """Whether the pid in a lock file is a live process on this host (a lock from another host counts as live)."""
    try:
        pid, host = path.read_text().split()[:2]
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return int(pid) != os.getpid()


def claim(directory: str | Path, resume: bool, overwrite: bool) -> RunLock:
    """Lock `directory` for this run; a fresh start (`resume` False) needs it empty or `overwrite`.

    `overwrite` moves the old run to `<dir>.old-<timestamp>/`: nothing is ever deleted.
    """
    directory = Path(directory)
    if resume and overwrite:
        raise RunDirError("--overwrite true starts a run afresh and --ckpt_path continues one: give only one")
    directory.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(directory)
    for stale in [*directory.glob(".*.tmp-*"), *directory.glob("checkpoints/.*.tmp-*")]:
        stale.unlink(missing_ok=True)  # a killed writer's half-written file: with the lock held, no one writes it
    if has_contents(directory) and not resume:
        if not overwrite:
            lock.release()
            raise RunDirError(f"run dir {directory} already holds a run: {OWNERSHIP_HELP}")
        aside = move_aside(directory)
        print(f"llm-pg: moved the previous run in {directory} to {aside}", flush=True)
    return lock


def move_aside(directory: Path) -> Path:
    """Move everything but the lock into a new sibling `<dir>.old-<timestamp>`; returns it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = directory.with_name(f"{directory.name}.old-{stamp}")
    suffix = 1
    while aside.exists():
        aside, suffix = directory.with_name(f"{directory.name}.old-{stamp}-{suffix}"), suffix + 1
    aside.mkdir()
    for entry in directory.iterdir():
        if entry.name != LOCK:
            shutil.move(str(entry), aside / entry.name)
    return aside


def trim_logs(directory: str | Path, iteration: int | None, final: bool = False) -> None:
    """Before a run continues from the checkpoint of `iteration`, drop what later iterations logged.

    `metrics.csv` keeps rows with `step <= iteration` (and drops a row cut short by a kill);
    `generations.jsonl` keeps rows sampled for iterations `< iteration` (a row's `iteration` is the one it was
    sampled for, one less than the step that logged it); `eval/iter_j.jsonl` files with `j > iteration` go, and
    so does `COMPLETE` (the run is training again). `iteration` None: a fresh start, every log goes. `final`:
    the checkpoint is the run's last iteration, whose end-of-training evaluation the resume runs again, so that
    evaluation's row goes too.
    """
    directory = Path(directory)
    (directory / COMPLETE).unlink(missing_ok=True)
    metrics, generations = directory / "metrics.csv", directory / "generations.jsonl"
    if iteration is None:
        metrics.unlink(missing_ok=True)
        generations.unlink(missing_ok=True)
        shutil.rmtree(directory / "eval", ignore_errors=True)
        return
    if metrics.is_file():
        _trim_csv(metrics, iteration, final)
    if generations.is_file():
        kept = []
        for line in generations.read_text().splitlines():
            try:
                if json.loads(line)["iteration"] < iteration:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                continue
        write_text_atomic(generations, "".join(kept))
    for path in (directory / "eval").glob("iter_*.jsonl"):
        if int(path.stem.removeprefix("iter_")) > iteration:
            path.unlink()


def _trim_csv(path: Path, iteration: int, final: bool) -> None:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows or "step" not in rows[0]:
        path.unlink()
        return
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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", newline="") as f:
        csv.writer(f).writerows(kept)  # Lightning's CSV writer ends lines with \r\n too
    os.replace(tmp, path)
