"""Kill the tiny main job at random moments, resume it, and check it ends exactly where an uninterrupted run ends.

    .venv/bin/python benchmarks/kill_resume.py [--kills 10] [--iterations 12] [--runs-root /dev/shm/...] [--seed 0]
        [--config configs/tiny/calc_arith_grpo.yaml]   (a tool task: multi-turn episodes)

One uninterrupted run of `configs/tiny/format_copy_grpo.yaml` (fewer iterations, no evaluation but the first
and last) is the reference. Then, `--kills` times: the same run is started and killed with SIGKILL or SIGTERM
(alternating) after a random number of saved iterations plus a random delay of up to two iterations (kills 0,
4, 8: SIGKILL the moment a `.last.ckpt*.tmp-*` file appears, i.e. during a checkpoint write), then resumed with
`--ckpt_path last` until it finishes. Each finished run must have final weights bitwise equal to the
reference's and the same `metrics.csv` rows (timing columns aside) and `generations.jsonl` rows. The runs live
under `--runs-root` (default: on /dev/shm, a tmpfs) while TMPDIR stays on the disk, so the checkpoint directory
and the temp directory are on different filesystems. Prints a line per kill and a summary; exits 1 if any run
differs. tests/test_run_safety.py runs it with one kill.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llm_pg.callbacks.checkpoint import read_header, verify

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny/format_copy_grpo.yaml"


def fit_command(
    runs_root: Path, name: str, iterations: int, extra: list[str], resume: bool = False, config: str = CONFIG
) -> list[str]:
    command = [sys.executable, "-m", "llm_pg.cli.fit", "fit", f"--config={ROOT / config}", f"--runs_root={runs_root}"]
    command += [f"--run_name={name}", f"--model.init_args.iterations={iterations}"]
    command += ["--model.init_args.evaluation.every=1000"]
    command += ["--wandb_project=null", "--trainer.enable_progress_bar=false", *extra]
    return command + (["--ckpt_path=last"] if resume else [])


def environment() -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])  # conftest tasks
    return env


def run(command: list[str]) -> int:
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True).returncode


def start_and_kill(command: list[str], checkpoints: Path, signum: int, saves: int, delay: float, write: bool) -> dict:
    """Start `command`; once it has saved `saves` checkpoints, wait `delay` seconds (with `write`: until a checkpoint
    write is under way) and send `signum`. Counting saves, not seconds, puts the kill where it was meant to land
    however busy the machine is. Returns what the kill hit."""
    marker = checkpoints / "last.ckpt.sha256"
    # A file, not a pipe, for stderr: a child blocked on a full pipe would never reach the kill.
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=log, text=True)
        start, seen, counted, armed, hit_write = time.perf_counter(), None, 0, None, False
        while child.poll() is None:
            stamp = marker.stat().st_mtime_ns if marker.exists() else None
            if stamp != seen:
                seen, counted = stamp, counted + 1
            if armed is None and counted >= saves:
                armed = time.perf_counter() + delay
            writing = write and any(checkpoints.glob(".last.ckpt*.tmp-*"))
            if armed is not None and time.perf_counter() >= armed and (writing or not write):
                hit_write = writing
                child.send_signal(signum)
                break
            time.sleep(0.0005 if write and armed is not None else 0.005)
        child.wait()
        log.seek(0)
        said = [line.strip() for line in log if line.startswith("llm-pg: stopped by")]
    return {"at": time.perf_counter() - start, "code": child.returncode, "write": hit_write, "said": said[-1:]}


def resume_until_done(command: list[str], limit: int = 3) -> int:
    """Resume until the run exits 0 (a SIGTERM before training started leaves nothing to resume); attempts."""
    for attempt in range(1, limit + 1):
        if run(command) == 0:
            return attempt
    raise RuntimeError(f"{command[-3:]}: not finished after {limit} resumes")


def metrics_rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [{k: v for k, v in r.items() if v and not k.startswith(("time/", "memory/"))} for r in csv.DictReader(f)]


def generation_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


def same_run(a: Path, b: Path) -> dict[str, bool]:
    """Bitwise-equal final weights, equal metrics.csv rows (timings aside), equal generations.jsonl rows."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows_a, rows_b = metrics_rows(a), metrics_rows(b)
    for i, (x, y) in enumerate(zip(rows_a, rows_b, strict=False)):
        if x != y:
            changed = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
            print(f"  metrics.csv row {i} differs: {changed}")
            break
    return {"weights": weights, "metrics": rows_a == rows_b, "generations": generation_rows(a) == generation_rows(b)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (the runs use seed 0)")
    shm = Path("/dev/shm")
    parser.add_argument("--runs-root", type=Path, default=(shm if shm.is_dir() else Path(tempfile.gettempdir())))
    parser.add_argument("--config", default=CONFIG, help="the run's config, relative to the repository (%(default)s)")
    args = parser.parse_args(argv)
    runs_root = Path(tempfile.mkdtemp(prefix="llm_pg_kill_", dir=args.runs_root))
    print(f"runs in {runs_root} (TMPDIR {tempfile.gettempdir()}); {args.iterations} iterations", flush=True)
    start = time.perf_counter()
    assert run(fit_command(runs_root, "reference", args.iterations, [], config=args.config)) == 0, (
        "the reference run failed"
    )
    duration = time.perf_counter() - start
    print(f"reference: {duration:.1f} s uninterrupted", flush=True)
    rng = random.Random(args.seed)
    failures = 0
    for k in range(args.kills):
        signum = signal.SIGKILL if k % 2 == 0 else signal.SIGTERM
        write = signum == signal.SIGKILL and k % 4 == 0  # kills 0, 4, 8: while last.ckpt is being written
        saves = rng.randrange(0, args.iterations)  # 0: before the first checkpoint (start-up or iteration 1)
        delay = 0.0 if write else rng.uniform(0.0, 2.0 * duration / args.iterations)  # up to two iterations
        name = f"kill{k}"
        command = fit_command(runs_root, name, args.iterations, [], config=args.config)
        kill = start_and_kill(command, runs_root / name / "checkpoints", signum, saves, delay, write)
        last = runs_root / name / "checkpoints" / "last.ckpt"
        saved = read_header(last)[0] if verify(last) is None else None
        attempts = resume_until_done(fit_command(runs_root, name, args.iterations, [], resume=True, config=args.config))
        same = same_run(runs_root / "reference", runs_root / name)
        failures += not all(same.values())
        where = "during a checkpoint write" if kill["write"] else "at a random moment"
        if kill["code"] == 0:
            where = "(it finished first: no kill)"
        print(
            f"kill {k}: {signal.Signals(signum).name} after {kill['at']:.2f} s {where}, exit {kill['code']}; "
            f"last.ckpt then: iteration {saved}; resumed in {attempts} attempt(s); equal: {same}"
            + (f"; said: {kill['said'][0]}" if kill["said"] else ""),
            flush=True,
        )
    print(f"{args.kills - failures}/{args.kills} killed runs ended bitwise equal to the reference", flush=True)
    shutil.rmtree(runs_root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
