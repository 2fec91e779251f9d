"""Which problem set can a CPU rehearse the course's math run on? Base figures of each candidate on a real model.

    make qwen-model && .venv/bin/python benchmarks/math_candidates.py [--model qwen2.5-coder-0.5b-instruct]
        [--eval-size 64] [--max-new-tokens 96] [--only arith,chain_sum] [--dtype float32]

Each candidate is a task under the course's math_hard system prompt, user turn (`... Return only: \\boxed{NUMBER}`)
and reward (`llm_pg.data.tasks.math_hard.score`); its eval set (64 items by default, the task's own fixed seed) is
greedy-decoded by the base model within `--max-new-tokens`, as `llm-pg validate` does, and scored with the task's
eval metrics: `exact_match` (the last `\\boxed{}` is right), `exact_match_relaxed` (the box, or else the last number,
is right: what the model knows before it learns the format), `has_boxed`, and the mean completion length. A
rehearsal has room to learn where exact match starts low and relaxed accuracy well above it (the format to learn,
the answers within reach), and where completions fit the budget. Figures only, no assertion.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llm_pg.data.tasks import ArithTask, BoxedReasoningGymTask
from llm_pg.data.tasks.base import Task
from llm_pg.data.tasks.math_hard import PROMPT_TEMPLATE, SYSTEM_PROMPT
from llm_pg.models.generation import Sampling, generate
from llm_pg.models.loading import load_tokenizer, resolve_model_path

SMALL_NUMBERS = {"min_digits": 1, "max_digits": 2}
LATEX = "Compute ${expr}$.\n\nReturn only: \\boxed{NUMBER}"  # the expression in MATH's notation
COT = "{expr}\nPlease reason step by step, and put your final answer within \\boxed{}."


def candidates(eval_size: int) -> dict[str, Task]:
    """The problem sets measured (each with the course's system prompt and user turn)."""
    arith = {"system_prompt": SYSTEM_PROMPT, "prompt_template": PROMPT_TEMPLATE.replace("{problem}", "{expr}")}
    arith["eval_size"] = eval_size
    return {
        "arith": ArithTask(**arith),  # configs/real_cpu/arith_grpo.yaml's: a+b, a-b in 0..20, a*b in 0..9
        "arith_latex": ArithTask(**{**arith, "prompt_template": LATEX}),  # configs/qwen_cpu/'s: as MATH writes it
        "arith_cot": ArithTask(**{**arith, "prompt_template": COT}),  # Qwen2.5-Math's own request for a box
        "arith_3": ArithTask(**arith, add_range=(0, 99), mul_range=(0, 12), three_operand=True),
        "basic_arithmetic_2": BoxedReasoningGymTask(
            "basic_arithmetic", {"min_terms": 2, "max_terms": 3, **SMALL_NUMBERS}, eval_size=eval_size, eval_seed=7
        ),
        "chain_sum_3": BoxedReasoningGymTask(
            "chain_sum", {"min_terms": 3, "max_terms": 4, **SMALL_NUMBERS}, eval_size=eval_size, eval_seed=7
        ),
        "gsm_symbolic": BoxedReasoningGymTask("gsm_symbolic", eval_size=eval_size, eval_seed=7),
    }


def measure(model, tokenizer, task: Task, max_new_tokens: int, batch: int, samples: int) -> dict[str, float]:
    """Greedy (`samples` 0) or `samples` completions per item at the rollout's settings (T 0.8, top-p 0.95, at
    least 8 new tokens: what GRPO's groups see)."""
    task.bind_seed(0)
    examples = task.eval_examples
    sampling = Sampling(max_new_tokens=max_new_tokens, greedy=True)
    if samples:
        sampling = Sampling(max_new_tokens=max_new_tokens, min_new_tokens=8, temperature=0.8, top_p=0.95)
        examples = examples[:batch]  # one batch of prompts
    texts, scored, lengths = [], [], []
    start, n = time.perf_counter(), max(samples, 1)
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        out = generate(model, tokenizer, [task.messages(e) for e in chunk], sampling, num_samples=n, seed=0)
        texts += out.texts
        scored += [e for e in chunk for _ in range(n)]  # each item's n completions, in generate's order
        lengths += (out.completion_ids != tokenizer.pad_token_id).sum(1).tolist()
    metrics = task.eval_metrics(texts, scored)
    metrics["tokens"] = statistics.mean(lengths)
    metrics["full"] = sum(n >= max_new_tokens for n in lengths) / len(lengths)  # hit the budget
    metrics["seconds"] = time.perf_counter() - start
    metrics["sample"] = texts[0]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--only", help="comma-separated candidate names")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=0, help="0: greedy; N: N samples of each of --batch items")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = load_tokenizer(path)
    chosen = candidates(args.eval_size)
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    how = f"greedy, {args.eval_size} items"
    if args.samples:
        how = f"{args.samples} samples of {args.batch} items at T 0.8"
    print(f"{args.model}, {how}, <= {args.max_new_tokens} new tokens, {args.dtype}")
    print(f"{'candidate':<20}{'EM':>6}{'relaxed':>9}{'boxed':>7}{'tokens':>8}{'full':>6}{'s':>7}")
    for name, task in chosen.items():
        m = measure(model, tokenizer, task, args.max_new_tokens, args.batch, args.samples)
        print(
            f"{name:<20}{m['exact_match']:>6.2f}{m['exact_match_relaxed']:>9.2f}{m['has_boxed']:>7.2f}"
            f"{m['tokens']:>8.1f}{m['full']:>6.2f}{m['seconds']:>7.0f}   e.g. {m['sample'][:70]!r}",
            flush=True,
        )


if __name__ == "__main__":
    main()
