"""Run directories: where a run writes, who owns it, and when it is finished.

A run directory `<runs_root>/<run_name>/` belongs to one run, and a run name is a name: `checked_run_path` accepts only
a non-empty relative path without `.`/`..` parts that resolves strictly inside the runs root, neither lies inside
another run nor holds runs of its own, and whose files are its own (`check_run_files`). `claim` then takes
`<dir>/.lock` (an `fcntl.flock` on a file holding the owner's pid and host, released by the kernel when the process
ends, so a killed run leaves no stale lock) and refuses a fresh start into a directory that already holds a run;
`--overwrite true` renames the whole directory to `<dir>.old-<time>` in one atomic rename, so an interrupted
overwrite leaves the old run whole on one side or the other.
Nothing here deletes a file of a run. `COMPLETE` is written last, after `final/`, and only when training reached its
last iteration: it, not `final/`, says a run is finished. What a resume keeps of the logs is `llm_pg.runs.logs`.

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
import re
import secrets
import shlex
import signal
import socket
import stat
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
MAX_PART = 200  # characters per folder of a run name: 255 is the usual limit, and `--overwrite` appends `.old-<time>`
NAME_PART = re.compile(rf"^[A-Za-z0-9_][A-Za-z0-9_.+=@,-]{{0,{MAX_PART - 1}}}$")  # one folder of a run name
OWNERSHIP_HELP = "continue it with --ckpt_path last, pick a new --run_name, or --overwrite true (moves it aside)"
RUN_DIR_GONE = 75  # the exit status of a run whose directory was moved or replaced under it (`ensure_run_dir`)


class RunDirError(ValueError):
    """A run directory cannot be used as asked; the message says why and the ways out."""


def default_run_name(config: str | Path | None, seed: int = 0) -> str:
    """The run name `llm-pg fit` and launch.py give a run without `--run_name`: `tiny_format_copy_grpo` for
    configs/tiny/format_copy_grpo.yaml (`<folder>_<file stem>`; the stem alone for a file directly in `configs/`),
    `run` without a config file, `_seed<N>` appended when the seed is not 0; the same from any working directory."""
    if config is None:
        name = "run"
    else:
        path = Path(config).resolve()
        name = f"{path.parent.name}_{path.stem}" if path.parent.name != "configs" else path.stem
    return name if seed == 0 else f"{name}_seed{seed}"


def ensure_runs_root(runs_root: str) -> Path:
    """`runs_root` as an existing directory (created when missing); a file there, or a folder that cannot be
    created, is a one-line error."""
    root = Path(runs_root).expanduser()
    if not str(runs_root).strip():
        raise RunDirError("--runs_root is empty; give the folder that holds the run directories (default: runs)")
    if root.exists() and not root.is_dir():
        raise RunDirError(f"--runs_root {runs_root} is a file, not a folder; give a folder for the run directories")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise RunDirError(f"--runs_root {runs_root} cannot be created ({reason}); give a writable folder") from None
    return root


def checked_run_path(runs_root: str, run_name: str, overwrite: bool = False) -> Path:
    """`<runs_root>/<run_name>` after checking that the name is a name (module docstring); RunDirError otherwise.

    Allowed: folders of letters, digits and `_ . + = @ , -` (not starting with `.` or `-`) joined by `/`, such as
    `tiny_grpo` or `sweeps/lr_3e-5_seed1`. The resolved directory must lie strictly inside the resolved runs root
    (a symlinked folder pointing out of it is refused), must not be inside another run's directory, and must not
    hold run directories of its own; its files must be its own (`check_run_files`: with `overwrite`, which moves a run
    aside whole, files with a second name may stay)."""
    rule = (
        f"a run name is one or more folders of letters, digits and _.+=@,- (at most {MAX_PART} each) joined by / "
        "(e.g. sweeps/lr_a)"
    )
    parts = str(run_name).split("/")
    if not str(run_name) or str(run_name).startswith("/") or not all(NAME_PART.match(p) for p in parts):
        raise RunDirError(f"--run_name {run_name!r} is not allowed: {rule}, relative to --runs_root")
    root = ensure_runs_root(runs_root)
    directory = root / Path(*parts)
    real_root = root.resolve()
    real = directory.resolve()
    if real == real_root or real_root not in real.parents:
        raise RunDirError(f"--run_name {run_name!r} resolves to {real}, outside --runs_root {real_root}; {rule}")
    for k in range(1, len(parts) + 1):  # a link would put the run where its target is: inside another run, say
        if (root / Path(*parts[:k])).is_symlink():
            raise RunDirError(
                f"--run_name {run_name!r}: {root / Path(*parts[:k])} is a symbolic link; a run name's folders are "
                "folders of --runs_root: pick another name"
            )
    around = enclosing_run(real_root)
    if around is not None:
        raise RunDirError(f"--runs_root {runs_root} lies inside the run directory {around}; give a folder outside it")
    for parent in [*reversed(directory.relative_to(root).parents), directory.relative_to(root)]:
        if parent != Path(".") and (root / parent).exists() and not (root / parent).is_dir():
            raise RunDirError(f"--run_name {run_name!r}: {root / parent} is a file, not a folder; pick another name")
        if parent not in (Path("."), directory.relative_to(root)) and holds_run(root / parent):
            raise RunDirError(
                f"--run_name {run_name!r} lies inside the run directory {root / parent}; pick a name outside it"
            )
    if directory.is_dir():
        inner = next((d for d in directory.rglob(LOCK) if d.parent != directory), None)
        if inner is not None:
            raise RunDirError(
                f"run dir {directory} holds other runs ({inner.parent}); give the run a folder of its own (--run_name)"
            )
        check_run_files(directory, hard_links=not (overwrite and has_contents(directory)))
    return directory


def enclosing_run(path: str | Path) -> Path | None:
    """The run directory that `path` (resolved) is or lies in: the nearest of it and its parents that holds a lock
    file and something a run writes; None when there is none."""
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / LOCK).is_file() and any(
            (folder / name).exists() for name in RUN_FILES if name not in (LOCK, WANDB_ID)
        ):
            return folder
    return None


FOLDERS = ("eval", "final", "checkpoints", "validate", "wandb")  # the names of RUN_FILES that are folders


def check_run_files(directory: Path, hard_links: bool = True) -> None:
    """RunDirError, naming the path and the way out, unless every file in the run directory is one a run may
    write: no symbolic link anywhere (writes and deletions would act on its target), nothing but plain files and
    folders, a folder or a file where a run keeps one (`RUN_FILES`, also inside `validate/`), and, with
    `hard_links`, no file with a second name outside `checkpoints/` (a file rewritten in place changes its other
    name too; checkpoints are only ever replaced, never rewritten, and `iter_*.ckpt` are hard links of `last.ckpt`
    by design). W&B's own folders are W&B's (it links `latest-run` itself): only their names are checked."""
    fix = "move it out of the run directory, or pick a new --run_name"
    shared: list[Path] = []  # files with a second name
    checkpoints = directory / "checkpoints"
    for top, folders, files in os.walk(directory):
        here = Path(top)
        if here in (directory, directory / "validate"):  # W&B's folders are W&B's (`llm-pg validate` has its own)
            folders[:] = [f for f in folders if f != "wandb" or (here / f).is_symlink()]
        for name in sorted(folders + files):
            path = here / name
            try:
                info = path.lstat()
            except FileNotFoundError:  # the run that holds the directory removed it meanwhile
                continue
            if stat.S_ISLNK(info.st_mode):
                raise RunDirError(
                    f"run dir {directory}: {path.relative_to(directory)} is a symbolic link; a run directory holds "
                    f"its own files (nothing is written or deleted through a link): remove it, or pick a new --run_name"
                )
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                raise RunDirError(f"run dir {directory}: {path} is neither a file nor a folder; {fix}")
            known = (here in (directory, directory / "validate") and name in RUN_FILES) or (
                here == checkpoints and name == "last.ckpt"
            )
            if known and stat.S_ISDIR(info.st_mode) != (name in FOLDERS):
                kept, found = ("a folder", "a file") if name in FOLDERS else ("a file", "a folder")
                raise RunDirError(f"run dir {directory}: {path} is {found} where a run keeps {kept}; {fix}")
            if hard_links and stat.S_ISREG(info.st_mode) and info.st_nlink > 1 and here != checkpoints:
                shared.append(path)
    if shared:
        here, copy, aside = (shlex.quote(f"{directory}{suffix}") for suffix in ("", ".copy", ".linked"))
        raise RunDirError(
            f"run dir {directory}: {len(shared)} file(s) have a second name (hard links, as a `cp -al` snapshot "
            f"makes; first: {shared[0].relative_to(directory)}); a run rewrites its files in place, which would change "
            f"the other names' files too: give the run files of its own, keeping the linked ones aside (cp -a "
            f"--no-preserve=links {here} {copy} && mv {here} {aside} && mv {copy} {here}), or pick a new --run_name"
        )


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
    def acquire(cls, directory: str | Path) -> RunLock:
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
    logger's last flush, a checkpoint on exception) writes into the other run. Its reward workers are stopped
    first; its files stay where the directory went, resumable from their last checkpoint. Every process this one
    started goes with it (`_descendants`): reward workers, vLLM's engine, and under DDP the other ranks when
    Lightning's launcher started them (torchrun's agent stops them itself when rank zero ends), which would
    otherwise end only when their backend notices (gloo's at once, on the closed connection; NCCL's at its
    collective's timeout)."""
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
    lock = RunLock.acquire(directory)
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
