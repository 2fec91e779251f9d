"""What `launch.py` runs, as plain Python (tested without Modal): the `llm-pg fit` command of a launch, the
loop that trains one run to the end while persisting its directory, and the one-time download of a sweep's
model and dataset into the Hugging Face cache.

Persisting: a Modal Volume keeps only what was committed. `run_fit` commits the run directory soon after each
new `last.ckpt` (it watches `last.ckpt.sha256`, the last file a checkpoint write touches), but not more often
than every COMMIT_MIN_S seconds, and at least every COMMIT_EVERY_S seconds, and once more when training ends
or is interrupted. A preempted or killed attempt therefore loses at most the iterations of the last
COMMIT_MIN_S seconds (plus the one in flight); a commit costs a pass over the changed files, so committing
after every iteration of a fast run would spend more time committing than training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_pg.cli.sweep import Run, override_args, resume_flag
from llm_pg.runs.directory import is_complete
from llm_pg.runs.names import default_run_name

REMOTE_ROOT = "/root"  # the package and configs in the container; the working directory of every run
REMOTE_RUNS, REMOTE_HF = "/runs", "/hf-cache"
# vLLM compiles the model at start (torch.compile, Inductor and Triton kernels: 1-3 min for a 1.5B model); its cache
# root holds all three (vLLM puts Inductor's and Triton's caches under it), kept on a Volume so that a retry or the
# next run of the same model and shapes loads the kernels instead of compiling them again.
REMOTE_COMPILE_CACHE = "/compile-cache"
COMPILE_CACHE_ENV = {"VLLM_CACHE_ROOT": f"{REMOTE_COMPILE_CACHE}/vllm"}
# What vLLM needs at run time beyond its wheel: a C compiler (Triton compiles a small launcher per kernel with `cc`;
# without one vLLM fails at start with "Failed to find C compiler", vllm issues 15329 and 14075) and Python's headers.
# Modal's debian_slim base has both (gcc and build-essential in every builder version; the python:3.x-slim image keeps
# its headers): tests/test_launch.py checks the image definition for them.
RUNTIME_NEEDS = ("gcc", "build-essential")
COMMIT_EVERY_S = 300  # persist the run directory at least this often
COMMIT_MIN_S = 60  # and after a new last.ckpt, but not more often than this
POLL_S = 10.0


def parse_override(text: str) -> tuple[str, str]:
    """`model.init_args.kl_coef=0.1` -> (`model.init_args.kl_coef`, `0.1`); the key is an `llm-pg fit` flag."""
    key, sep, value = text.partition("=")
    key = key.strip().removeprefix("--")
    if not sep or not key:
        raise ValueError(f"--override {text!r}: write KEY=VALUE, e.g. model.init_args.kl_coef=0.1")
    return key, value


def fit_command(
    config: str,
    overrides: Mapping[str, Any],
    run_name: str,
    resume: bool,
    gpus: int = 1,
    seed: int = 0,
    runs_root: str = REMOTE_RUNS,
    nodes: int = 1,
    strategy: str | None = "ddp",
) -> list[str]:
    """The `llm-pg fit` process one launch runs (as `python -m llm_pg.cli.fit`, which Lightning's DDP re-executes).

    With more than one GPU in all, `--trainer.devices gpus` (per node), `--trainer.num_nodes nodes` and
    `--trainer.strategy strategy` (None: the config's own `trainer.strategy`, e.g. fsdp2)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    args = Run(run_name, config, overrides, seed).fit_args(runs_root, resume)
    parallel = []
    if gpus * nodes > 1:
        parallel = ["--trainer.devices", str(gpus)] + (["--trainer.num_nodes", str(nodes)] if nodes > 1 else [])
        parallel += ["--trainer.strategy", strategy] if strategy else []
    return [sys.executable, "-m", "llm_pg.cli.fit", "fit", *args, *parallel]


def config_strategy(path: str | Path) -> Any:
    """The `trainer.strategy` a config file sets (None when it sets none, or cannot be read: `llm-pg fit` reports
    that): a launch then keeps it instead of ddp."""
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    return (config.get("trainer") or {}).get("strategy") if isinstance(config, dict) else None


CLUSTER_PORT = 29500  # MASTER_PORT on node 0 of a Modal cluster; any free port works, every node must agree


def cluster_env(container_rank: int, container_ips: Sequence[str], port: int = CLUSTER_PORT) -> dict[str, str]:
    """Lightning's multi-node variables from a Modal cluster (`modal.Cluster.from_context()`: `container_rank()`,
    `container_ips()`, ordered by rank), which sets none itself: node 0 is the rendezvous, each container a node."""
    if not 0 <= container_rank < len(container_ips):
        raise ValueError(f"container rank {container_rank} outside a cluster of {len(container_ips)} containers")
    return {"MASTER_ADDR": container_ips[0], "MASTER_PORT": str(port), "NODE_RANK": str(container_rank)}


def parse_launch_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modal run launch.py", description="Train one run on Modal (or --local).")
    parser.add_argument("--config", required=True, help="a config under configs/, e.g. configs/math_hard/grpo.yaml")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run_name", help="run directory name (default: as llm-pg fit names it)")
    parser.add_argument("--gpus", type=int, default=1, help="H100s per container, trained with DDP (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="containers of a Modal cluster (multi-node; default 1)")
    parser.add_argument("--local", action="store_true", help="run here, in-process, with runs under ./runs")
    args = parser.parse_args(list(argv))
    args.overrides = dict(parse_override(o) for o in args.override)
    if "seed" in args.overrides or "run_name" in args.overrides:
        parser.error("use --seed and --run_name, not --override, for the seed and the run name")
    args.run_name = args.run_name or default_run_name(args.config, args.seed)
    return args


class Interrupted(KeyboardInterrupt):
    """SIGTERM reached the launcher (a preemption, Modal stopping the app): stop training, keep what was saved."""


def _on_sigterm(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


def run_fit(
    config: str,
    overrides: Mapping[str, Any],
    run_name: str,
    seed: int = 0,
    gpus: int = 1,
    runs_root: str = REMOTE_RUNS,
    cwd: str | Path = REMOTE_ROOT,
    commit: Callable[[], None] | None = None,
    nodes: int = 1,
    env: Mapping[str, str] | None = None,
) -> str:
    """Train one run to the end, resuming it if an earlier attempt left anything; returns how it ended.

    Training runs in a child process (Lightning's DDP launcher re-executes its command line). A SIGTERM or
    SIGINT here stops the child with SIGTERM (it saves the finished iteration) and commits before returning.
    On a cluster every node runs this with `env = cluster_env(...)`; only node 0 passes `commit`.
    """
    run_dir = Path(runs_root) / run_name
    if is_complete(run_dir):
        print(f"{run_name}: already finished ({run_dir}/COMPLETE exists); pick another --run_name to train again")
        return "already finished"
    resume = bool(resume_flag(run_dir))
    strategy = None if config_strategy(Path(cwd) / config) else "ddp"
    command = fit_command(config, overrides, run_name, resume, gpus, seed, runs_root, nodes, strategy)
    print(("resuming: " if resume else "starting: ") + shlex.join(command), flush=True)
    child_env = {**os.environ, **env} if env else None
    child = subprocess.Popen(command, cwd=cwd, env=child_env, start_new_session=True)  # DDP ranks stop with it
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: nothing to forward from
        previous = None
    try:
        returncode = _wait_committing(child, run_dir / "checkpoints" / "last.ckpt.sha256", commit)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:  # interrupted (preemption, timeout, Ctrl-C): stop training, keep what was saved
            _stop(child)
        if commit:
            commit()
    if returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        raise RuntimeError(f"{run_name}: stopped by a signal (exit {returncode}); saved, a retry resumes it")
    if returncode != 0:
        raise RuntimeError(f"{run_name}: llm-pg fit exited with {returncode}")
    return "finished"


def _wait_committing(child: subprocess.Popen, marker: Path, commit: Callable[[], None] | None) -> int:
    """Wait for the child, committing after each new checkpoint (at most every COMMIT_MIN_S seconds) and at least
    every COMMIT_EVERY_S seconds."""
    import time

    last_commit, seen = time.monotonic(), _mtime(marker)
    while True:
        try:
            return child.wait(timeout=min(POLL_S, COMMIT_EVERY_S))
        except subprocess.TimeoutExpired:
            pass
        now, stamp = time.monotonic(), _mtime(marker)
        fresh_checkpoint = stamp != seen and now - last_commit >= COMMIT_MIN_S
        if commit and (fresh_checkpoint or now - last_commit >= COMMIT_EVERY_S):
            commit()
            last_commit, seen = now, stamp


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the training process group (every DDP rank), SIGKILL if it is still there a minute later."""
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


ASSET_KEYS = ("model.init_args.model_name_or_path", "data.")


def prefetch_plan(runs: Sequence[Run]) -> list[Run]:
    """One run per distinct (config, model and data overrides): the downloads a sweep needs, each once."""
    plan: dict[tuple, Run] = {}
    for run in runs:
        key = (run.config, tuple(sorted((k, str(v)) for k, v in run.overrides.items() if k.startswith(ASSET_KEYS))))
        plan.setdefault(key, run)
    return list(plan.values())


def prefetch_assets(config: str, overrides: Mapping[str, Any]) -> str:
    """Download the model and the task's data of a config into the Hugging Face cache (HF_HOME), so parallel runs
    find them there instead of each downloading them; returns what it fetched."""
    from huggingface_hub import snapshot_download

    from llm_pg.cli.fit import LLMPGCLI
    from llm_pg.data.datamodule import PromptGroupDataModule
    from llm_pg.models.loading import resolve_model_path
    from llm_pg.modules.base import PolicyGradientModule

    args = ["--config", config, *override_args(overrides), "--wandb_project=null", "--trainer.accelerator=cpu"]
    cli = LLMPGCLI(PolicyGradientModule, PromptGroupDataModule, subclass_mode_model=True, run=False, args=args)
    name = cli.model.hparams.model_name_or_path
    local = Path(resolve_model_path(name)).is_dir()
    if not local:
        snapshot_download(name)
    cli.datamodule.task.prepare()  # the task's dataset (math_hard: the hub dataset) lands in the cache too
    return f"{config}: model {name} ({'local' if local else 'downloaded'}), task {type(cli.datamodule.task).__name__}"
