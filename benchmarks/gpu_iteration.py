"""Seconds per phase of math_hard-shaped GRPO iterations on a randomly initialised Qwen2.5-Math-1.5B, one engine.

    python benchmarks/gpu_iteration.py --engine hf   --json hf.json     # one GPU (benchmarks/gpu_check.sh runs both)
    python benchmarks/gpu_iteration.py --engine vllm --json vllm.json   # needs vLLM
    python benchmarks/gpu_iteration.py --smoke --engine hf              # CPU check of the script: 2 small layers

No download: the model is built from Qwen2.5-Math-1.5B's config (below) with random weights and the tiny byte
tokenizer (ids 0-259 of its 151,936-word vocabulary), saved to `--model-dir` (reused when it already holds one).
What runs is the trainer itself: `llm-pg fit --config configs/math_hard/grpo.yaml` (its LoRA, batch sizes,
`speed.logprob_batch_size` 32, bf16 autocast, prefix sharing where the run has it, gradient checkpointing, KL) through
Lightning, with only these overrides: the random model, a stand-in task (`LongPromptTask`: ~300-token prompts, a
reward with spread), completions forced to 512 tokens (`min_new_tokens`), `--iterations` iterations, an eval set of
`--eval-size` prompts at the start and the end, and the engine. With `--engine vllm` the run also takes the fast
variant's keys (`configs/math_hard/grpo_vllm.yaml`: memory share 0.3, TIS, one-call evaluation).

Read back from the run's metrics.csv: `time/rollout` (sampling and the no-grad log-prob passes), `time/update`,
`time/eval`, `time/tokens_per_s`; decode ms per token = sampling seconds / longest completion. Printed as the last
line, JSON: those per phase (means over the iterations after the first), peak GPU memory, the start-up seconds,
and the projected hours of the four course runs with this engine (`project_hours`). A figure, never an assertion.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llm_pg.data.tasks.base import Example, Score, Task

ROOT = Path(__file__).resolve().parents[1]
# Qwen/Qwen2.5-Math-1.5B config.json (Qwen2ForCausalLM; the Instruct model has the same architecture).
QWEN_MATH_15B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
SMOKE = {**QWEN_MATH_15B, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2}
SMOKE.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)  # head dim 32 (vLLM's CPU minimum)
STEM = "Let $f(x) = ax^3 + bx^2 + cx + d$ with real coefficients satisfy $f(1) = 2$, $f(2) = 11$, and "
# The four course runs: iterations, evaluations (at 0, every evaluation.every, at the end), eval prompts, new tokens.
RUNS = {
    "math_hard_grpo": (501, 7, 512, 512),
    "math_hard_reinforce": (201, 4, 512, 512),
    "format_copy_grpo": (51, 3, 64, 24),
    "format_copy_reinforce": (51, 3, 64, 24),
}


class LongPromptTask(Task):
    """Prompts of about `prompt_chars` byte tokens, like a level-5 MATH problem; reward: the share of digits in the
    completion (spread over a group, so advantages and gradients are non-zero)."""

    name = "long_prompt"
    components = ("digits",)

    def __init__(self, prompt_chars: int = 250, eval_size: int = 8) -> None:
        super().__init__(system_prompt=None, eval_size=eval_size)
        self.prompt_chars = prompt_chars

    def _prompt(self, key: str) -> str:
        body = (STEM * (self.prompt_chars // len(STEM) + 1))[: self.prompt_chars]
        return f"Problem {key}: {body} Put the final answer in \\boxed{{}}."

    def train_example(self, index: int, seed: int) -> Example:
        return Example(prompt=self._prompt(f"{seed}:{index}"), answer="")

    def build_eval_set(self) -> list[Example]:
        return [Example(prompt=self._prompt(f"eval {i}"), answer="") for i in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        share = sum(c.isdigit() for c in completion) / max(len(completion), 1)
        return Score(total=share, correct=share > 0.5, components={"digits": share})


def save_random_model(config: dict, dtype: torch.dtype, out: Path) -> None:
    """Qwen2 with `config` and random weights (built on the GPU when there is one: faster), and the byte tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llm_pg.tiny.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(model_max_length=config["max_position_embeddings"])
    model_config = Qwen2Config(
        **config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(model_config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fit_args(args, model_dir: Path, runs_root: Path) -> list[str]:
    """`llm-pg fit` on the math_hard GRPO config, changed only where a random model and a timing run need it."""
    tokens = 16 if args.smoke else 512
    init = "--model.init_args."
    out = [
        "fit",
        f"--config={ROOT / 'configs/math_hard/grpo.yaml'}",
        f"{init}model_name_or_path={model_dir}",
        "--data.task=gpu_iteration.LongPromptTask",
        f"--data.task.init_args.prompt_chars={40 if args.smoke else 250}",
        f"--data.task.init_args.eval_size={args.eval_size}",
        f"{init}iterations={args.iterations}",
        f"{init}evaluation.every={args.iterations + 1}",  # evaluations at the start and the end only
        f"{init}min_new_tokens={tokens}",
        f"{init}max_new_tokens={tokens}",
        f"{init}log_generations.every=0",
        f"{init}rollout_engine={args.engine}",
        f"--checkpoint.every_n_iterations={args.iterations + 1}",
        f"--runs_root={runs_root}",
        "--run_name=bench",
        "--wandb_project=null",
        "--trainer.enable_progress_bar=false",
        f"--trainer.accelerator={'cpu' if args.smoke else 'gpu'}",
    ]
    if args.engine == "vllm":  # the fast variant's keys (configs/math_hard/grpo_vllm.yaml)
        out += [f"{init}vllm.gpu_memory_utilization=0.3"]
        out += [f"{init}correction.mode=token_truncate", f"{init}correction.max=2.0"]  # TIS, cap 2
        if args.smoke:  # vLLM's CPU build: a small fixed KV cache, a whole rollout's prefill in one step
            out += [f"{init}vllm.kv_cache_memory_bytes={256 * 2**20}", f"{init}vllm.max_num_batched_tokens=16384"]
    if args.smoke:
        out += [f"{init}dtype=float32"]
    return out


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def summarise(rows: list[dict[str, float]], wall_s: float, iterations: int) -> dict[str, float]:
    """Per-phase means over the iterations after the first (which warms up), and the derived rates."""
    train = [r for r in rows if "time/update" in r]
    timed = train[1:] if len(train) > 1 else train
    mean = lambda key: statistics.mean(r[key] for r in timed)  # noqa: E731
    tokens = mean("train/completion_len") * 64  # 8 prompts x 8 completions, every one forced to full length
    sampling_s = tokens / mean("time/tokens_per_s")
    evals = [r["time/eval"] for r in rows if "time/eval" in r]
    out = {
        "rollout_s": mean("time/rollout"),
        "sampling_s": sampling_s,
        "update_s": mean("time/update"),
        "eval_s": evals[-1] if evals else float("nan"),  # the last: the first also starts the engine (vLLM)
        "decode_ms_per_token": 1000 * sampling_s / mean("train/completion_len_max"),
        "tokens_per_s": mean("time/tokens_per_s"),
    }
    spent = sum(r["time/rollout"] + r["time/update"] for r in train) + out["eval_s"] * len(evals)
    out["startup_s"] = max(wall_s - spent, 0.0)  # model load, engine start (vLLM: compile), Lightning set-up
    return out


def project_hours(phases: dict[str, float], engine: str, eval_size: int) -> dict[str, float]:
    """Hours of each course run from the measured math_hard GRPO phases (estimates, scaled as stated):
    rollout sampling scales with new tokens; the no-grad passes and the update with tokens per row (prompt ~300 +
    new); REINFORCE makes 1 update pass of GRPO's 2; HF evaluates 32 prompts per call, vLLM all in one (scaled
    linearly in prompts: an upper bound)."""
    passes_s = phases["rollout_s"] - phases["sampling_s"]  # pi_old and pi_ref passes
    hours = {}
    for run, (iterations, evals, eval_prompts, new_tokens) in RUNS.items():
        length = new_tokens / 512
        row_tokens = (300 + new_tokens) / (300 + 512)
        update = phases["update_s"] * row_tokens * (0.5 if "reinforce" in run else 1.0)
        per_iteration = phases["sampling_s"] * length + passes_s * row_tokens + update
        calls = math.ceil(eval_prompts / 32) / math.ceil(eval_size / 32) if engine == "hf" else eval_prompts / eval_size
        evaluation = evals * phases["eval_s"] * calls * length
        hours[run] = round((iterations * per_iteration + evaluation + phases["startup_s"]) / 3600, 2)
    return hours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--smoke", action="store_true", help="CPU check: 2 small layers, 16 tokens, float32")
    parser.add_argument("--iterations", type=int, default=3, help="the first warms up and is not averaged")
    parser.add_argument("--eval-size", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, help="where the random model is (or is saved); default: a temp dir")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no GPU here: run with --smoke for the CPU check")
    from llm_pg.cli.fit import run_cli

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch) / "model"
        start = time.perf_counter()
        if not (model_dir / "config.json").exists():
            save_random_model(SMOKE if args.smoke else QWEN_MATH_15B, torch.bfloat16, model_dir)
        print(f"random model in {model_dir} ({time.perf_counter() - start:.1f} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run_cli(fit_args(args, model_dir, Path(scratch) / "runs"))
        wall = time.perf_counter() - start
        phases = summarise(read_metrics(Path(scratch) / "runs" / "bench"), wall, args.iterations)
    result = {"engine": args.engine, "smoke": args.smoke, **{k: round(v, 4) for k, v in phases.items()}}
    if torch.cuda.is_available() and not args.smoke:
        free, total = torch.cuda.mem_get_info()
        result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)  # torch's allocator, vLLM's too
        result["gpu_in_use_gib"] = round((total - free) / 2**30, 2)
        result["gpu"] = torch.cuda.get_device_name()
    result["projected_hours"] = project_hours(phases, args.engine, args.eval_size)
    if args.json:
        args.json.write_text(json.dumps(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
