"""Seeded sweeps: one base config, named override sets, and the seeds every set runs with.

A sweep file is YAML:

    # llm-pg sweep configs/sweeps/tiny_grpo_ablation.yaml
    base: configs/tiny/format_copy_grpo.yaml   # the config every run starts from (a path from the repo root)
    seeds: [0, 1]                              # every named run is repeated once per seed
    overrides:                                 # optional: applied to every run, before the run's own
      model.init_args.iterations: 20
    runs:                                      # run name -> overrides; {} runs the base config as it is
      reference: {}
      ppo_epochs4: {model.init_args.ppo_epochs: 4}
      mb8_accum1: {model.init_args.minibatch_size: 8, model.init_args.grad_accum_steps: 1}

Override keys are `llm-pg fit` flags without the dashes (`model.init_args.kl_coef: 0.1` becomes
`--model.init_args.kl_coef 0.1`); values are YAML (`null`, `true`, numbers, lists). Name each run after
what it changes. Run `<name>` with seed `s` is the run `<sweep>/<name>_seed<s>`, where `<sweep>` is the
file's stem (or its `name:` key): it lives in `<runs_root>/<sweep>/<name>_seed<s>/`, so a sweep's runs
share one folder that `llm-pg report` and `modal volume get` take whole.

    llm-pg sweep FILE [--dry-run] [--runs_root runs] [--seeds 0,1] [--only a,b] [extra `llm-pg fit` flags]

runs them here, one after another, each as its own `llm-pg fit` process: a finished run (it has
`COMPLETE`, written after `final/` at the end of its last iteration) is skipped; an interrupted one (anything
else in its directory: SIGTERM, a crash, a kill) resumes from its newest checkpoint that verifies. On Modal, in
parallel: `modal run --detach launch.py::sweep --file FILE`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Run", "expand", "load_sweep", "main", "outcome", "resume_flag", "select"]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")  # one path component, safe in a shell and on W&B
SWEEP_KEYS = {"name", "base", "seeds", "overrides", "runs"}


@dataclass(frozen=True)
class Run:
    """One `llm-pg fit` invocation: a config, dotted-key overrides, a seed, and the run name (its directory)."""

    name: str
    config: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def fit_args(self, runs_root: str = "runs", resume: bool = False) -> list[str]:
        """The arguments after `llm-pg fit`."""
        args = ["--config", self.config, *override_args(self.overrides), "--seed", str(self.seed)]
        args += ["--run_name", self.name, "--runs_root", runs_root]
        return args + (["--ckpt_path", "last"] if resume else [])

    @property
    def label(self) -> str:
        """The run's name in its sweep, without the sweep and the seed: `ppo_epochs4`."""
        return self.name.split("/")[-1].rsplit("_seed", 1)[0]


def cli_value(value: Any) -> str:
    """A YAML value as the command line spells it: `null`, `true`, `0.1`, `[1, 2]`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    """`{"model.init_args.kl_coef": 0.1}` -> `["--model.init_args.kl_coef", "0.1"]`."""
    args: list[str] = []
    for key, value in overrides.items():
        key = str(key).removeprefix("--")
        if not key or key.startswith("-") or " " in key:
            raise ValueError(f"override key {key!r} is not an `llm-pg fit` flag (write e.g. model.init_args.kl_coef)")
        if key in ("seed", "run_name", "runs_root", "config"):
            raise ValueError(f"override key {key!r} is set by the sweep itself; use seeds: / the run name instead")
        args += [f"--{key}", cli_value(value)]
    return args


def resume_flag(run_dir: str | Path) -> list[str]:
    """`["--ckpt_path", "last"]` when an earlier attempt left anything in the run dir, else `[]`.

    `llm-pg fit` refuses a fresh start into a run dir that holds files; with `--ckpt_path last` it continues
    from the newest checkpoint that verifies, or starts afresh when the attempt died before its first one.
    """
    from llm_pg.runs.directory import has_contents  # imports Lightning (seconds): not for `llm-pg sweep --help`

    return ["--ckpt_path", "last"] if has_contents(run_dir) else []


def outcome(returncode: int) -> str:
    """How one `llm-pg fit` ended, as the sweep reports it."""
    if returncode == 0:
        return "finished"
    if returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT):
        return "interrupted (saved; the next sweep resumes it)"
    return f"failed (exit {returncode})"


def run_fit(command: Sequence[str]) -> tuple[int, bool]:
    """Run one `llm-pg fit` to its end: `(exit code, whether this sweep got SIGTERM meanwhile)`. A SIGTERM to the
    sweep (`kill`, a job scheduler, `timeout`) is passed on to the run, which saves and stops, instead of killing
    the sweep alone and leaving its run training unseen; Ctrl-C reaches both through the terminal."""
    stopped = False
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True
        if child is not None:
            child.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        child = subprocess.Popen(list(command))
        if stopped:  # the signal came before the run existed
            child.send_signal(signal.SIGTERM)
        return child.wait(), stopped
    finally:
        signal.signal(signal.SIGTERM, previous)


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (plain YAML keeps the last one
    silently: a run listed twice would run once, with the second set of overrides)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: the merged keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                break  # the safe loader refuses it itself (a YAMLError: one line)
            if key in seen:
                raise ValueError(
                    f"line {key_node.start_mark.line + 1}: {key!r} is given twice in one mapping (first on line "
                    f"{seen[key]}); each run name and key once"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and check a sweep file; `name` defaults to the file's stem. Raises ValueError (one line, naming the
    file) for a file that cannot be read, is not YAML, or gives a key twice."""
    path = Path(path)
    try:
        sweep = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read the sweep file ({error.__class__.__name__}: {error})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if not isinstance(sweep, dict):
        raise ValueError(f"{path}: a sweep file is a mapping with base, seeds and runs")
    return {"name": path.stem, **sweep}


def expand(sweep: Mapping[str, Any]) -> list[Run]:
    """Every (named run, seed) pair of a sweep, run-major: `[a_seed0, a_seed1, b_seed0, ...]`."""
    unknown = set(sweep) - SWEEP_KEYS
    if unknown:
        raise ValueError(f"unknown sweep keys {sorted(unknown)}; a sweep has {sorted(SWEEP_KEYS)}")
    for key in ("name", "base", "runs"):
        if not sweep.get(key):
            raise ValueError(f"a sweep needs `{key}`")
    name, seeds = str(sweep["name"]), sweep.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {seeds}")
    shared = sweep.get("overrides") or {}
    runs = sweep["runs"]
    if not isinstance(runs, dict) or not isinstance(shared, dict):
        raise ValueError("runs is a mapping of run name -> overrides, and overrides a mapping of key -> value")
    for label in (name, *runs):
        if not NAME.match(str(label)):
            raise ValueError(f"name {label!r}: use letters, digits and . _ = + - (it becomes a directory)")
    expanded = []
    for label, overrides in runs.items():
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError(f"run {label!r}: overrides must be a mapping of key -> value, got {overrides!r}")
        merged = {**shared, **(overrides or {})}
        override_args(merged)  # fail on a bad key now, not an hour into the sweep
        expanded += [Run(f"{name}/{label}_seed{seed}", str(sweep["base"]), merged, seed) for seed in seeds]
    from llm_pg.runs.names import MAX_PART  # here: `llm-pg sweep --help` loads no Lightning

    longest = {f"the sweep's name {name!r}": len(str(name))}  # and each run's folder, <label>_seed<N>
    for run in expanded:
        what = f"run {run.label!r}"
        longest[what] = max(longest.get(what, 0), len(run.name.split("/")[-1]))
    for what, length in longest.items():
        if length > MAX_PART:
            over = length - MAX_PART
            raise ValueError(f"{what} makes a folder of {length} characters ({MAX_PART} at most): shorten it by {over}")
    return expanded


def select(runs: Sequence[Run], seeds: Sequence[int] | None = None, only: Sequence[str] | None = None) -> list[Run]:
    """The runs whose seed is in `seeds` and whose name (without sweep and seed) is in `only`; None keeps all."""
    chosen = [r for r in runs if seeds is None or r.seed in seeds]
    if only is not None:
        missing = set(only) - {r.label for r in runs}
        if missing:
            raise ValueError(f"--only names {sorted(missing)} are not in the sweep ({sorted({r.label for r in runs})})")
        chosen = [r for r in chosen if r.label in only]
    return chosen


def _csv(text: str | None, kind=str) -> list | None:
    return None if text is None else [kind(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llm-pg sweep",
        description="Run a sweep's runs here, one after another (finished runs are skipped, interrupted ones resume).",
        epilog="Arguments it does not know are passed to every `llm-pg fit`, e.g. --trainer.accelerator cpu.",
    )
    parser.add_argument("file", help="sweep YAML (configs/sweeps/...)")
    parser.add_argument("--runs_root", default="runs", help="folder that holds the run directories (default: runs)")
    parser.add_argument("--seeds", help="comma-separated subset of the sweep's seeds, e.g. 0,1")
    parser.add_argument("--only", help="comma-separated subset of the run names, e.g. reference,kl_coef0.2")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args, extra = parser.parse_known_args(list(argv))
    try:  # every mistake in the file is one line and exit 2 (no usage: the command line was right), before any run
        spec = load_sweep(args.file)  # starts or any directory is made
        expanded = expand(spec)
    except ValueError as error:
        message = str(error) if str(error).startswith(args.file) else f"{args.file}: {error}"
        print(f"llm-pg sweep: error: {message}", file=sys.stderr)
        return 2
    try:
        runs = select(expanded, _csv(args.seeds, int), _csv(args.only))
    except ValueError as error:  # --seeds / --only: the command line's mistake, shown with its usage
        parser.error(str(error))
    if not runs:
        parser.error(f"--seeds {args.seeds} selects none of the sweep's seeds {spec.get('seeds', [0])}")
    from llm_pg.runs.directory import is_complete  # imports Lightning (seconds): after the arguments parsed

    failed: list[str] = []
    finished = 0
    start = time.perf_counter()
    for i, run in enumerate(runs, 1):
        run_dir = Path(args.runs_root) / run.name
        done = is_complete(run_dir)
        resume = not done and bool(resume_flag(run_dir))
        fit_args = [*run.fit_args(args.runs_root, resume), *extra]
        status = "done, skipped" if done else "resuming" if resume else "new"
        print(f"[{i}/{len(runs)}] {run.name} ({status})\n  llm-pg fit {shlex.join(fit_args)}", flush=True)
        if args.dry_run or done:
            finished += done
            continue
        returncode, stopped = run_fit([sys.executable, "-m", "llm_pg.cli.fit", "fit", *fit_args])
        if returncode == 0:
            finished += 1
        else:
            failed.append(f"{run.name}: {outcome(returncode)}")
        if stopped or returncode in (128 + signal.SIGINT, -signal.SIGINT):  # stops the sweep, not just this run
            failed += [f"{later.name}: not started" for later in runs[i:]]
            break
    if not args.dry_run:
        minutes = (time.perf_counter() - start) / 60
        print(f"sweep: {finished}/{len(runs)} runs finished in {minutes:.1f} min")
        print(f"report: llm-pg report {Path(args.runs_root) / str(spec['name'])} --out reports/{spec['name']}")
    if failed:
        print("not finished:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0
