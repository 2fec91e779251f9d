"""Run directories: where a run writes, who owns it, and when it is finished.

A run directory `<runs_root>/<run_name>/` belongs to one run (`llm_pg.runs.names.checked_run_path` gives it for a
name and checks its files). `claim` takes `<dir>/.lock` (an `fcntl.flock` on a file holding the owner's pid and host,
released by the kernel when the process ends, so a killed run leaves no stale lock) and refuses a fresh start into
a directory that already holds a run; `--overwrite true` renames the whole directory to `<dir>.old-<time>` in one
atomic rename, so an interrupted overwrite leaves the old run whole on one side or the other. Nothing here deletes
a file of a run. `COMPLETE` is written last, after `final/`, and only when training reached its last iteration: it,
not `final/`, says a run is finished. What a resume keeps of the logs is `llm_pg.runs.logs`.

A run writes by path. Should its directory be moved or replaced while it runs (a new run of the same name may then
claim a new directory at the same path, its lock being a new file), every write of the run's files first checks
that `<dir>/.lock` still holds the token the run wrote there (`ensure_run_dir`), and the process otherwise leaves at
once, as a kill would, instead of writing into another run: the moved directory holds the run up to its last
checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import json
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import ClassVar

import lightning as L

LOCK, COMPLETE = ".lock", "COMPLETE"
WANDB_ID = "wandb_id"  # the run's W&B id (`llm_pg.runs.loggers.run_wandb_id`)
RUN_FILES = (
    LOCK,
    COMPLETE,
    "config.yaml",
    "hparams.yaml",
    "metrics.csv",
    "generations.jsonl",
    "eval",
    "final",
    "checkpoints",
    "validate",
    "wandb",
    WANDB_ID,
    "report.md",
    "overview.png",
)  # what a run writes, by name
OWNERSHIP_HELP = "continue it with --ckpt_path last, pick a new --run_name, or --overwrite true (moves it aside)"
RUN_DIR_GONE = 75  # the exit status of a run whose directory was moved or replaced under it (`ensure_run_dir`)


class RunDirError(ValueError):
    """A run directory cannot be used as asked; the message says why and the ways out."""


def holds_run(path: str | Path) -> bool:
    """A directory some run has used: it has a lock file, a config, metrics, checkpoints, `final/` or `COMPLETE`."""
    path = Path(path)
    return path.is_dir() and any(
        (path / name).exists() for name in (LOCK, "config.yaml", "metrics.csv", "checkpoints", "final", COMPLETE)
    )


def trained_contents(path: str | Path, first_save: int = 1) -> list[str]:
    """What in a run directory says a run trained there and saved it (empty when nothing does): `COMPLETE`,
    `final/`, checkpoint files, or metrics rows of an iteration after `first_save` (the first iteration a checkpoint
    is written for: rows up to it are what a run killed before its first checkpoint leaves, which a fresh start
    replays)."""
    path = Path(path)
    found = [name for name in (COMPLETE, "final/") if (path / name.rstrip("/")).exists()]
    if any((path / "checkpoints").glob("*.ckpt")):
        found.append("checkpoints/*.ckpt")
    last = _last_logged_iteration(path / "metrics.csv")
    if last > first_save:
        found.append(f"metrics.csv with rows up to iteration {last}")
    return found


def _last_logged_iteration(metrics: Path) -> int:
    """The largest `step` of `metrics.csv` (-1 when it has none or cannot be read)."""
    try:
        with metrics.open(newline="") as f:
            return int(max((_float(row.get("step")) for row in csv.DictReader(f)), default=-1))
    except (OSError, csv.Error, UnicodeDecodeError):
        return -1


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return -1.0


def run_dir(trainer: L.Trainer) -> Path:
    """Where a run writes its files: the first logger's directory, else the trainer's root dir.

    Not `trainer.log_dir`: that broadcasts, and rank-zero-only callers would deadlock under DDP. Callers write
    there at once: the directory is checked to be still this run's (`ensure_run_dir`).
    """
    log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
    return ensure_run_dir(Path(log_dir or trainer.default_root_dir))


def is_rank_zero() -> bool:
    """True in the process that owns the run: not a rank Lightning's DDP launcher (or torchrun) started."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def has_contents(path: str | Path) -> bool:
    """The directory exists and holds anything besides its lock file, its W&B id (`WANDB_ID`) and the base model's
    evaluation (`validate/`, which `llm-pg validate` writes before a run trains: a fit may follow it)."""
    path = Path(path)
    return path.is_dir() and any(p.name not in (LOCK, WANDB_ID, "validate") for p in path.iterdir())


def is_complete(path: str | Path) -> bool:
    """A run is finished when it wrote `COMPLETE` (after `final/`, at the end of its last iteration)."""
    return (Path(path) / COMPLETE).is_file()


def mark_complete(path: str | Path, iteration: int) -> None:
    write_text_atomic(ensure_run_dir(path) / COMPLETE, json.dumps({"iteration": iteration, "time": time.time()}) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory, fsync, `os.replace`: readers see the old text or the new, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", newline="") as f:  # newline="": the text's own line ends (the CSV's \r\n) are kept
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
    """An exclusive lock on a run directory for the life of this process (or until `release`). `held`: the run
    directories this process holds (an flock belongs to a process), for `ensure_run_dir`."""

    held: ClassVar[dict[Path, RunLock]] = {}

    def __init__(self, path: Path, fd: int, token: str = "") -> None:
        self.path, self.fd, self.token = path, fd, token

    def in_place(self) -> bool:
        """Whether `<dir>/.lock` is still this lock's file: it holds this lock's token (a random one written at
        `acquire`, beside the owner's pid and host). False when the file is gone (the directory was moved, renamed
        or deleted) or holds another token (a new run took the path); True when it cannot be read for another reason
        (a network filesystem's hiccup must not end a healthy run). Not the inode: some filesystems renumber them."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True
        try:
            fields = os.read(fd, 200).decode("ascii", "replace").split()
        except OSError:
            return True
        finally:
            os.close(fd)
        return fields[2:3] == [self.token]

    def now_at(self) -> Path | None:
        """Where the held lock file's directory is now (Linux: `/proc/self/fd`), or None when that cannot be told
        (deleted, or no `/proc`)."""
        try:
            target = os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            return None
        return None if target.endswith(" (deleted)") else Path(target).parent

    @classmethod
    def acquire(cls, directory: str | Path, record: bool = True) -> RunLock:
        """Lock `directory`, and (`record`) write this process's pid, host and token into its `.lock`. Without
        `record` the file is only locked, not written: for an overwrite, which renames the old run aside whole."""
        directory = Path(directory)
        path = directory / LOCK
        try:
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644
            )  # a link would write through to its target
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise RunDirError(f"{path} is a symbolic link; a run directory holds its own files: remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except OSError as error:  # held by another process; or no flock here: trust a live pid on this host
            held = error.errno in (errno.EWOULDBLOCK, errno.EACCES) or _owner_alive(path)
        if held:
            os.close(fd)
            raise RunDirError(f"run dir {directory} is in use by {_owner(path)}; wait for it or pick a new --run_name")
        if not record:
            return cls(path, fd)
        if os.fstat(fd).st_nlink > 1:  # writing the owner would rewrite the lock's other name too
            os.close(fd)
            raise RunDirError(f"{path} has a second name (a hard link); remove it (it only names the run's owner)")
        token = secrets.token_hex(8)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()} {token}\n".encode())
        lock = cls(path, fd, token)
        cls.held[Path(os.path.abspath(directory))] = lock
        return lock

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1
        for directory in [d for d, lock in self.held.items() if lock is self]:
            del self.held[directory]


def ensure_run_dir(path: str | Path) -> Path:
    """`path`, a run directory or a path inside one, once the run directory this process holds around it is still in
    place (`RunLock.in_place`); nothing to check where this process holds none (a DDP rank other than zero, a test).

    A run directory moved or replaced under its live run (a new run of the same name may hold the path now) ends
    the process at once with `RUN_DIR_GONE`, as a kill would: no exception, so that nothing on the way out (a
    logger's last flush, a checkpoint on exception) writes into the other run. Its files stay where the directory
    went, resumable from their last checkpoint. Every process this one started is killed first (`_descendants`):
    reward workers, vLLM's engine, and under DDP the other ranks when Lightning's launcher started them (torchrun's
    agent stops them itself when rank zero ends), which would otherwise end only when their backend notices (gloo's
    at once, on the closed connection; NCCL's at its collective's timeout)."""
    path = Path(path)
    absolute = Path(os.path.abspath(path))
    for directory, lock in list(RunLock.held.items()):
        if (absolute == directory or directory in absolute.parents) and not lock.in_place():
            now = lock.now_at()
            where = f"it is now {now}: resume it there" if now is not None else "its files are no longer there"
            sys.stderr.write(
                f"llm-pg: run dir {directory} was moved or replaced while this run was writing to it; stopping at "
                f"once, without writing more ({where}, with --ckpt_path last)\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            for pid in _descendants():  # not left running (or waiting for us) without us
                with contextlib.suppress(OSError):  # gone already
                    os.kill(pid, signal.SIGKILL)
            os._exit(RUN_DIR_GONE)
    return path


def _descendants() -> list[int]:
    """The pids of the processes this one started, and theirs (Linux: from `/proc`; elsewhere the multiprocessing
    children alone)."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return [child.pid for child in multiprocessing.active_children()]
    children: dict[int, list[int]] = {}
    for pid in entries:
        try:
            line = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = line.rpartition(")")[2].split()  # after the command name, which may hold spaces: state, ppid, ...
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


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

    `overwrite` renames the old run's whole directory to `<dir>.old-<timestamp>` (one atomic rename, under the old
    run's lock) and starts in a new, empty one: nothing is ever deleted.
    """
    directory = Path(directory)
    if resume and overwrite:
        raise RunDirError("--overwrite true starts a run afresh and --ckpt_path continues one: give only one")
    directory.mkdir(parents=True, exist_ok=True)
    moving = overwrite and has_contents(directory)  # renamed aside whole: its lock is held, not written
    lock = RunLock.acquire(directory, record=not moving)
    if moving and not has_contents(directory):  # emptied before the lock was ours: this run's own lock after all
        lock.release()
        moving, lock = False, RunLock.acquire(directory)
    for stale in [*directory.glob(".*.tmp-*"), *directory.glob("checkpoints/.*.tmp-*")]:
        stale.unlink(missing_ok=True)  # a killed writer's half-written temp file: with the lock held, no one writes it
    if has_contents(directory) and not resume:
        if not overwrite:
            lock.release()
            raise RunDirError(f"run dir {directory} already holds a run: {OWNERSHIP_HELP}")
        try:
            aside = move_aside(directory)
        finally:
            lock.release()  # the old run's lock went with it (or stays, if the rename failed); a new one below
        directory.mkdir()
        lock = RunLock.acquire(directory)
        print(f"llm-pg: moved the previous run in {directory} to {aside}", flush=True)
    return lock


def move_aside(directory: Path) -> Path:
    """Rename `directory` to a new sibling `<dir>.old-<timestamp>` in one atomic rename; returns it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = directory.with_name(f"{directory.name}.old-{stamp}")
    suffix = 1
    while aside.exists():
        aside, suffix = directory.with_name(f"{directory.name}.old-{stamp}-{suffix}"), suffix + 1
    os.rename(directory, aside)  # atomic on one filesystem; a sibling is always on the same one
    fsync_dir(directory.parent)
    return aside
