"""Run names are names (llm_pg/runs/names.py `checked_run_path`, llm_pg/runs/directory.py `claim`): nothing outside
the runs root, nor another run, is ever created, moved or deleted, whatever `--run_name` / `--runs_root` a user
types."""

import os
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from llm_pg.cli.fit import main
from llm_pg.runs.directory import RunDirError, claim
from llm_pg.runs.names import checked_run_path

CONFIG = f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"


def snapshot(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize(
    "name", ["", "..", "../escape", "/abs/path", "a/../../b", ".", "./a", "a//b", ".hidden", "-x", "a\nb", "a\\b"]
)
def test_names_that_are_not_names_are_refused(tmp_path, name):
    with pytest.raises(RunDirError, match=r"--run_name .* is not allowed: a run name is"):
        checked_run_path(str(tmp_path / "runs"), name)
    assert not (tmp_path / "runs").exists()  # refused before anything is created


def test_subfolders_inside_the_root_are_names(tmp_path):
    assert checked_run_path(str(tmp_path), "sweeps/lr_3e-5_seed1") == tmp_path / "sweeps" / "lr_3e-5_seed1"


def test_a_symlink_out_of_the_runs_root_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "runs" / "link")
    with pytest.raises(RunDirError, match="outside --runs_root"):
        checked_run_path(str(tmp_path / "runs"), "link/run")


def test_a_run_inside_a_run_or_holding_runs_is_refused(tmp_path):
    (tmp_path / "a" / "checkpoints").mkdir(parents=True)
    (tmp_path / "a" / ".lock").write_text("")
    with pytest.raises(RunDirError, match=r"lies inside the run directory .*a"):
        checked_run_path(str(tmp_path), "a/checkpoints")
    (tmp_path / "sweeps" / "x").mkdir(parents=True)
    (tmp_path / "sweeps" / "x" / ".lock").write_text("")
    with pytest.raises(RunDirError, match=r"holds other runs"):
        checked_run_path(str(tmp_path), "sweeps")


def test_a_runs_root_that_is_a_file_or_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a folder"):
        checked_run_path(str(tmp_path / "file"), "run")
    with pytest.raises(RunDirError, match="cannot be created"):
        checked_run_path(str(tmp_path / "file" / "below"), "run")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run_name=../escape"], "--run_name '../escape' is not allowed"),
        (["--run_name=/abs/path"], "--run_name '/abs/path' is not allowed"),
        (["--run_name=", "--ckpt_path=last"], "--run_name '' is not allowed"),
        (["--run_name=", "--overwrite=true"], "--run_name '' is not allowed"),
        (["--run_name=..", "--overwrite=true"], "--run_name '..' is not allowed"),
        (["--run_name=" + "a" * 201], "at most 200 each"),
        (["--run_name=r", "--checkpoint.dirpath=../elsewhere"], "checkpoint.dirpath ../elsewhere: a run keeps its"),
        (["--run_name=r", "--ckpt_path="], "--ckpt_path is empty; give last"),
        (
            ["--run_name=r", "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir=x"],
            "trainer.logger: a run logs into its own directory",
        ),
    ],
)
def test_the_cli_refuses_in_one_line_and_touches_nothing(tmp_path, capsys, monkeypatch, args, message):
    """The issue's attacks: before, each trained into, swallowed or moved the runs root or its parent."""
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    root = tmp_path / "runs"
    (root / "other_run").mkdir(parents=True)
    (root / "other_run" / "metrics.csv").write_text("step\n1\n")
    (root / "eval").mkdir()
    (root / "eval" / "iter_00000.jsonl").write_text("{}\n")  # a user's file in the runs root itself
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", CONFIG, f"--runs_root={root}", "--wandb_project=null", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert snapshot(tmp_path) == before


def test_runs_root_a_file_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as stop:
        main(["fit", CONFIG, f"--runs_root={tmp_path / 'file'}", "--wandb_project=null"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1 and "is a file, not a folder" in lines[0], lines


def test_overwrite_is_one_rename_of_the_run_dir_and_nothing_else(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "COMPLETE").write_text("{}")
    (run / "metrics.csv").write_text("step\n1\n")
    sibling = tmp_path / "other"
    sibling.mkdir()
    (sibling / "metrics.csv").write_text("step\n7\n")
    inode = run.stat().st_ino
    lock = claim(run, resume=False, overwrite=True)
    lock.release()
    (aside,) = tmp_path.glob("run.old-*")
    assert aside.stat().st_ino == inode  # the same directory, renamed: not a copy, not a file-by-file move
    assert sorted(p.name for p in aside.iterdir()) == [".lock", "COMPLETE", "final", "metrics.csv"]
    assert [p.name for p in run.iterdir()] == [".lock"]
    assert (sibling / "metrics.csv").read_text() == "step\n7\n"


def test_a_kill_at_the_rename_leaves_the_whole_old_run_on_one_side(tmp_path, monkeypatch):
    """Fault injected at the exact step: the process dies as the rename is attempted (before and after it)."""
    import llm_pg.runs.directory as runs

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "COMPLETE").write_text("{}")
    (run / "metrics.csv").write_text("step\n1\n")
    real_rename = os.rename

    def die_before(src, dst):
        raise KeyboardInterrupt  # stands for a kill: nothing after this line runs

    monkeypatch.setattr(runs.os, "rename", die_before)
    with pytest.raises(KeyboardInterrupt):
        claim(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [".lock", "COMPLETE", "final", "metrics.csv"]
    assert not list(tmp_path.glob("run.old-*"))

    def die_after(src, dst):
        real_rename(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.os, "rename", die_after)
    with pytest.raises(KeyboardInterrupt):
        claim(run, resume=False, overwrite=True)
    (aside,) = tmp_path.glob("run.old-*")
    assert sorted(p.name for p in aside.iterdir()) == [".lock", "COMPLETE", "final", "metrics.csv"]
    assert not run.exists()  # no half-run left under the old name for a sweep to count as finished


@pytest.mark.parametrize("name", [".lock", "eval", "metrics.csv", "final"])
def test_a_run_dir_whose_files_are_links_is_refused(tmp_path, name):
    """Found in review: a `.lock` link had the lock write through to its target, an `eval/` link had trim_logs
    delete files outside the run."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "iter_00007.jsonl").write_text("precious\n")
    (tmp_path / "runs" / "run").mkdir(parents=True)
    os.symlink(outside if name in ("eval", "final") else outside / "iter_00007.jsonl", tmp_path / "runs" / "run" / name)
    with pytest.raises(RunDirError, match=rf"{name} is a symbolic link; a run directory holds its own files"):
        checked_run_path(str(tmp_path / "runs"), "run")
    assert (outside / "iter_00007.jsonl").read_text() == "precious\n"


@pytest.mark.parametrize("name", ["final/config.json", "eval/iter_00003.jsonl", "validate/config.yaml"])
def test_a_link_deeper_in_the_run_dir_is_refused_too(tmp_path, name):
    """Found in review: a resume wrote the model's config and the eval rows through links inside `final/` and
    `eval/`, and `llm-pg validate` through links inside `validate/`."""
    (tmp_path / "precious.txt").write_text("keep\n")
    link = tmp_path / "runs" / "run" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "precious.txt")
    with pytest.raises(RunDirError, match=rf"run dir .*: {name} is a symbolic link; a run directory holds its own"):
        checked_run_path(str(tmp_path / "runs"), "run")
    assert (tmp_path / "precious.txt").read_text() == "keep\n"


@pytest.mark.parametrize("name", [".lock", "config.yaml", "final/config.json"])
def test_a_file_with_a_second_name_outside_the_run_is_refused(tmp_path, name):
    """Found in review: a resume rewrote hard-linked `.lock`, `config.yaml` and `final/config.json` in place, and
    with them the file's other name outside the run."""
    (tmp_path / "precious.txt").write_text("keep\n")
    path = tmp_path / "runs" / "run" / name
    path.parent.mkdir(parents=True)
    os.link(tmp_path / "precious.txt", path)
    with pytest.raises(RunDirError, match=rf"1 file\(s\) have a second name \(hard links.*first: {name}\); a run "):
        checked_run_path(str(tmp_path / "runs"), "run")
    assert (tmp_path / "precious.txt").read_text() == "keep\n"


def test_hard_links_in_checkpoints_are_allowed_as_a_checkpoint_is_only_ever_replaced(tmp_path):
    """`iter_XXXXX.ckpt` is a hard link of `last.ckpt` (`copy_checkpoint`), and a user may keep one of them under a
    name outside the run: a save replaces the run's name (`atomic_save`), and the other keeps its bytes."""
    from llm_pg.callbacks.checkpoint import atomic_save

    checkpoints = tmp_path / "runs" / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    atomic_save({"w": 1}, checkpoints / "last.ckpt")
    os.link(checkpoints / "last.ckpt", checkpoints / "iter_00003.ckpt")
    os.link(checkpoints / "last.ckpt", tmp_path / "best.ckpt")  # a third name, outside the run
    kept = (tmp_path / "best.ckpt").read_bytes()
    assert checked_run_path(str(tmp_path / "runs"), "run") == tmp_path / "runs" / "run"
    atomic_save({"w": 2}, checkpoints / "last.ckpt")
    assert (tmp_path / "best.ckpt").read_bytes() == kept != (checkpoints / "last.ckpt").read_bytes()


def test_a_hard_linked_snapshot_is_refused_once_and_the_fix_it_suggests_works(tmp_path):
    """A `cp -al` snapshot (a common backup) shares every file with the run: one refusal for all of them, whose
    command (quoted: the runs root has a space) gives the run files of its own under the same name and keeps the
    linked ones aside; `--overwrite true`, which moves the run aside whole, goes ahead without it."""
    import re
    import subprocess

    root = tmp_path / "my runs"
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    os.link(run / "checkpoints" / "last.ckpt", run / "checkpoints" / "iter_00003.ckpt")
    for name in ("metrics.csv", "config.yaml", ".lock"):
        (run / name).write_text(name)
    os.link(run / "metrics.csv", run / "metrics.bak")  # a second name inside the run too
    subprocess.run(["cp", "-al", str(run), str(tmp_path / "snapshot")], check=True)
    (root / "run.linked").mkdir()  # taken: the command names another folder
    assert checked_run_path(str(root), "run", overwrite=True) == run
    with pytest.raises(RunDirError, match=r"\.lock has a second name"):  # a plain start would write the owner in it
        claim(run, resume=False, overwrite=False)
    with pytest.raises(RunDirError, match=r"run dir .*: 4 file\(s\) have a second name \(hard links") as refused:
        checked_run_path(str(root), "run")
    command = re.search(r"copy of the run needed: (cp -a .*)\), or pick", str(refused.value)).group(1)
    subprocess.run(command, shell=True, check=True)
    assert checked_run_path(str(root), "run") == run  # its files are its own now
    (run / "metrics.csv").write_text("rewritten")
    assert (tmp_path / "snapshot" / "metrics.csv").read_text() == "metrics.csv"
    assert (root / "run.linked2" / "metrics.csv").read_text() == "metrics.csv"  # kept aside
    assert not any((root / "run.linked").iterdir())
    claim(root / "run.linked2", resume=False, overwrite=True).release()  # moved aside whole, lock not written
    assert (tmp_path / "snapshot" / ".lock").read_text() == ".lock"
    (aside,) = root.glob("run.linked2.old-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        ".lock",
        "checkpoints",
        "config.yaml",
        "metrics.bak",
        "metrics.csv",
    ]
    assert sorted(p.name for p in (root / "run.linked2").iterdir()) == [".lock"]  # the new run's own


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_an_unreadable_folder_of_a_run_is_one_line(tmp_path):
    """Found in review: a folder the walk could not list was skipped, and a link inside it went unseen."""
    (tmp_path / "runs" / "run" / "eval").mkdir(parents=True)
    (tmp_path / "runs" / "run" / "eval").chmod(0o333)
    try:
        with pytest.raises(RunDirError, match=r"eval cannot be read \(Permission denied\); a run must see all its"):
            checked_run_path(str(tmp_path / "runs"), "run")
    finally:
        (tmp_path / "runs" / "run" / "eval").chmod(0o755)


def test_an_unreadable_folder_is_refused_as_any_error_of_the_walk(tmp_path, monkeypatch):
    """The same refusal wherever the walk fails (as root, who reads every folder, by a walk that reports an error)."""
    from llm_pg.runs import names

    (tmp_path / "runs" / "run" / "eval").mkdir(parents=True)
    real_walk = os.walk

    def walk(top, onerror=None, **kwargs):
        onerror(PermissionError(13, "Permission denied", str(tmp_path / "runs" / "run" / "eval")))
        yield from real_walk(top, onerror=onerror, **kwargs)

    monkeypatch.setattr(names.os, "walk", walk)
    with pytest.raises(RunDirError, match=r"eval cannot be read \(Permission denied\); a run must see all its"):
        checked_run_path(str(tmp_path / "runs"), "run")


def test_a_runs_root_inside_a_run_is_refused(tmp_path):
    """Found in review: `--runs_root runs/a/eval` put a new run inside run a's `eval/`."""
    (tmp_path / "a" / "eval").mkdir(parents=True)
    (tmp_path / "a" / ".lock").write_text("1 host token\n")
    (tmp_path / "a" / "metrics.csv").write_text("step\n1\n")
    with pytest.raises(RunDirError, match=rf"--runs_root .* lies inside the run directory {tmp_path / 'a'}; give a"):
        checked_run_path(str(tmp_path / "a" / "eval"), "x")
    assert sorted(p.name for p in (tmp_path / "a" / "eval").iterdir()) == []


def test_a_symlinked_folder_of_a_run_name_is_refused(tmp_path):
    """Found in review: `ln -s a/eval runs/sw` and `--run_name sw/x` wrote a whole run into run a's `eval/`."""
    root = tmp_path / "runs"
    (root / "a" / "eval").mkdir(parents=True)
    (root / "a" / "metrics.csv").write_text("step\n1\n")
    (root / "sw").symlink_to(root / "a" / "eval")
    (root / "lnk").symlink_to(root / "a")
    for name in ("sw/x", "lnk"):
        with pytest.raises(RunDirError, match=rf"--run_name '{name}': {root / name.split('/')[0]} is a symbolic link"):
            checked_run_path(str(root), name)
    assert sorted(p.name for p in (root / "a" / "eval").iterdir()) == []


def test_the_wandb_folder_of_a_validation_is_w_and_bs(tmp_path):
    """Found in review: W&B links `latest-run` and its logs inside `validate/wandb` too; they are W&B's, not ours."""
    run = tmp_path / "runs" / "run"
    for folder in (run / "wandb", run / "validate" / "wandb"):
        folder.mkdir(parents=True)
        (folder / "latest-run").symlink_to(folder)
    assert checked_run_path(str(tmp_path / "runs"), "run") == run
    (run / "eval").mkdir()
    (run / "eval" / "wandb").symlink_to(tmp_path)  # only W&B's own folders are W&B's
    with pytest.raises(RunDirError, match=r"eval/wandb is a symbolic link"):
        checked_run_path(str(tmp_path / "runs"), "run")


@pytest.mark.parametrize(
    ("name", "kind", "message"),
    [
        ("final", "file", "is a file where a run keeps a folder"),
        ("eval", "file", "is a file where a run keeps a folder"),
        ("validate/eval", "file", "is a file where a run keeps a folder"),
        ("metrics.csv", "folder", "is a folder where a run keeps a file"),
        (".lock", "folder", "is a folder where a run keeps a file"),
        ("COMPLETE", "folder", "is a folder where a run keeps a file"),
        (".lock", "fifo", "is neither a file nor a folder"),
        ("eval/iter_00001.jsonl", "fifo", "is neither a file nor a folder"),
        ("checkpoints/last.ckpt", "folder", "is a folder where a run keeps a file"),
    ],
)
def test_a_run_file_of_the_wrong_kind_is_one_line(tmp_path, name, kind, message):
    """Found in review: a `final` that was a file let a run finish with exit 0, no weights and no COMPLETE; the
    other kinds ended in stack traces."""
    path = tmp_path / "runs" / "run" / name
    path.parent.mkdir(parents=True)
    {"file": lambda: path.write_text("x"), "folder": path.mkdir, "fifo": lambda: os.mkfifo(path)}[kind]()
    with pytest.raises(RunDirError, match=rf"{path} {message}; move it out of the run directory"):
        checked_run_path(str(tmp_path / "runs"), "run")


def test_a_run_name_leaves_room_for_overwrite_in_every_filesystem(tmp_path):
    assert checked_run_path(str(tmp_path), "a" * 200).name == "a" * 200
    with pytest.raises(RunDirError, match=r"at most 200 each"):
        checked_run_path(str(tmp_path), "sweeps/" + "a" * 201)


def test_a_dir_holding_only_the_base_models_evaluation_takes_a_fresh_run(tmp_path):
    """README's order, `llm-pg validate` (the pre-RL baseline) then `llm-pg fit`, under one run name."""
    run = tmp_path / "run"
    (run / "validate" / "eval").mkdir(parents=True)
    (run / "validate" / "metrics.csv").write_text("step\n0\n")
    claim(run, resume=False, overwrite=False).release()
    (run / "metrics.csv").write_text("step\n1\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        claim(run, resume=False, overwrite=False)


@pytest.mark.parametrize(
    ("link", "message"),
    [(os.symlink, r"\.lock is a symbolic link"), (os.link, r"\.lock has a second name \(a hard link\); remove it")],
)
def test_the_lock_never_writes_through_a_link(tmp_path, link, message):
    """A symbolic link, or a second name (hard link), of a file outside the run: its owner line is never written."""
    from llm_pg.runs.directory import RunLock

    (tmp_path / "precious.txt").write_text("keep\n")
    (tmp_path / "run").mkdir()
    link(tmp_path / "precious.txt", tmp_path / "run" / ".lock")
    with pytest.raises(RunDirError, match=message):
        RunLock.acquire(tmp_path / "run")
    assert (tmp_path / "precious.txt").read_text() == "keep\n"


def test_a_run_name_that_is_a_file_or_below_one_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    for name in ("f", "f/x"):
        with pytest.raises(RunDirError, match=r"is a file, not a folder; pick another name"):
            checked_run_path(str(tmp_path), name)


def test_a_moved_run_dir_is_noticed_and_its_process_leaves_without_writing_into_the_new_one(tmp_path):
    """`ensure_run_dir`: while the run dir is in place a write goes ahead; once it is moved (and a new run of the same
    name holds a new directory at its path) the process that held the old one exits `RUN_DIR_GONE` before writing,
    naming where its directory went; a process holding no run dir checks nothing."""
    import subprocess

    from llm_pg.runs.directory import RUN_DIR_GONE, RunLock, ensure_run_dir

    run, moved = tmp_path / "run", tmp_path / "moved"
    run.mkdir()
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from llm_pg.runs.directory import RunLock, ensure_run_dir\n"
        "run, moved = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "RunLock.acquire(run)\n"
        "(ensure_run_dir(run / 'metrics.csv')).write_text('before')\n"
        "os.rename(run, moved)\n"
        "run.mkdir()\n"
        "other = os.open(run / '.lock', os.O_CREAT | os.O_RDWR)  # the new run's lock file\n"
        "(ensure_run_dir(run / 'metrics.csv')).write_text('after')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(run), str(moved)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == RUN_DIR_GONE, done.stderr
    assert f"run dir {run} was moved or replaced" in done.stderr and f"it is now {moved}" in done.stderr
    assert (moved / "metrics.csv").read_text() == "before"
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing written into the new run
    (tmp_path / "here").mkdir()
    lock = RunLock.acquire(tmp_path / "here")
    try:
        assert lock.in_place() and ensure_run_dir(tmp_path / "here" / "x") == tmp_path / "here" / "x"
        os.rename(tmp_path / "here", tmp_path / "there")
        assert not lock.in_place() and lock.now_at() == tmp_path / "there"
    finally:
        lock.release()
    assert ensure_run_dir(tmp_path / "here" / "x") == tmp_path / "here" / "x"  # released: nothing held, nothing checked


def test_a_process_leaving_a_moved_run_dir_takes_the_processes_it_started_with_it(tmp_path):
    """The processes a run started (DDP ranks from Lightning's launcher, reward workers, vLLM's engine: here a child
    that started a grandchild) do not outlive its exit `RUN_DIR_GONE`, where a DDP rank would wait in its next
    collective until the timeout."""
    import subprocess

    from llm_pg.runs.directory import RUN_DIR_GONE

    run, pids = tmp_path / "run", tmp_path / "pids"
    run.mkdir()
    # The child starts a grandchild, writes both pids and sleeps; neither holds the test's pipes, so it returns at
    # the exit, not when they end.
    child = (
        "import os, subprocess, sys, time\n"
        "quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], **quiet)\n"
        "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {grandchild.pid}')\n"
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "time.sleep(120)\n"
    )
    script = (
        "import os, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from llm_pg.runs.directory import RunLock, ensure_run_dir\n"
        "run, pids = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "RunLock.acquire(run)\n"
        "quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}, str(pids)], **quiet)\n"
        "while not pids.exists():\n"
        "    time.sleep(0.05)\n"
        "os.rename(run, run.with_name('moved'))\n"
        "ensure_run_dir(run / 'metrics.csv')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run), str(pids)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == RUN_DIR_GONE, done.stderr
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2

    def alive(pid: int) -> bool:  # a killed process nobody has reaped yet is a zombie: not alive
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in started)


def test_a_dir_holding_only_its_lock_and_wandb_id_holds_no_run(tmp_path):
    """A start that failed after the run dir was claimed (and its W&B id written) but before anything ran leaves a
    directory a plain rerun may use; one more file and it holds a run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("1 host token\n")
    (run / "wandb_id").write_text("0123456789abcdef\n")
    claim(run, resume=False, overwrite=False).release()
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        claim(run, resume=False, overwrite=False)
