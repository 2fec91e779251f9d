"""A run's outputs as sha256 digests, to show that a change leaves training byte-for-byte as it was.

    .venv/bin/python benchmarks/fingerprint.py --save before.json        # on the commit before the change
    .venv/bin/python benchmarks/fingerprint.py --against before.json     # after it: exit 1 on any difference
        [--config configs/tiny/format_copy_grpo.yaml] [--iterations N] [--keep DIR]

Runs the config (default: the README's main job, all its iterations) in a fresh process in a temporary run
directory, W&B off, and digests what the run wrote: `metrics.csv` with the timing and memory columns left out (the
same rows `kill_resume.py` compares), `generations.jsonl`, every file under `eval/` and every file under `final/`
(a LoRA run's `adapter_config.json` with its set-valued fields sorted: peft writes them in hash order).
`--save` writes the digests as JSON; `--against` compares with a saved file and names each artifact that differs.
Same seed, same config, same machine: the digests must be equal (the project's invariant), so a refactor that
claims "behaviour unchanged" shows it here. Digests from another machine or torch build may differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kill_resume import environment, fit_command, metrics_rows

ROOT = Path(__file__).resolve().parents[1]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(run_dir: Path) -> dict[str, str]:
    """Artifact name -> sha256: the metrics rows as canonical JSON, the other files as their bytes."""
    out = {"metrics.csv (timings aside)": digest(json.dumps(metrics_rows(run_dir), sort_keys=True).encode())}
    for path in [run_dir / "generations.jsonl", *sorted((run_dir / "eval").rglob("*"))]:
        if path.is_file():
            out[str(path.relative_to(run_dir))] = digest(path.read_bytes())
    for path in sorted((run_dir / "final").rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "adapter_config.json":  # peft writes set-valued fields (target_modules) in hash order
                config = {
                    k: sorted(v) if k in SET_FIELDS and isinstance(v, list) else v for k, v in json.loads(data).items()
                }
                data = json.dumps(config, sort_keys=True).encode()
            out[str(path.relative_to(run_dir))] = digest(data)
    return out


# LoRA config fields peft keeps as sets and saves as lists in the process's string-hash order (`PYTHONHASHSEED`), so
# two runs of one setting write them in different orders: compared sorted.
SET_FIELDS = ("target_modules", "modules_to_save", "exclude_modules")


def fingerprint(config: str, iterations: int | None, keep: Path | None) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        runs = keep or Path(scratch)
        command = fit_command(runs, "fingerprint", iterations or 0, [], config=config)
        if iterations is None:  # the config's own iteration count and evaluation schedule
            ours = ("--model.init_args.iterations=", "--model.init_args.evaluation.every=")
            command = [c for c in command if not c.startswith(ours)]
        done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return digests(runs / "fingerprint")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny/format_copy_grpo.yaml", help="relative to the repository")
    parser.add_argument(
        "--iterations", type=int, help="default: the config's, with its evaluations (given: evaluate first and last)"
    )
    parser.add_argument("--save", type=Path, help="write the digests here as JSON")
    parser.add_argument("--against", type=Path, help="compare with digests saved by --save; exit 1 if any differ")
    parser.add_argument("--keep", type=Path, help="an empty directory to keep the run in (default: a temporary one)")
    args = parser.parse_args()
    if args.against is not None and not args.against.is_file():
        parser.error(f"--against={args.against}: no such file; write one with --save first")
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep={args.keep}: give an empty or new directory")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    found = fingerprint(args.config, args.iterations, args.keep)
    for name, value in found.items():
        print(f"{value[:16]}  {name}")
    if args.save is not None:
        args.save.write_text(json.dumps({"config": args.config, "iterations": args.iterations, **found}, indent=1))
    if args.against is None:
        return 0
    try:
        saved = json.loads(args.against.read_text())
        settings = (saved.pop("config"), saved.pop("iterations"))
    except (ValueError, KeyError, AttributeError, TypeError):
        raise SystemExit(f"{args.against}: not a file written by --save; write one with --save first") from None
    if settings != (args.config, args.iterations):
        raise SystemExit(f"{args.against} was saved for another config or iteration count: rerun with the same ones")
    differ = sorted(name for name in saved.keys() | found.keys() if saved.get(name) != found.get(name))
    for name in differ:
        print(f"DIFFERS: {name} ({'missing now' if name not in found else 'new' if name not in saved else 'changed'})")
    print(json.dumps({"artifacts": len(found), "differ": differ}))
    return 1 if differ else 0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    sys.exit(main())
