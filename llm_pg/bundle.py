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
"""

from __future__ import annotations

import argparse
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

FILES = ("config.yaml", "metrics.csv", "generations.jsonl", "report.md", "overview.png")  # at the run's top level
FOLDERS = ("eval", "final")  # taken whole


def run_name(run_dir: Path) -> str:
    """The run's `run_name` from its config.yaml, else the folder's name."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    name = config.get("run_name") or run_dir.name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"{run_dir}: run_name {name!r} cannot name a folder inside a zip")
    return str(name)


def bundle_files(run_dir: Path) -> Iterator[Path]:
    """The files of one run that go in the bundle, as paths relative to the run directory."""
    for name in FILES:
        if (run_dir / name).is_file():
            yield Path(name)
    for folder in FOLDERS:
        for path in sorted((run_dir / folder).rglob("*")):
            if path.is_file():
                yield path.relative_to(run_dir)


def bundle(run_dirs: Sequence[str | Path], out: str | Path) -> list[str]:
    """Write the zip; returns its entry names. Fails before writing on a missing config or a repeated name."""
    runs: dict[str, Path] = {}
    for run_dir in map(Path, run_dirs):
        for required in ("config.yaml", "metrics.csv"):
            if not (run_dir / required).is_file():
                raise FileNotFoundError(f"{run_dir}: no {required}; is this a run directory?")
        name = run_name(run_dir)
        if name in runs:
            raise ValueError(f"{run_dir} and {runs[name]} are both run {name!r}")
        runs[name] = run_dir
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, run_dir in runs.items():
            if not (run_dir / "final").is_dir():
                print(f"note: {run_dir} has no final/ (unfinished run): bundled without weights")
            for relative in bundle_files(run_dir):
                entry = f"{name}/{relative.as_posix()}"
                archive.write(run_dir / relative, entry)
                entries.append(entry)
    return entries


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg bundle", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--out", required=True, help="the zip to write, e.g. results.zip")
    args = parser.parse_args(list(argv))
    entries = bundle(args.runs, args.out)
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out}: {len(args.runs)} runs, {len(entries)} files, {size:.1f} MiB")
    return 0
