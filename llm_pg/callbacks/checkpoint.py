"""Checkpoints per RL iteration that survive kills, full disks and other filesystems, and are verified on load.

Every write goes to a temp file in the checkpoint's own directory (so the final rename never crosses a
filesystem), is flushed and fsynced, renamed over the target with `os.replace` (atomic on POSIX), and the
directory is fsynced. Its sha256, computed while writing, goes to `<name>.sha256` beside it; while the rename
is in flight that file lists the new and the old hash, so whichever file a crash leaves verifies. A reader
(`verify`) accepts a checkpoint only when its hash is listed there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from llm_pg.runs.directory import RunDirError, ensure_run_dir, fsync_dir, run_dir, write_text_atomic

LAST = "last.ckpt"
ITER = re.compile(r"^iter_(\d+)\.ckpt$")
_verified: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) of files that verified in this process


LIGHTNING_SIGNALS = "lightning.pytorch.trainer.connectors.signal_connector"


class SignalName(logging.Filter):
    """Lightning's SIGTERM handler, which also handles Ctrl-C here, logs `Received SIGTERM: 2` for a SIGINT: the
    record is rewritten to name the signal received (`Received SIGINT`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        head, found, number = text.rpartition("Received SIGTERM: ")
        if found and number.strip().isdigit():
            record.msg, record.args = f"{head}Received {signal.Signals(int(number)).name}", None
        return True


SIGNAL_NAME = SignalName()


class _HashingWriter:
    """A file wrapper that hashes what `torch.save` writes through it, so the file is not read back."""

    def __init__(self, file) -> None:
        self.file, self.sha = file, hashlib.sha256()
        self.error: BaseException | None = None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except BaseException as error:  # torch's zip writer replaces it with its own RuntimeError: keep it
            self.error = error
            raise
        self.sha.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def hash_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _listed_hashes(path: Path) -> list[str]:
    try:
        return [line.split()[0] for line in hash_path(path).read_text().splitlines() if line.strip()]
    except (OSError, IndexError):
        return []


def _install(tmp: Path, path: Path, digest: str) -> None:
    """Rename the fsynced `tmp` over `path`, the hash file listing both hashes while the rename is in flight."""
    ensure_run_dir(path)  # again: writing a large `tmp` takes minutes, in which the run dir may have been moved
    old = _listed_hashes(path)[:1]
    write_text_atomic(hash_path(path), "".join(f"{h}  {path.name}\n" for h in [digest, *old]))
    os.replace(tmp, path)
    fsync_dir(path.parent)
    write_text_atomic(hash_path(path), f"{digest}  {path.name}\n")


def atomic_save(checkpoint: dict[str, Any], path: str | Path) -> str:
    """`torch.save` to `path` atomically and durably, with its sha256 beside it; returns the hash."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            try:
                torch.save(checkpoint, writer)
            except RuntimeError:
                if writer.error is not None:  # the real cause: a full disk, an I/O error, an interrupt
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        _install(tmp, path, writer.sha.hexdigest())
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (full disk, kill) leaves the previous checkpoint as it was
    return writer.sha.hexdigest()


def copy_checkpoint(source: Path, target: Path) -> None:
    """`target` becomes a verified copy of `source` (a hard link when the filesystem has them)."""
    ensure_run_dir(target)
    digest = _listed_hashes(source)[0]
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (some network filesystems): copy the bytes
            with open(source, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        _install(tmp, target, digest)
    finally:
        tmp.unlink(missing_ok=True)


class NoChecksum(str):
    """The reason `verify` gives for a checkpoint with no `.sha256` beside it (one written by other code): it may be
    loaded unverified, unlike a damaged one. Tell it from the other reasons with `isinstance`."""


def verify(path: str | Path) -> str | None:
    """None when `path` is an intact checkpoint (its sha256 is listed in `<path>.sha256`), else why not (a
    `NoChecksum` when no hash is listed at all)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return "missing"
    if _verified.get(str(path)) == (stat.st_size, stat.st_mtime_ns):
        return None
    listed = _listed_hashes(path)
    if not listed:
        return NoChecksum("no .sha256 beside it")
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest not in listed:
        return f"sha256 mismatch ({stat.st_size} bytes: truncated or damaged)"
    _verified[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return None


def read_header(path: str | Path) -> tuple[int, dict[str, Any] | None]:
    """The iteration a checkpoint was saved at and the run config stored in it, without reading the weights
    (memory-mapped load: only the pickled structure is parsed)."""
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return int(checkpoint.get("llm_pg", {}).get("iteration", 0)), checkpoint.get("llm_pg_config")


def stored_data_fingerprint(path: str | Path) -> str | None:
    """The task-data fingerprint a checkpoint recorded (`PromptGroupDataModule.state_dict`), or None (a synthetic
    task, or a checkpoint from before fingerprints)."""
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = checkpoint.get("PromptGroupDataModule") or {}
    return state.get("data_fingerprint") if isinstance(state, dict) else None


def checkpoint_iteration(path: Path) -> int:
    found = ITER.match(path.name)
    return int(found.group(1)) if found else -1


def iteration_copies(directory: Path) -> list[Path]:
    """The `iter_<digits>.ckpt` files a run wrote in `directory`; anything else a user put there (`iter_best.ckpt`,
    a folder) is neither resumed from nor rotated away."""
    return [p for p in directory.glob("iter_*.ckpt") if ITER.match(p.name) and p.is_file()]


def check_checkpoint_dir(checkpoint, directory: Path) -> None:
    """RunDirError unless `checkpoint.dirpath` (the `checkpoint` group, if any) is unset or the run's own
    `checkpoints/`: rotation deletes old copies where it points, and a resume reads the run's own folder."""
    dirpath = None if checkpoint is None else checkpoint.get("dirpath")
    own = directory / "checkpoints"
    if dirpath is not None and Path(os.path.abspath(dirpath)) != Path(os.path.abspath(own)):
        raise RunDirError(
            f"checkpoint.dirpath {dirpath}: a run keeps its checkpoints in its own directory ({own}"
            "), where --ckpt_path last finds them and rotation deletes old copies; leave it unset (to keep a run "
            "elsewhere, move the whole run there with --runs_root)"
        )


def usable(path: str | Path) -> str | None:
    """None when `path` verifies (`verify`) and its header loads with the safe loader (`read_header`, which never
    runs pickled code), else why not."""
    return verify(path) or usable_header(path)


def usable_header(path: str | Path) -> str | None:
    """None when the header of `path` loads with the safe loader, else why not."""
    try:
        read_header(path)
    except pickle.UnpicklingError:  # it names code or a type outside tensors and plain containers
        return "refused by the safe loader (weights_only=True): it holds objects other than tensors and containers"
    except Exception as error:  # RuntimeError for a file that is not a torch zip archive, ...
        return f"refused by the safe loader: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return None


def newest_verified(directory: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from: `last.ckpt` if it is usable (`usable`), else the newest `iter_*.ckpt` that
    is; and a note for every damaged one passed over."""
    directory = Path(directory)
    candidates = [directory / LAST] if (directory / LAST).exists() else []
    candidates += sorted(iteration_copies(directory), key=checkpoint_iteration, reverse=True)
    skipped = []
    for path in candidates:
        reason = usable(path)
        if reason is None:
            return path, skipped
        skipped.append(f"skipped {path} ({reason})")
    return None, skipped


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing with `atomic_save` and refusing to load a checkpoint that fails `verify`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        ensure_run_dir(path)  # still this run's directory (a moved one ends the run: `runs.directory`)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        reason = verify(path)
        if isinstance(reason, NoChecksum):
            rank_zero_warn(f"{path}: {reason}; loading it unverified")
        elif reason is not None:
            raise ValueError(f"checkpoint {path} does not verify: {reason}")
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        ensure_run_dir(path)  # never a file of another run that now holds this path
        Path(path).unlink(missing_ok=True)
        hash_path(Path(path)).unlink(missing_ok=True)


class _SaveBeforeRollout(Callback):
    """Runs the pending save at the start of an iteration ahead of every other callback (the trainer's own
    callbacks come before the module's), so iteration k is on disk before iteration k+1's rollout begins."""

    def __init__(self, owner: IterationCheckpoint) -> None:
        self.owner = owner

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        self.owner.on_train_batch_start(trainer, module, *args)


class IterationCheckpoint(ModelCheckpoint):
    """Rewrites `last.ckpt` after every iteration (every `last_every_n_iterations`) and keeps the newest `keep_last`
    of the `iter_XXXXX.ckpt` copies made every `every_n_iterations` iterations (and at the last one).

    `last_every_n_iterations` > 1 is for checkpoints too large to write after every iteration (a 7B model's float32
    weights and AdamW state: ~92 GB): the loggers are still flushed after every iteration, and a SIGTERM/SIGINT
    (Modal's preemption, a Ctrl-C) and the end of training still save; only a hard kill (SIGKILL, out of memory, a
    lost machine) loses the iterations since the last write, which the resume trains again (their logged rows are
    dropped first, `llm_pg.runs.logs.trim_logs`).

    Iteration k is saved when it is wholly logged: at the start of iteration k+1 (before its rollout), at the end
    of training, or when SIGTERM/SIGINT stop the run between iterations (Lightning's SIGTERM handling, which this
    callback extends to SIGINT: the current iteration finishes, is saved, and the run stops; a second Ctrl-C
    abandons the iteration at once). The checkpoint also holds the run's resolved config (`run_config`, set by the
    CLI), which a resume compares with its own.

    Args:
        every_n_iterations: iterations between `iter_XXXXX.ckpt` copies (and one at the last iteration).
        keep_last: `iter_XXXXX.ckpt` copies kept, the newest (and never the last healthy one before a divergence).
        dirpath: null, or the run's own `<run dir>/checkpoints` (`check_checkpoint_dir` refuses anything else).
        last_every_n_iterations: iterations between rewrites of `last.ckpt` (1: after every iteration).
    """

    def __init__(
        self,
        every_n_iterations: int = 10,
        keep_last: int = 3,
        dirpath: str | None = None,
        last_every_n_iterations: int = 1,
    ) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"checkpoint.every_n_iterations must be >= 1, got {every_n_iterations}")
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1 (iter_*.ckpt files kept), got {keep_last}")
        if last_every_n_iterations < 1:
            raise ValueError(
                f"checkpoint.last_every_n_iterations must be >= 1, got {last_every_n_iterations}; 1 (the default) "
                "writes last.ckpt after every iteration"
            )
        super().__init__(dirpath=dirpath, save_last=False, save_top_k=-1, enable_version_counter=False)
        self.every_n_iterations, self.keep_last = every_n_iterations, keep_last
        self.last_every_n_iterations = last_every_n_iterations
        self.run_config: dict[str, Any] | None = None
        self.received_signal: int | None = None
        self.saved_iteration: int | None = None
        self.save_seconds: list[float] = []
        self._pending = False  # an iteration is logged but its rows are not flushed (nor saved) yet
        self._unsaved = False  # an iteration is done that last.ckpt does not hold yet
        self._handlers: dict[int, Any] = {}
        # Lightning runs checkpoint callbacks last; the CLI puts this one first in the trainer's callbacks.
        self.save_before_rollout = _SaveBeforeRollout(self)

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        # Not ModelCheckpoint.setup: it warns about a non-empty directory, which a resume always has.
        self.dirpath = trainer.strategy.broadcast(str(self.dirpath or run_dir(trainer) / "checkpoints"))
        self._fs = get_filesystem(self.dirpath)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._install_signal_handlers()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        self._pending = self._unsaved = True  # the iteration's metrics are logged after this hook: save once they are

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        if not self._pending:
            return
        iteration = module.iteration
        if iteration % self.last_every_n_iterations == 0 or iteration % self.every_n_iterations == 0:
            self.save(trainer, module)
        else:  # not due: the iteration's rows reach metrics.csv all the same
            self._flush_loggers(trainer)
            self._pending = False

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._unsaved:
            self.save(trainer, module)
        self._restore_signal_handlers()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        # Lightning raises SIGTERMException only between iterations, so the state is whole; any other exception
        # may stop mid-iteration, and then last.ckpt (the previous iteration) is the one to keep.
        if self._unsaved and isinstance(exception, SIGTERMException):
            self.save(trainer, module)
        self._restore_signal_handlers()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        pass  # evaluation is the EvalCallback's, by iteration; nothing to save here

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        pass

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: ModelCheckpoint's best-k bookkeeping is unused here (and restoring it into another
        directory, as `llm-pg validate` does, only warns)."""

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.run_config is not None:
            checkpoint["llm_pg_config"] = self.run_config

    def save(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Flush the loggers (so metrics.csv holds every row up to this iteration), write `last.ckpt`, copy it to
        `iter_XXXXX.ckpt` when due and drop the oldest copies beyond `keep_last`."""
        start = time.perf_counter()
        self._flush_loggers(trainer)
        directory = Path(self.dirpath)
        last = directory / LAST
        trainer.save_checkpoint(last)
        iteration = module.iteration
        self._pending = self._unsaved = False
        self.saved_iteration = iteration
        if trainer.is_global_zero:
            if iteration % self.every_n_iterations == 0 or iteration >= module.total_iterations:
                copy_checkpoint(last, directory / f"iter_{iteration:05d}.ckpt")
                self._rotate(directory, module.divergence.healthy_iteration)
            self.last_model_path = str(last)
        self.save_seconds.append(time.perf_counter() - start)

    def _rotate(self, directory: Path, healthy_iteration: int) -> None:
        """Drop the oldest `iter_*.ckpt` beyond `keep_last`, never the newest one of an iteration at or before
        `healthy_iteration` (the last before a streak of skipped or non-finite iterations: the one to go back to)."""
        copies = sorted(iteration_copies(directory), key=checkpoint_iteration)
        healthy = max(
            (p for p in copies if checkpoint_iteration(p) <= healthy_iteration), key=checkpoint_iteration, default=None
        )
        for old in copies[: -self.keep_last]:
            if old != healthy:
                old.unlink(missing_ok=True)
                hash_path(old).unlink(missing_ok=True)

    @staticmethod
    def _flush_loggers(trainer: L.Trainer) -> None:
        for logger in trainer.loggers:
            logger.save()

    def _install_signal_handlers(self) -> None:
        logging.getLogger(LIGHTNING_SIGNALS).addFilter(SIGNAL_NAME)
        """SIGINT joins SIGTERM: both let the iteration finish, save it, and stop (exit 130 / 143 from the CLI)."""
        if self._handlers or not hasattr(signal, "SIGTERM"):
            return
        try:
            self._handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
            lightning_handler = self._handlers[signal.SIGTERM]

            def stop(signum, frame) -> None:
                self.received_signal = signum
                signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
                if callable(lightning_handler):
                    lightning_handler(signum, frame)  # sets trainer.received_sigterm; stops DDP ranks too

            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
        except ValueError:  # not the main thread: keep Lightning's own handling
            self._handlers = {}

    def _restore_signal_handlers(self) -> None:
        logging.getLogger(LIGHTNING_SIGNALS).removeFilter(SIGNAL_NAME)
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}
