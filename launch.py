"""Modal launcher: `llm-pg fit` on H100s, with run directories and the Hugging Face cache on Volumes.

    modal run --detach launch.py --config configs/math_hard/grpo.yaml [--override model.init_args.kl_coef=0.1 ...]
                                 [--seed 1] [--run_name NAME] [--gpus N]
    LLM_PG_NODES=2 modal run --detach launch.py --config configs/math_hard/grpo_7b_fsdp.yaml --nodes 2 --gpus 8
    modal run --detach launch.py::sweep --file configs/sweeps/grpo_format_copy_ablation.yaml [--seeds 0,1] [--only a,b]
    modal run -w results.zip launch.py::bundle RUN_NAME...          # `llm-pg bundle` on the Volume, zip written here
    python launch.py --local --config configs/tiny/format_copy_grpo.yaml   # the same function here, without Modal

A run lives at `/<run_name>` on the Volume `llm-pg-runs` (`/runs/<run_name>` in the container); vLLM's compile
cache lives on `llm-pg-compile-cache`, so a retry does not compile the model again. The run name is
fixed per run (default: as `llm-pg fit` names it), so a retry after a preemption, a crash or the timeout finds
its checkpoints there and resumes with `--ckpt_path last`; launching a finished run (it has `COMPLETE`) does
nothing. A sweep first downloads its model and dataset into the Volume `llm-pg-hf-cache`, then starts its runs.
The W&B key comes from the Modal secret `wandb` (`modal secret create wandb WANDB_API_KEY=...`); without it
runs log W&B offline inside the run directory (set LLM_PG_WANDB_SECRET to use another secret name,
or to an empty string to skip the lookup). `--gpus N` asks for N H100s in one container and runs Lightning's DDP
across them (or the config's own `trainer.strategy`, e.g. fsdp2), each rank rolling out its own prompt groups.
`--nodes N --gpus 8` runs on a Modal cluster of N containers (`train_cluster`, `@modal.clustered(rdma=True)`), one
Lightning node each; N is fixed when the app is defined, so LLM_PG_NODES=N must be set too (default 2).

The commands and the training loop are plain Python in llm_pg/cli/modal_support.py, tested without Modal
credentials (tests/test_launch.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import modal

from llm_pg.cli.modal_support import (
    COMMIT_EVERY_S,
    COMPILE_CACHE_ENV,
    REMOTE_COMPILE_CACHE,
    REMOTE_HF,
    REMOTE_ROOT,
    REMOTE_RUNS,
    RUNTIME_NEEDS,
    cluster_env,
    default_run_name,
    fit_command,
    parse_launch_args,
    parse_override,
    prefetch_assets,
    prefetch_plan,
    run_fit,
)
from llm_pg.cli.sweep import expand, load_sweep, select

__all__ = ["COMMIT_EVERY_S", "default_run_name", "fit_command", "parse_override"]  # used by tests and users

ROOT = Path(__file__).resolve().parent
APP_NAME = "llm-pg"
RUNS_VOLUME, HF_VOLUME, COMPILE_VOLUME = "llm-pg-runs", "llm-pg-hf-cache", "llm-pg-compile-cache"
TORCH = "torch==2.13.0"  # installed first, as the Makefile does: the same version, here its CUDA build
VLLM = "vllm==0.32.0"  # pyproject's `vllm` extra, CUDA build: `--override model.init_args.rollout_engine=vllm`
# vLLM pins some packages of its own (transformers<5.20: the lock's 5.19.0 fits), so the project is installed after
# it, constrained by what vLLM chose plus the lock's line for every other package: the Makefile's `test-vllm` recipe.
CONSTRAINTS = (
    f"pip freeze --exclude-editable > {REMOTE_ROOT}/vllm-freeze.txt && "
    "awk -F'==' 'function key(s) { s = tolower(s); gsub(/_/, \"-\", s); return s } "
    "NR == FNR { chosen[key($1)] = 1; print; next } /^[A-Za-z]/ && !chosen[key($1)]' "
    f"{REMOTE_ROOT}/vllm-freeze.txt {REMOTE_ROOT}/requirements.lock > {REMOTE_ROOT}/constraints.txt"
)
GPU = "H100"
TIMEOUT_S = 24 * 60 * 60  # Modal's maximum, per attempt; math_hard GRPO (501 iterations) needs roughly 4-8 h
RETRIES = 3  # attempts after a crash or a timeout; preemptions restart the input on their own
WANDB_SECRET = os.environ.get("LLM_PG_WANDB_SECRET", "wandb")


# ---- what runs: plain functions (llm_pg/cli/modal_support.py), and the paths here ---------------------------


def fetch_command(run_name: str, dest: str = "runs") -> str:
    """The `modal volume get` that copies a run (or a sweep's folder) to `<dest>/<run_name>` here."""
    parent = shlex.quote(str(Path(dest, run_name).parent))
    return f"mkdir -p {parent} && modal volume get {RUNS_VOLUME} {shlex.quote(run_name)} {parent}"


def repo_config(config: str) -> str:
    """`config` as a path from the repository root, which is also the container's working directory; only files
    under configs/ are in the container."""
    path = (ROOT / config).resolve()
    if not path.is_file() or (ROOT / "configs") not in path.parents:
        raise SystemExit(f"{config}: give a file under configs/ (as a path from the repository root)")
    return path.relative_to(ROOT).as_posix()


# ---- Modal ---------------------------------------------------------------------------------------------

image = (
    modal.Image.debian_slim(python_version="3.11")
    # A C compiler for Triton at vLLM's start (RUNTIME_NEEDS): debian_slim has it today; named here so that a change
    # of base (a CUDA runtime image has none) keeps it.
    .apt_install(*RUNTIME_NEEDS)
    .pip_install(TORCH)
    .pip_install(VLLM)
    # vLLM's requirements pull torchaudio 2.11 (built for another torch), torchvision and torchcodec; text rollouts
    # need none of them, and a broken one fails `import vllm` (seen on the CPU build: Makefile, test-vllm).
    .run_commands("pip uninstall -y torchvision torchaudio torchcodec")
    .add_local_file(ROOT / "requirements.lock", f"{REMOTE_ROOT}/requirements.lock", copy=True)
    .run_commands(CONSTRAINTS)
    .pip_install_from_pyproject(
        str(ROOT / "pyproject.toml"), optional_dependencies=["vllm"], extra_options=f"-c {REMOTE_ROOT}/constraints.txt"
    )
    .env({"HF_HOME": REMOTE_HF, "PYTHONPATH": REMOTE_ROOT, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    .env(COMPILE_CACHE_ENV)  # vLLM's compile cache on its Volume: a retry loads the kernels instead of compiling
    .add_local_python_source("llm_pg", ignore=["**/__pycache__/**", "**/*.pyc"])  # assets (tiny model) included
    .add_local_dir(ROOT / "configs", f"{REMOTE_ROOT}/configs")
)
runs_volume = modal.Volume.from_name(RUNS_VOLUME, create_if_missing=True)
hf_volume = modal.Volume.from_name(HF_VOLUME, create_if_missing=True)
compile_volume = modal.Volume.from_name(COMPILE_VOLUME, create_if_missing=True)
TRAIN_VOLUMES = {REMOTE_RUNS: runs_volume, REMOTE_HF: hf_volume, REMOTE_COMPILE_CACHE: compile_volume}
app = modal.App(APP_NAME, image=image)


def _wandb_secrets() -> list[modal.Secret]:
    """The W&B secret when it exists (looked up only where Modal credentials are configured), else none."""
    has_token = os.environ.get("MODAL_TOKEN_ID") or modal.config.config.get("token_id")
    if not WANDB_SECRET or not modal.is_local() or not has_token:
        return []
    secret = modal.Secret.from_name(WANDB_SECRET, required_keys=["WANDB_API_KEY"])
    try:
        secret.hydrate()
    except Exception as error:  # not found, no access, offline: train anyway, W&B offline in the run dir
        print(f"no Modal secret {WANDB_SECRET!r} ({type(error).__name__}): W&B logs offline inside each run directory")
        return []
    return [secret]


def _commit_volumes() -> None:
    runs_volume.commit()
    hf_volume.commit()
    compile_volume.commit()


@app.function(
    gpu=GPU,
    cpu=8.0,
    memory=65536,
    timeout=TIMEOUT_S,
    retries=modal.Retries(max_retries=RETRIES, backoff_coefficient=1.0, initial_delay=30.0),
    volumes=TRAIN_VOLUMES,
    secrets=_wandb_secrets(),
)
def train(config: str, overrides: dict[str, Any], run_name: str, seed: int = 0, gpus: int = 1) -> str:
    """One run on Modal: resumes from the Volume when an earlier attempt left a checkpoint."""
    return run_fit(config, overrides, run_name, seed, gpus, REMOTE_RUNS, REMOTE_ROOT, _commit_volumes)


def _gpu_function(gpus: int):
    return train if gpus == 1 else train.with_options(gpu=f"{GPU}:{gpus}", cpu=8.0 * gpus, memory=65536 * gpus)


CLUSTER_NODES = int(os.environ.get("LLM_PG_NODES", "2"))  # `modal.clustered(size=...)` is fixed at definition
CLUSTER_GPUS = 8


@app.function(
    gpu=f"{GPU}:{CLUSTER_GPUS}",
    cpu=8.0 * CLUSTER_GPUS,
    memory=65536 * CLUSTER_GPUS,
    timeout=TIMEOUT_S,
    volumes=TRAIN_VOLUMES,
    secrets=_wandb_secrets(),
)
@modal.clustered(size=CLUSTER_NODES, rdma=True)
def train_cluster(config: str, overrides: dict[str, Any], run_name: str, seed: int = 0) -> str:
    """One run on CLUSTER_NODES containers x 8 H100s: each container is one Lightning node (Modal sets no rank
    variables: `cluster_env` makes them from the cluster); only node 0 commits the Volumes. Not retried: relaunch
    the same command to resume from the last committed checkpoint."""
    cluster = modal.Cluster.from_context()
    rank = cluster.container_rank()
    env = cluster_env(rank, cluster.container_ips())
    commit = _commit_volumes if rank == 0 else None
    return run_fit(
        config, overrides, run_name, seed, CLUSTER_GPUS, REMOTE_RUNS, REMOTE_ROOT, commit, CLUSTER_NODES, env
    )


def _announce(run_name: str) -> None:
    print(f"run {run_name}: Volume {RUNS_VOLUME}, path /{run_name} (in the container {REMOTE_RUNS}/{run_name})")
    print(f"  fetch it: {fetch_command(run_name)}")


@app.local_entrypoint()
def main(*argv: str) -> None:
    """`modal run [--detach] launch.py --config ... [--override K=V ...] [--seed N] [--run_name NAME] [--gpus N]`"""
    args = parse_launch_args(argv)
    if args.local:
        local(args)
        return
    config = repo_config(args.config)
    if args.nodes > 1 and (args.nodes, args.gpus) != (CLUSTER_NODES, CLUSTER_GPUS):
        raise SystemExit(
            f"--nodes {args.nodes} --gpus {args.gpus}: a cluster run uses {CLUSTER_GPUS} GPUs per node and "
            f"LLM_PG_NODES nodes ({CLUSTER_NODES}); run LLM_PG_NODES={args.nodes} modal run launch.py ... "
            f"--nodes {args.nodes} --gpus {CLUSTER_GPUS}"
        )
    _announce(args.run_name)
    if args.nodes > 1:
        status = train_cluster.remote(config, args.overrides, args.run_name, args.seed)
    else:
        status = _gpu_function(args.gpus).remote(config, args.overrides, args.run_name, args.seed, args.gpus)
    print(f"{args.run_name}: {status}")
    _announce(args.run_name)


@app.function(cpu=4.0, memory=16384, timeout=2 * 60 * 60, volumes={REMOTE_HF: hf_volume})
def prefetch(config: str, overrides: dict[str, Any]) -> str:
    """Download a config's model and dataset into the HF-cache Volume once, before a sweep's runs start: runs
    started together would otherwise each download them, and the Volume keeps whichever commit came last."""
    fetched = prefetch_assets(config, overrides)
    hf_volume.commit()
    return fetched


# A sweep is orchestrated by a small container rather than by the local entrypoint: a detached app keeps only
# the last function a local entrypoint started alive once the terminal goes away. The orchestrator is not
# preemptible, because a restart would start its runs a second time, racing the first copies.
@app.function(cpu=0.25, memory=1024, timeout=TIMEOUT_S, nonpreemptible=True)
def sweep(*argv: str) -> str:
    """`modal run [--detach] launch.py::sweep --file SWEEP.yaml [--seeds 0,1] [--only a,b] [--gpus N]`: in parallel."""
    parser = argparse.ArgumentParser(prog="modal run launch.py::sweep")
    parser.add_argument("--file", required=True, help="sweep YAML, e.g. configs/sweeps/grpo_format_copy_ablation.yaml")
    parser.add_argument("--seeds", help="comma-separated subset of the sweep's seeds")
    parser.add_argument("--only", help="comma-separated subset of the sweep's run names")
    parser.add_argument("--gpus", type=int, default=1)
    args = parser.parse_args(list(argv))
    spec = load_sweep(ROOT / repo_config(args.file))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    runs = select(expand(spec), seeds, args.only.split(",") if args.only else None)
    repo_config(runs[0].config)  # fail here, not in every run
    for run in prefetch_plan(runs):
        print(prefetch.remote(run.config, dict(run.overrides)), flush=True)
    function = _gpu_function(args.gpus)
    calls = [(run, function.spawn(run.config, dict(run.overrides), run.name, run.seed, args.gpus)) for run in runs]
    print(f"sweep {spec['name']}: {len(calls)} runs started, in Volume {RUNS_VOLUME} under /{spec['name']}/")
    failed = []
    for run, call in calls:
        try:
            print(f"{run.name}: {call.get(timeout=TIMEOUT_S)}", flush=True)
        except Exception as error:  # one failed run must not hide the others' results
            failed.append(run.name)
            print(f"{run.name}: FAILED ({type(error).__name__}: {error})", flush=True)
    summary = f"sweep {spec['name']}: {len(calls) - len(failed)}/{len(calls)} runs finished"
    print(f"{summary}\n  fetch: {fetch_command(str(spec['name']))}")
    print(f"  report: llm-pg report runs/{spec['name']} --out reports/{spec['name']}")
    return summary + (f"; failed: {', '.join(failed)}" if failed else "")


@app.function(cpu=2.0, memory=8192, timeout=60 * 60, volumes={REMOTE_RUNS: runs_volume})
def bundle(*argv: str) -> bytes:
    """`modal run -w results.zip launch.py::bundle RUN_NAME...`: `llm-pg bundle` of runs on the Volume.

    The zip is returned (`-w` writes it here) and kept on the Volume at /bundles/<--name>.
    """
    from llm_pg.cli.bundle import bundle as write_bundle

    parser = argparse.ArgumentParser(prog="modal run -w results.zip launch.py::bundle")
    parser.add_argument("runs", nargs="+", help="run names on the Volume, e.g. format_copy_grpo")
    parser.add_argument("--name", default="results.zip", help="file name on the Volume, under /bundles/")
    args = parser.parse_args(list(argv))
    runs_volume.reload()  # see runs that finished after this container started
    path = f"bundles/{Path(args.name).name}"
    write_bundle([f"{REMOTE_RUNS}/{name}" for name in args.runs], f"{REMOTE_RUNS}/{path}")
    runs_volume.commit()
    print(
        f"bundled {len(args.runs)} runs: Volume {RUNS_VOLUME} /{path}; fetch: modal volume get {RUNS_VOLUME} {path} ."
    )
    return Path(REMOTE_RUNS, path).read_bytes()


def local(args: argparse.Namespace) -> str:
    """`--local`: the launch function in this process, run directories under ./runs, no Volumes, no Modal."""
    if args.nodes > 1:
        raise SystemExit("--local runs on this machine only; drop --nodes (clusters need Modal)")
    start = time.perf_counter()
    status = run_fit(args.config, args.overrides, args.run_name, args.seed, args.gpus, str(ROOT / "runs"), ROOT)
    print(f"{args.run_name}: {status} ({(time.perf_counter() - start) / 60:.1f} min), in runs/{args.run_name}")
    return status


if __name__ == "__main__":
    parsed = parse_launch_args(sys.argv[1:])
    if not parsed.local:
        raise SystemExit("python launch.py runs only --local; on Modal: modal run --detach launch.py --config ...")
    local(parsed)
