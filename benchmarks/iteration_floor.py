"""An iteration of a real-model rehearsal against what the machine's matmuls allow: seconds per phase, the update's
useful FLOP rate and its share of the bf16 (or float32) matmul rate at the update's own shapes, tokens processed
against tokens needed, and peak memory.

    make qwen-model && .venv/bin/python benchmarks/iteration_floor.py --model qwen [--iterations 3] [-- OVERRIDES]
    make real-model && .venv/bin/python benchmarks/iteration_floor.py --model real

`--model qwen` is the CPU math rehearsal (configs/qwen_cpu/math_grpo.yaml: Qwen2.5-Coder-0.5B-Instruct, 8 prompts x
8, 8-96 new tokens, 2 passes of 16 x 4, LoRA r16 / dropout 0, `dtype: auto`); `--model real` the SmolLM2 format_copy
rehearsal (configs/real_cpu/format_copy_grpo.yaml). Overrides after `--` go to `llm-pg fit` as they are (for
example `--model.init_args.speed.pack_sequences=false`). One `llm-pg fit` of `--iterations` iterations runs in this
process (the first iteration is warm-up and dropped; the eval uses 8 prompts and runs only at iteration 0, outside the
timed span; W&B off); then, in the same process and threads, the matmuls of the update's layers are timed at its
shapes: each projection `[M, in] x [in, out]` of the decoder (q, k, v, o, gate, up, down) and the head `[M, H] x
[H, V]`, with M the tokens of a training forward (their mean weighted by tokens: where the update's FLOPs are spent),
in the run's compute dtype, 10 repetitions after one warm-up;
`matmul_gflop_s` is their total FLOPs over their total time (best repetition each).

- `update_gflop_s`: useful matmul FLOPs of the update (`real_levers.update_flops`: passes x 4 x the parameters the
  matmuls use x (each prompt once per group + every completion token)) over `time/update`;
- `update_share_of_matmul` = update_gflop_s / matmul_gflop_s;
- `processed_over_real`: token positions the decoder ran in the update's forwards (a pre-hook on the decoder)
  over the tokens they needed (each distinct prompt's positions once per forward, and every real completion token);
- `peak_rss_gb`: the process's peak resident set (`ru_maxrss`), model loading included.

Prints iteration 1's rollout and update (its rollout is the same on every side of a comparison: nothing is trained
yet), a line per timed iteration and, last, one JSON line with `iteration_s`, `rollout_s`, `update_s` (medians over
the timed iterations), `update_gflop_s`, `matmul_gflop_s`, `update_share_of_matmul`, `processed_over_real`,
`peak_rss_gb`, the dtype and whether the CPU has avx512_bf16. Figures, never assertions: other jobs on the machine
move them, so run it alone.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_levers import update_flops

CONFIGS = {"qwen": "configs/qwen_cpu/math_grpo.yaml", "real": "configs/real_cpu/format_copy_grpo.yaml"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TokenCounter:
    """Token positions the policy's decoder ran in the update's training forwards, against the positions needed."""

    def __init__(self) -> None:
        self.processed: list[int] = []  # per decoder call with a graph
        self.needed: list[int] = []  # per log-prob call with a graph
        self.hooked = False

    def hook(self, policy: torch.nn.Module) -> None:
        from llm_pg.modules.logprobs import _decoder_and_head

        if not self.hooked:
            decoder = _decoder_and_head(policy)[0]
            decoder.register_forward_pre_hook(self._count, with_kwargs=True)
            self.hooked = True

    def _count(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled() and module.training:
            self.processed.append(int(kwargs["input_ids"].numel()))

    def record(self, rollout) -> None:
        from llm_pg.modules.logprobs import distinct_prompts

        prompt = rollout.prompt_len
        unique = len(distinct_prompts(rollout)[0])
        self.needed.append(unique * prompt + int(rollout.attention_mask[:, prompt:].sum()))


def instrument(counter: TokenCounter) -> None:
    """Count tokens in every training forward of the update (`run_update`'s log-prob calls with a graph)."""
    import llm_pg.modules.base as base
    from llm_pg.modules.logprobs import LogProbs

    run_update, call = base.run_update, LogProbs.__call__

    def counted_update(context, rollout, optimizer, shuffle):
        counter.hook(context.policy)
        return run_update(context, rollout, optimizer, shuffle)

    def counted_call(self, model, rollout, *args, **kwargs):
        if torch.is_grad_enabled() and model.training:
            counter.record(rollout)
        return call(self, model, rollout, *args, **kwargs)

    base.run_update = counted_update
    LogProbs.__call__ = counted_call


def matmul_rate(model_dir: str, rows: int, dtype: torch.dtype, reps: int = 10) -> float:
    """GFLOP/s of the update's matmuls at `rows` tokens: every projection of one decoder layer and the head, in
    `dtype`, best of `reps` each; total FLOPs over total time."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter)]
    shapes += [(inter, hidden), (hidden, config.vocab_size)]
    flops = seconds = 0.0
    for inner, outer in shapes:
        a = torch.randn(rows, inner, dtype=dtype)
        b = torch.randn(inner, outer, dtype=dtype)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        flops += 2 * rows * inner * outer
        seconds += best
    return flops / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(CONFIGS), default="qwen")
    parser.add_argument("--iterations", type=int, default=3, help="iterations of the fit; the first is warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="after --: flags for llm-pg fit")
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error(f"--iterations={args.iterations}: give at least 2 (one warm-up, one timed)")
    from llm_pg.cli.fit import run_cli
    from llm_pg.models.loading import auto_dtype, cpu_flags, resolve_model_path

    counter = TokenCounter()
    instrument(counter)
    with tempfile.TemporaryDirectory() as runs:
        run_cli(
            [
                "fit",
                f"--config={CONFIGS[args.model]}",
                f"--model.init_args.iterations={args.iterations}",
                f"--torch_threads={args.threads}",
                "--model.init_args.evaluation.every=1000",
                "--data.task.init_args.eval_size=8",
                f"--runs_root={runs}",
                "--run_name=floor",
                "--trainer.enable_progress_bar=false",
                *args.overrides,
            ]
        )
        run_dir = Path(runs) / "floor"
        with open(run_dir / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("time/elapsed")]
        config_text = (run_dir / "config.yaml").read_text()
        timed = rows[1:]
        flops = [update_flops(run_dir, float(r["train/completion_len"])) for r in timed]
    elapsed = [float(r["time/elapsed"]) for r in rows]
    iteration = [b - a for a, b in itertools.pairwise(elapsed)]
    update = [float(r["time/update"]) for r in timed]
    rollout = [float(r["time/rollout"]) for r in timed]
    update_rate = statistics.median(f / s / 1e9 for f, s in zip(flops, update, strict=True))
    first = rows[0]  # the same rollout on every side of a comparison (nothing trained yet), model warm-up included
    warm = float(first["time/rollout"]), float(first["time/update"])
    print(f"iteration 1 (warm-up): rollout {warm[0]:.1f} s, update {warm[1]:.1f} s")
    for number, (it, ro, up, row) in enumerate(zip(iteration, rollout, update, timed, strict=True), 2):
        length, longest = float(row["train/completion_len"]), float(row["train/completion_len_max"])
        print(f"iteration {number}: {it:.1f} s (rollout {ro:.1f}, update {up:.1f}; completions {length:.1f} tokens, "
              f"the longest {longest:.0f})")  # fmt: skip
    import yaml

    dtype_name = yaml.safe_load(config_text)["model"]["init_args"]["dtype"]
    model_dir = str(resolve_model_path(yaml.safe_load(config_text)["model"]["init_args"]["model_name_or_path"]))
    dtype = auto_dtype("cpu")[0] if dtype_name == "auto" else getattr(torch, dtype_name or "float32")
    # the tokens of a training forward, weighted by tokens: the size at which the update's FLOPs are spent
    forward_tokens = int(sum(n * n for n in counter.processed) / max(sum(counter.processed), 1)) or 512
    matmul = matmul_rate(model_dir, forward_tokens, dtype)
    flags = cpu_flags()
    figures = {
        "model": args.model,
        "iteration_s": statistics.median(iteration),
        "rollout_s": statistics.median(rollout),
        "update_s": statistics.median(update),
        "update_gflop_s": update_rate,
        "matmul_gflop_s": matmul,
        "update_share_of_matmul": update_rate / matmul,
        "processed_over_real": sum(counter.processed) / max(sum(counter.needed), 1),
        "forward_tokens": forward_tokens,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "dtype": str(dtype).removeprefix("torch."),
        "avx512_bf16": "avx512_bf16" in flags,
        "overrides": args.overrides,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
