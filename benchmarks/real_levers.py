"""Each speed lever alone on the real model: seconds per format_copy GRPO iteration at the course's settings.

    make real-model && .venv/bin/python benchmarks/real_levers.py [--iterations 3] [--only a,b] [--every 3]
    .venv-vllm/bin/python benchmarks/real_levers.py --only vllm_engine --iterations 2     # vLLM against HF generate

The baseline is `bench_vs_trl.py --model real`'s llm_pg side: configs/format_copy/grpo.yaml with SmolLM2-135M-Instruct
on the CPU (two torch threads, float32, gradient checkpointing off, constant lr) and llm_pg's defaults otherwise:
the course's 8 prompts x 6, 1-24 new tokens at T 0.8 / top-p 0.95, 2 passes of micro-batches of 8 x 6, LoRA r 16 /
alpha 32 / dropout 0.05 on the seven projections, KL 0.05. Each lever flips one setting from the default (`LEVERS`).
Every run is a fresh `llm-pg fit` process of `--iterations` iterations (the first is warm-up and dropped; the eval
at iteration 0 uses 8 prompts and falls outside the timed span), and a baseline run comes first, after every
`--every` levers and last, so the machine's drift shows in the baselines' spread. Each run's figure is the median
over its timed iterations of time/rollout, time/update and the whole iteration (`time/elapsed` differences); a lever's
ratio divides its iteration seconds by the median of all baseline runs. Figures, never assertions: other jobs on the
machine move them. docs/algorithms.md, "On the real model", holds a table from this script.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    f"--config={ROOT / 'configs/format_copy/grpo.yaml'}",
    "--model.init_args.model_name_or_path=smollm2-135m-instruct",
    "--trainer.accelerator=cpu",
    "--model.init_args.dtype=float32",
    "--model.init_args.gradient_checkpointing=false",
    "--model.init_args.warmup_steps=0",
    "--model.init_args.eval_every=100000",  # evaluates at 0 and the end only: outside the timed span
    "--data.task.init_args.eval_size=8",
    "--model.init_args.log_generations_every=0",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
]
THREADS = 2
M = "--model.init_args."
LEVERS: dict[str, list[str]] = {  # name -> the flags that flip the lever away from llm_pg's default
    "no_prefix_sharing": [f"{M}share_prompt_prefix=false"],  # training/log-prob forwards run each row's prompt
    "per_row_dropout": [f"{M}share_prompt_dropout=false"],  # the course's mask per row: every row's prompt runs
    "no_length_grouping": [f"{M}group_by_length=false"],  # only acts where prefix sharing does not
    "no_chunked_head": [f"{M}logprob_chunk_size=0"],  # one LM-head call over all positions
    "compiled_decoding": [f"{M}compile_generation=true"],
    "no_inplace_kv_cache": [],  # generate's own DynamicCache (llm_pg.models.decoding.reserved_cache patched out)
    "checkpointing": [f"{M}gradient_checkpointing=true"],  # the course's setting
    "threads1": ["--torch_threads=1"],
    "bf16_autocast": [f"{M}dtype=bfloat16"],  # opt-in: 8x slower matmuls on cores without avx512_bf16
    # opt-in, with .venv-vllm/bin/python: vLLM samples (LoRA served by vLLM, float32, eager, a 256 MiB KV cache)
    "vllm_engine": [
        f"{M}rollout_engine=vllm",
        f"{M}vllm_kv_cache_memory_bytes=268435456",
        f"{M}vllm_max_num_batched_tokens=8192",
    ],
}
OPT_IN = {"bf16_autocast", "vllm_engine"}  # run only when --only names them
PATCHES = {"no_inplace_kv_cache"}


def child(lever: str, iterations: int) -> None:
    """One fit in this process; prints the per-iteration figures as JSON."""
    if lever in PATCHES:
        import llm_pg.models.generation

        llm_pg.models.generation.reserved_cache = lambda model, cache, max_new_tokens: cache
    from llm_pg.cli.fit import run_cli

    flags = LEVERS.get(lever, [])
    threads = [] if any(f.startswith("--torch_threads") for f in flags) else [f"--torch_threads={THREADS}"]
    with tempfile.TemporaryDirectory() as runs:
        where = [f"--runs_root={runs}", "--run_name=lever"]
        run_cli(["fit", *BASE, f"--model.init_args.iterations={iterations}", *threads, *flags, *where])
        with open(Path(runs) / "lever" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("time/elapsed")]
    elapsed = [float(r["time/elapsed"]) for r in rows]
    print(
        json.dumps(
            {
                "iteration": [b - a for a, b in itertools.pairwise(elapsed)],  # from the second iteration on
                "rollout": [float(r["time/rollout"]) for r in rows[1:]],
                "update": [float(r["time/update"]) for r in rows[1:]],
            }
        )
    )


def one_run(lever: str, iterations: int) -> dict[str, float]:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    threads = "1" if lever == "threads1" else str(THREADS)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    command = [sys.executable, __file__, "--child", lever, "--iterations", str(iterations)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{lever} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {phase: statistics.median(values) for phase, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3, help="iterations per run; the first is warm-up")
    parser.add_argument("--only", default="", help="comma-separated levers (default: all)")
    parser.add_argument("--every", type=int, default=3, help="a baseline run after every N levers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.iterations)
        return
    levers = [name for name in args.only.split(",") if name] or [name for name in LEVERS if name not in OPT_IN]
    if unknown := sorted(set(levers) - set(LEVERS)):
        parser.error(f"--only: unknown levers {unknown}; known: {', '.join(LEVERS)}")
    if args.iterations < 2:
        parser.error(f"--iterations={args.iterations}: give at least 2 (one warm-up, one timed)")
    plan = ["baseline"]
    for i, lever in enumerate(levers, 1):
        plan.append(lever)
        if i % args.every == 0 or i == len(levers):
            plan.append("baseline")
    results: dict[str, list[dict[str, float]]] = {}
    for name in plan:
        try:
            figures = one_run(name, args.iterations)
        except RuntimeError as error:  # one lever failing leaves the others' figures
            print(f"{name:<20} FAILED: {str(error)[-600:]}", flush=True)
            continue
        results.setdefault(name, []).append(figures)
        shown = "  ".join(f"{phase} {value:6.2f} s" for phase, value in figures.items())
        print(f"{name:<20} {shown}", flush=True)
    base = statistics.median(f["iteration"] for f in results["baseline"])
    spread = [f["iteration"] for f in results["baseline"]]
    print(
        f"\nbaseline: {len(spread)} runs, iteration median {base:.2f} s (min {min(spread):.2f}, max {max(spread):.2f})"
    )
    print("| lever | rollout s | update s | iteration s | vs baseline |\n|---|---|---|---|---|")
    for name, runs in results.items():
        med = {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}
        print(
            f"| {name} | {med['rollout']:.1f} | {med['update']:.1f} | {med['iteration']:.1f} | "
            f"{med['iteration'] / base:.2f} |"
        )


if __name__ == "__main__":
    main()
