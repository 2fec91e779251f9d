"""Run names and the directories they give: which names are names, and whether a directory's files are its run's own.

`checked_run_path` turns `--runs_root` and `--run_name` into the run directory (`llm_pg.runs.directory` owns it from
there): only a name (folders of a few safe characters, `MAX_PART` at most each) that resolves strictly inside the
runs root through no symbolic link, neither inside another run nor holding runs of its own, and whose files are
its own (`check_run_files`). `enclosing_run` says which run a path lies in, for outputs that must not land in one.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from pathlib import Path

from llm_pg.runs.directory import LOCK, RUN_FILES, WANDB_ID, RunDirError, has_contents, holds_run

MAX_PART = 200  # characters per folder of a run name: 255 is the usual limit, and `--overwrite` appends `.old-<time>`
NAME_PART = re.compile(rf"^[A-Za-z0-9_][A-Za-z0-9_.+=@,-]{{0,{MAX_PART - 1}}}$")  # one folder of a run name


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
    around = enclosing_run(real_root)
    if around is not None:
        raise RunDirError(f"--runs_root {runs_root} lies inside the run directory {around}; give a folder outside it")
    for parent in [*reversed(directory.relative_to(root).parents), directory.relative_to(root)]:
        if parent != Path(".") and (root / parent).is_symlink():  # the run would be where its target is
            raise RunDirError(
                f"--run_name {run_name!r}: {root / parent} is a symbolic link; a run name's folders are folders of "
                "--runs_root: pick another name"
            )
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
        try:
            if (folder / LOCK).is_file() and any(
                (folder / name).exists() for name in RUN_FILES if name not in (LOCK, WANDB_ID)
            ):
                return folder
        except OSError:  # a folder this user may not look into: not a run of theirs
            continue
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

    def unreadable(error: OSError) -> None:  # a folder the walk cannot list could hide a link
        raise RunDirError(
            f"run dir {directory}: {error.filename} cannot be read ({error.strerror}); a run must see all its files: "
            "fix the permissions, or pick a new --run_name"
        )

    for top, folders, files in os.walk(directory, onerror=unreadable):
        here = Path(top)
        if here in (directory, directory / "validate"):  # W&B's folders are W&B's (`llm-pg validate` has its own)
            folders[:] = [f for f in folders if f != "wandb" or (here / f).is_symlink()]
        for name in sorted(folders + files):
            path = here / name
            try:
                info = path.lstat()
            except FileNotFoundError:  # the run that holds the directory removed it meanwhile
                continue
            except OSError as error:
                unreadable(error)
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
        here, copy, aside = (
            shlex.quote(str(p)) for p in (directory, _unused(directory, "copy"), _unused(directory, "linked"))
        )
        raise RunDirError(
            f"run dir {directory}: {len(shared)} file(s) have a second name (hard links, as a `cp -al` snapshot "
            f"makes; first: {shared[0].relative_to(directory)}); a run rewrites its files in place, which would "
            "change the other names' files too: give the run files of its own, keeping the linked ones aside (room "
            f"for one more copy of the run needed: cp -a --no-preserve=links {here} {copy} && mv -T {here} {aside} && "
            f"mv -T {copy} {here}), or pick a new --run_name"
        )


def _unused(directory: Path, word: str) -> Path:
    """`<directory>.<word>`, or `.<word>2`, ...: the first sibling that does not exist (a command given to a user must
    not copy or move into a folder that is already there)."""
    candidate, k = directory.with_name(f"{directory.name}.{word}"), 2
    while candidate.exists() or candidate.is_symlink():
        candidate, k = directory.with_name(f"{directory.name}.{word}{k}"), k + 1
    return candidate
