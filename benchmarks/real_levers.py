"""Each speed lever alone on the real model: seconds per format_copy GRPO iteration at the course's settings.

    make real-model && .venv/bin/python benchmarks/real_levers.py [--iterations 3] [--only a,b] [--every 3]
    .venv-vllm/bin/python benchmarks/real_levers.py --only vllm_engine --iterations 2     # vLLM against HF generate
    make qwen-model && .venv/bin/python benchmarks/real_levers.py --model qwen [--iterations 3] [--only a,b]

`--model qwen` takes as baseline the CPU math rehearsal on Qwen2.5-Coder-0.5B-Instruct (configs/qwen_cpu/math_grpo.yaml:
8 prompts x 8, 8-96 new tokens, 2 passes of 16 x 4, LoRA r 16 / dropout 0, `dtype: auto`, checkpointing off) with
an eval set of 8; its `bf16_autocast` lever is replaced by `float32` (the rehearsal is bf16 where the CPU has
avx512_bf16 or amx_bf16). Each row also gives the update's achieved rate of useful matmul FLOPs (`update_flops`):
per pass, 4 x the parameters the matmuls use (forward 2, backward 2: the base is frozen, so the backward computes
input gradients; LoRA's own are negligible), plus 2 with gradient checkpointing, times the tokens that must be
scored: each prompt once per group (as prefix sharing runs it) and every completion token.

The default baseline is `bench_vs_trl.py --model real`'s llm_pg side: configs/format_copy/grpo.yaml with
SmolLM2-135M-Instruct on the CPU (two torch threads, float32, gradient checkpointing off, constant lr) and llm_pg's
defaults otherwise: the course's 8 prompts x 6, 1-24 new tokens at T 0.8 / top-p 0.95, 2 passes of micro-batches of
8 x 6, LoRA r 16 / alpha 32 / dropout 0.05 on the seven projections, KL 0.05. Each lever flips one setting from the
default (`LEVERS`). Every run is a fresh `llm-pg fit` process of `--iterations` iterations (the first is warm-up and
dropped; the eval at iteration 0 uses 8 prompts and falls outside the timed span), and a baseline run comes first,
after every `--every` levers and last, so the machine's drift shows in the baselines' spread. Each run's figure is
the median over its timed iterations of time/rollout, time/update and the whole iteration (`time/elapsed`
differences); a lever's ratio divides its iteration seconds by the median of all baseline runs. Figures, never
assertions: other jobs on the machine move them. docs/algorithms.md, "On the real model", holds a table from this
script.
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
REAL = [
    f"--config={ROOT / 'configs/format_copy/grpo.yaml'}",
    "--model.init_args.model_name_or_path=smollm2-135m-instruct",
    "--trainer.accelerator=cpu",
    "--model.init_args.dtype=float32",
    "--model.init_args.speed.gradient_checkpointing=false",
    "--model.init_args.warmup_steps=0",
    "--model.init_args.evaluation.every=100000",  # evaluates at 0 and the end only: outside the timed span
    "--data.task.init_args.eval_size=8",
    "--model.init_args.log_generations.every=0",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
]
QWEN = [
    f"--config={ROOT / 'configs/qwen_cpu/math_grpo.yaml'}",  # its model, dtype auto, LoRA, rows and sampling
    "--model.init_args.speed.gradient_checkpointing=false",
    "--checkpoint.every_n_iterations=1000",
    "--model.init_args.evaluation.every=100000",
    "--data.task.init_args.eval_size=8",
    "--model.init_args.log_generations.every=0",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
]
BASES = {"real": REAL, "qwen": QWEN}
THREADS = 2
M = "--model.init_args."
LEVERS: dict[str, list[str]] = {  # name -> the flags that flip the lever away from llm_pg's default
    "no_prefix_sharing": [f"{M}speed.share_prompt_prefix=false"],  # training/log-prob forwards run each row's prompt
    "per_row_dropout": [f"{M}speed.share_prompt_dropout=false"],  # the course's mask per row: every row's prompt runs
    "no_length_grouping": [f"{M}speed.group_by_length=false"],  # only acts where prefix sharing does not
    "no_chunked_head": [f"{M}speed.logprob_chunk_size=0"],  # one LM-head call over all positions
    "compiled_decoding": [f"{M}speed.compile_generation=true"],
    "no_inplace_kv_cache": [],  # generate's own DynamicCache (llm_pg.models.decoding.reserved_cache patched out)
    "checkpointing": [f"{M}speed.gradient_checkpointing=true"],  # the course's setting
    "threads1": ["--torch_threads=1"],
    "bf16_autocast": [f"{M}dtype=bfloat16"],  # opt-in: 8x slower matmuls on cores without avx512_bf16
    "float32": [f"{M}dtype=float32"],  # --model qwen's: its baseline is bf16 where the CPU has bf16 matmuls
    # opt-in, with .venv-vllm/bin/python: vLLM samples (LoRA served by vLLM, float32, eager, a 256 MiB KV cache)
    "vllm_engine": [
        f"{M}rollout_engine=vllm",
        f"{M}vllm.kv_cache_memory_bytes=268435456",
        f"{M}vllm.max_num_batched_tokens=8192",
    ],
}
OPT_IN = {"bf16_autocast", "vllm_engine", "float32"}  # run only when --only names them (float32: --model qwen's)
DEFAULT_OPT_IN = {"real": set(), "qwen": {"float32"}}  # opt-in levers that a model's full table includes
PATCHES = {"no_inplace_kv_cache"}


def matmul_parameters(model_dir: str) -> int:
    """The parameters the forward multiplies by: all but the input embedding (a lookup), plus the head when it is
    tied to the embedding (then it is a matmul the parameter count holds once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - embedding + (embedding if tied else 0)


def update_flops(run_dir: Path, completion_len: float) -> float:
    """Useful matmul FLOPs of one iteration's update (module docstring), from the run's own `config.yaml`: passes x
    (4, or 6 with checkpointing) x matmul parameters x (prompt tokens once per group + completion tokens)."""
    import importlib

    import yaml

    from llm_pg.models.generation import encode_prompts
    from llm_pg.models.loading import load_tokenizer, resolve_model_path

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model, data = config["model"], config["data"]
    args = model["init_args"]
    module, name = data["task"]["class_path"].rsplit(".", 1)
    task = getattr(importlib.import_module(module), name)(**data["task"].get("init_args", {}))
    path = resolve_model_path(args["model_name_or_path"])
    conversation = task.messages(task.train_example(0, 0))
    prompt = int(encode_prompts(load_tokenizer(path), [conversation])["attention_mask"].sum())  # as the rollout encodes
    groups, group = data["prompts_per_step"], args["group_size"]
    passes = 1 if model["class_path"].endswith("ReinforceModule") else args["ppo_epochs"]
    per_token = 6 if args["speed"]["gradient_checkpointing"] else 4
    return passes * per_token * matmul_parameters(path) * (groups * prompt + groups * group * completion_len)


def child(lever: str, iterations: int, model: str) -> None:
    """One fit in this process; prints the per-iteration figures as JSON."""
    if lever in PATCHES:
        import llm_pg.models.generation

        llm_pg.models.generation.reserved_cache = lambda model, cache, max_new_tokens: cache
    from llm_pg.cli.fit import run_cli

    flags = LEVERS.get(lever, [])
    threads = [] if any(f.startswith("--torch_threads") for f in flags) else [f"--torch_threads={THREADS}"]
    with tempfile.TemporaryDirectory() as runs:
        where = [f"--runs_root={runs}", "--run_name=lever"]
        run_cli(["fit", *BASES[model], f"--model.init_args.iterations={iterations}", *threads, *flags, *where])
        with open(Path(runs) / "lever" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("time/elapsed")]
        timed = rows[1:]
        flops = update_flops(Path(runs) / "lever", statistics.mean(float(r["train/completion_len"]) for r in timed))
    elapsed = [float(r["time/elapsed"]) for r in rows]
    update = [float(r["time/update"]) for r in timed]
    print(
        json.dumps(
            {
                "iteration": [b - a for a, b in itertools.pairwise(elapsed)],  # from the second iteration on
                "rollout": [float(r["time/rollout"]) for r in timed],
                "update": update,
                "update_gflop_s": [flops / seconds / 1e9 for seconds in update],
            }
        )
    )


def one_run(lever: str, iterations: int, model: str) -> dict[str, float]:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    threads = "1" if lever == "threads1" else str(THREADS)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    command = [sys.executable, __file__, "--child", lever, "--iterations", str(iterations), "--model", model]
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
    parser.add_argument(
        "--model", choices=list(BASES), default="real", help="real: SmolLM2 format_copy; qwen: the math rehearsal"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.iterations, args.model)
        return
    default = [name for name in LEVERS if name not in OPT_IN or name in DEFAULT_OPT_IN[args.model]]
    levers = [name for name in args.only.split(",") if name] or default
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
            figures = one_run(name, args.iterations, args.model)
        except RuntimeError as error:  # one lever failing leaves the others' figures
            print(f"{name:<20} FAILED: {str(error)[-600:]}", flush=True)
            continue
        results.setdefault(name, []).append(figures)
        shown = "  ".join(
            f"{phase} {value:6.1f}" if phase.endswith("_s") else f"{phase} {value:6.2f} s"
            for phase, value in figures.items()
        )
        print(f"{name:<20} {shown}", flush=True)
    base = statistics.median(f["iteration"] for f in results["baseline"])
    spread = [f["iteration"] for f in results["baseline"]]
    print(
        f"\nbaseline: {len(spread)} runs, iteration median {base:.2f} s (min {min(spread):.2f}, max {max(spread):.2f})"
    )
    print("| lever | rollout s | update s | update GFLOP/s | iteration s | vs baseline |\n|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}
        print(
            f"| {name} | {med['rollout']:.1f} | {med['update']:.1f} | {med['update_gflop_s']:.0f} | "
            f"{med['iteration']:.1f} | {med['iteration'] / base:.2f} |"
        )


if __name__ == "__main__":
    main()
