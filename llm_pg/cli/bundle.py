"""`llm-pg bundle RUN_DIR... --out FILE.zip`: what a write-up or a grader needs from each run, in one zip.

Per run, with no wrapper directory around the runs:

    <run_name>/config.yaml           the resolved config the run used
    <run_name>/metrics.csv           every logged metric, one row per iteration (train) or evaluation (eval)
    <run_name>/generations.jsonl     sampled rollout completions with reward and advantage
    <run_name>/report.md, overview.png  the run's own report and plot (written at the end of `llm-pg fit`)
    <run_name>/eval/iter_XXXXX.jsonl the greedy eval completions of each evaluation
    <run_name>/final/...             the trained policy (the LoRA adapter alone with LoRA) and tokenizer

`<run_name>` is the run's `--run_name` (`format_copy_grpo`, `grpo_format_copy_ablation/kl_coef0.2_seed0`), read
from its config.yaml. Checkpoints and W&B files stay out: they are large and only resuming needs them.
On Modal: `modal run launch.py::bundle --out FILE.zip RUN_NAME...`.

A run directory is untrusted input (it may have been copied from anywhere): its config.yaml is read with
`yaml.safe_load` (a tag such as `!!python/object` is refused, never run), and every path that goes in the zip must
resolve inside the run directory. A symlink that leads out of it, `final/` itself included, is left out with one line
on stderr; a link inside it is followed (once: a link loop is not walked twice).
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

FILES = ("config.yaml", "metrics.csv", "generations.jsonl", "report.md", "overview.png")  # at the run's top level
FOLDERS = ("eval", "final")  # taken whole


def run_name(run_dir: Path) -> str:
    """The run's `run_name` from its config.yaml, else the folder's name; ValueError (one line) when the config
    is not a YAML mapping or the name cannot be a folder inside a zip."""
    file = run_dir / "config.yaml"
    if not _inside(file, run_dir.resolve()):
        raise ValueError(f"{file}: a link out of the run directory; bundle the run it belongs to instead")
    try:
        config = yaml.safe_load(file.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{file}: not a config llm-pg wrote ({reason})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a config llm-pg wrote (a YAML {type(config).__name__}, not a mapping)")
    name = config.get("run_name") or run_dir.name
    if not isinstance(name, str) or any(part in ("", ".", "..") or "\\" in part for part in name.split("/")):
        # one spelling per folder (`./base` is `base`), and nothing out of it
        raise ValueError(f"{run_dir}: run_name {name!r} cannot name a folder inside a zip")
    return name


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`, every link in it resolved, lies in the (resolved) `root`."""
    return path.resolve().is_relative_to(root)


def bundle_files(run_dir: Path, skipped: list[str] | None = None) -> Iterator[Path]:
    """The files of one run that go in the bundle, as paths relative to the run directory; each resolves inside
    the run directory. What is left out for leading outside it is appended to `skipped` (paths relative to it)."""
    root = run_dir.resolve()
    skipped = [] if skipped is None else skipped

    def allowed(path: Path) -> bool:
        if _inside(path, root):
            return True
        skipped.append(path.relative_to(run_dir).as_posix())
        return False

    for name in FILES:
        if (run_dir / name).is_file() and allowed(run_dir / name):
            yield Path(name)
    for folder in FOLDERS:
        if (run_dir / folder).is_dir() and allowed(run_dir / folder):
            yield from _walk(run_dir, run_dir / folder, allowed, seen=set())


def _walk(run_dir: Path, folder: Path, allowed, seen: set[Path]) -> Iterator[Path]:
    """Files under `folder` in sorted order, descending into linked folders only when they resolve inside."""
    real = folder.resolve()
    if real in seen:  # a link back to a folder already walked
        return
    seen.add(real)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        if not allowed(path):
            continue
        if entry.is_dir():  # follows a link that `allowed` kept
            yield from _walk(run_dir, path, allowed, seen)
        elif entry.is_file():
            yield path.relative_to(run_dir)


def bundle(run_dirs: Sequence[str | Path], out: str | Path) -> list[str]:
    """Write the zip; returns its entry names. Fails before writing on a missing or unreadable config or a repeated
    name, or an `out` inside a run directory. Paths that lead out of a run directory are left out, one stderr line
    each."""
    runs: dict[str, Path] = {}
    for run_dir in map(Path, run_dirs):
        for required in ("config.yaml", "metrics.csv"):
            if not (run_dir / required).is_file():
                raise FileNotFoundError(f"{run_dir}: no {required}; is this a run directory?")
        name = run_name(run_dir)
        if name in runs:
            raise ValueError(f"{run_dir} and {runs[name]} are both run {name!r}")
        nested = next(
            (other for other in runs if f"{name}/".startswith(f"{other}/") or other.startswith(f"{name}/")), None
        )
        if nested is not None:  # one run's folder in the zip would hold the other's files
            raise ValueError(
                f"{run_dir} is run {name!r} and {runs[nested]} is run {nested!r}: one would lie inside the other"
            )
        runs[name] = run_dir
    out = Path(out)
    from llm_pg.runs.names import enclosing_run  # here: `llm-pg bundle --help` loads no Lightning

    around = enclosing_run(out.parent)
    if around is not None:
        raise ValueError(f"--out {out} lies in the run directory {around}, whose files are its own; write it outside")
    for run_dir in runs.values():
        if _inside(out, run_dir.resolve()):
            raise ValueError(
                f"--out {out} lies inside the run directory {run_dir}, which the bundle reads (the zip would grow into "
                f"itself or replace the run's files); write it outside, e.g. --out {run_dir.name}.zip"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    entries = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, run_dir in runs.items():
            if not (run_dir / "final").is_dir():
                print(f"note: {run_dir} has no final/ (unfinished run): bundled without weights")
            skipped: list[str] = []
            for relative in bundle_files(run_dir, skipped):
                entry = f"{name}/{relative.as_posix()}"
                archive.write(run_dir / relative, entry)
                entries.append(entry)
            for path in skipped:
                print(f"llm-pg bundle: skipped {run_dir / path}: a link out of the run directory", file=sys.stderr)
    return entries


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg bundle", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--out", required=True, help="the zip to write, e.g. results.zip")
    args = parser.parse_args(list(argv))
    try:
        entries = bundle(args.runs, args.out)
    except (ValueError, OSError) as error:  # a run directory is input: its faults are one line, not a traceback
        print(f"llm-pg bundle: error: {error}", file=sys.stderr)
        return 2
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out}: {len(args.runs)} runs, {len(entries)} files, {size:.1f} MiB")
    return 0
