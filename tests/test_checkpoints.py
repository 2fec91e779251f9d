"""Checkpoint files (llm_pg/callbacks/checkpoint.py): every way a write can fail leaves the previous checkpoint
intact and verifiable, and every way a file can be damaged is caught before it is loaded."""

import errno
import os
import zipfile

import pytest
import torch

from llm_pg.callbacks import checkpoint as ckpt
from llm_pg.callbacks.checkpoint import VerifiedCheckpointIO, atomic_save, copy_checkpoint, newest_verified, verify


def state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64, 64), value)}, "llm_pg": {"iteration": int(value)}}


def load(path) -> float:
    return float(torch.load(path, weights_only=True)["state_dict"]["w"][0, 0])


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_a_write_is_verified_and_its_hash_is_the_files(tmp_path):
    import hashlib

    path = tmp_path / "last.ckpt"
    digest = atomic_save(state(1.5), path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert (tmp_path / "last.ckpt.sha256").read_text() == f"{digest}  last.ckpt\n"
    assert verify(path) is None and load(path) == 1.5


def _flip_4k_inside_the_weight(path) -> None:
    with zipfile.ZipFile(path) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 1000  # inside the 16 KiB tensor
    data[start : start + 4096] = bytes(b ^ 0x5A for b in data[start : start + 4096])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_4k_inside_the_weight, "sha256 mismatch"),
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "sha256 mismatch"),
        (lambda p: p.write_bytes(b""), "sha256 mismatch (0 bytes"),
        (lambda p: (p.parent / "last.ckpt.sha256").unlink(), "no .sha256"),
    ],
    ids=["4KiB-flipped", "truncated", "zero-bytes", "no-hash"],
)
def test_damage_is_caught_and_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, damage, reason):
    atomic_save(state(2.0), tmp_path / "iter_00002.ckpt")
    atomic_save(state(4.0), tmp_path / "iter_00004.ckpt")
    atomic_save(state(5.0), tmp_path / "last.ckpt")
    damage(tmp_path / "last.ckpt")
    assert reason in verify(tmp_path / "last.ckpt")
    (tmp_path / "iter_00004.ckpt").write_bytes(b"PK")  # the newest iteration copy is damaged too
    path, skipped = newest_verified(tmp_path)
    assert path == tmp_path / "iter_00002.ckpt" and load(path) == 2.0
    assert [s.split(" (")[0] for s in skipped] == [f"skipped {tmp_path / n}" for n in ("last.ckpt", "iter_00004.ckpt")]
    with pytest.raises(ValueError, match="does not verify") if reason != "no .sha256" else pytest.warns(UserWarning):
        VerifiedCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")


def test_flipped_bytes_inside_a_weight_load_silently_but_do_not_verify(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save(state(5.0), path)
    _flip_4k_inside_the_weight(path)
    weight = torch.load(path, weights_only=True)["state_dict"]["w"]  # torch's zip reader checks no CRC:
    assert (weight != 5.0).sum() > 1000  # a thousand wrong values, no error
    assert verify(path).startswith("sha256 mismatch")


def _fails_in_the_write(monkeypatch, error: OSError, after: int) -> None:
    """The checkpoint's own file write raises `error` after `after` bytes (a full disk, a kill midway)."""
    written = [0]

    class FailingFile:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            written[0] += len(data)
            if written[0] > after:
                raise error
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    real = ckpt._HashingWriter.__init__
    monkeypatch.setattr(ckpt._HashingWriter, "__init__", lambda self, f: real(self, FailingFile(f)))


@pytest.mark.parametrize(
    "fail",
    [
        lambda mp: _fails_in_the_write(mp, OSError(errno.ENOSPC, "No space left on device"), 10_000),
        lambda mp: _fails_in_the_write(mp, KeyboardInterrupt(), 5_000),  # dies midway (Ctrl-C)
        lambda mp: mp.setattr(ckpt.os, "replace", _raise(OSError(errno.EXDEV, "Invalid cross-device link"))),
        lambda mp: mp.setattr(ckpt.os, "fsync", _raise(OSError(errno.EIO, "I/O error"))),
    ],
    ids=["disk-full", "killed-midway", "cross-device-rename", "fsync-error"],
)
def test_a_failed_write_leaves_the_previous_checkpoint_intact_and_no_temp_file(tmp_path, monkeypatch, fail):
    path = tmp_path / "last.ckpt"
    atomic_save(state(1.0), path)
    before = path.read_bytes()
    fail(monkeypatch)
    with pytest.raises((OSError, KeyboardInterrupt)) as raised:  # the real cause, not torch's zip-writer error
        atomic_save(state(2.0), path)
    assert not isinstance(raised.value, RuntimeError)
    monkeypatch.undo()
    assert path.read_bytes() == before and verify(path) is None and load(path) == 1.0
    assert leftovers(tmp_path) == []


def _raise(error):
    def fail(*args, **kwargs):
        raise error

    return fail


def test_a_kill_between_the_rename_and_the_hash_update_still_verifies(tmp_path, monkeypatch):
    """The hash file lists the new and the old hash while the rename is in flight."""
    path = tmp_path / "last.ckpt"
    atomic_save(state(1.0), path)
    calls = []
    real = ckpt.write_text_atomic

    def die_on_second(target, text):
        calls.append(text)
        if len(calls) == 2:  # after os.replace, before the hash file lists the new hash alone
            raise KeyboardInterrupt
        return real(target, text)

    monkeypatch.setattr(ckpt, "write_text_atomic", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        atomic_save(state(2.0), path)
    assert len(calls[0].splitlines()) == 2
    assert verify(path) is None and load(path) == 2.0


def test_iteration_copies_are_links_or_byte_copies_and_verify(tmp_path, monkeypatch):
    atomic_save(state(3.0), tmp_path / "last.ckpt")
    copy_checkpoint(tmp_path / "last.ckpt", tmp_path / "iter_00003.ckpt")
    assert os.stat(tmp_path / "iter_00003.ckpt").st_ino == os.stat(tmp_path / "last.ckpt").st_ino
    monkeypatch.setattr(ckpt.os, "link", _raise(OSError(errno.EPERM, "no hard links on this filesystem")))
    copy_checkpoint(tmp_path / "last.ckpt", tmp_path / "iter_00004.ckpt")
    assert verify(tmp_path / "iter_00004.ckpt") is None and load(tmp_path / "iter_00004.ckpt") == 3.0
    atomic_save(state(5.0), tmp_path / "last.ckpt")  # a new last.ckpt leaves its earlier copies as they were
    assert load(tmp_path / "iter_00003.ckpt") == 3.0 and verify(tmp_path / "iter_00003.ckpt") is None


def test_only_the_runs_own_iteration_copies_are_resumed_from_or_rotated_away(tmp_path):
    """Found in review: a resume deleted `iter_00003_keep.ckpt` and `iter_best.ckpt` as the "oldest" copies, and a
    folder `iter_old.ckpt/` ended the last iteration in a stack trace."""
    from llm_pg.callbacks.checkpoint import IterationCheckpoint

    for iteration in (1, 2, 3):
        atomic_save(state(float(iteration)), tmp_path / f"iter_{iteration:05d}.ckpt")
    for name in ("iter_00003_keep.ckpt", "iter_best.ckpt"):
        atomic_save(state(9.0), tmp_path / name)  # a user's, with a .sha256 beside it
    (tmp_path / "iter_old.ckpt").mkdir()
    assert sorted(p.name for p in ckpt.iteration_copies(tmp_path)) == [f"iter_0000{i}.ckpt" for i in (1, 2, 3)]
    assert newest_verified(tmp_path)[0] == tmp_path / "iter_00003.ckpt"
    IterationCheckpoint(keep_last=1)._rotate(tmp_path, healthy_iteration=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = ["iter_00003.ckpt", "iter_00003_keep.ckpt", "iter_best.ckpt"]  # and the user's folder
    assert left == sorted([*kept, *(f"{name}.sha256" for name in kept), "iter_old.ckpt"])
