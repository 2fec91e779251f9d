"""Base-policy metrics of a chat model on the tiny tasks' eval sets, and the targets the tiny model must meet.

For each task: greedy `exact_match` (format_copy also split by the sign of the target), and from
`num_samples` completions per prompt at temperature 1 the mean reward, pass@1 and pass@8. With n samples
of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k) (the unbiased estimator of Chen et al., 2021),
averaged over prompts: the chance that k samples include a correct one. Drawing n = 16 > k = 8 samples
makes it far less noisy than the share of prompts that 8 samples solve (with 64 prompts that swings by
several points between seeds).

    python -m llm_pg.tiny.evaluate                      # the committed checkpoint
    python -m llm_pg.tiny.evaluate --model runs/tiny-pretrain/step-1200 --check

torch and transformers (through `llm_pg.models.generation` and `llm_pg.callbacks.sharded_eval`) are imported inside
the functions that sample, so `llm-pg eval-tiny --help` and the targets import at once.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llm_pg.assets import TINY_CHAT_DIR
from llm_pg.data.tasks import ArithTask, FormatCopyTask
from llm_pg.data.tasks.base import Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MAX_NEW_TOKENS = 24  # `<answer>-999</answer>` plus the end-of-turn token is 22 bytes
PASS_AT = (1, 8)  # the k of the reported pass@k

# metric -> (low, high), both inclusive; see issue 4.
TARGETS: dict[str, dict[str, tuple[float, float]]] = {
    "format_copy": {"greedy_exact_match": (0.35, 0.60), "pass@8": (0.90, 1.0)},
    "arith": {"greedy_exact_match": (0.35, 0.75), "pass@1": (0.0, 0.50), "pass@8": (0.70, 1.0)},
}


def tiny_tasks() -> dict[str, Task]:
    """The tiny variants of the tasks, as the tiny configs build them (no system prompt, short prompts)."""
    return {
        "format_copy": FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}"),
        "arith": ArithTask(),
    }


def evaluate_task(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    num_samples: int = 16,
    seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict[str, float]:
    """Greedy exact match, and T=1 sampled reward, pass@1 and pass@8 (of `num_samples` >= 8 per prompt)."""
    from llm_pg.callbacks.sharded_eval import pass_at_k
    from llm_pg.models.generation import Sampling, generate

    if num_samples < max(PASS_AT):
        raise ValueError(f"num_samples must be >= {max(PASS_AT)} for pass@{max(PASS_AT)}, got {num_samples}")
    examples = task.eval_examples
    conversations = [task.messages(e) for e in examples]
    greedy = generate(model, tokenizer, conversations, Sampling(greedy=True, max_new_tokens=max_new_tokens))
    greedy_scores = [task.score(text, e) for text, e in zip(greedy.texts, examples, strict=True)]
    greedy_metrics = task.eval_metrics(greedy.texts, examples, greedy_scores)
    metrics = {"greedy_" + name: value for name, value in greedy_metrics.items()}
    if task.name == "format_copy":  # the sign is where the tiny model's demonstrations fail
        for sign, negative in (("neg", True), ("pos", False)):
            part = [
                s.correct for s, e in zip(greedy_scores, examples, strict=True) if e.answer.startswith("-") == negative
            ]
            metrics[f"greedy_exact_match_{sign}"] = sum(part) / max(len(part), 1)
    sampled = generate(
        model,
        tokenizer,
        conversations,
        Sampling(temperature=1.0, max_new_tokens=max_new_tokens),
        num_samples=num_samples,
        seed=seed,
    )
    sample_examples = [e for e in examples for _ in range(num_samples)]  # group-contiguous, as generate returns
    scores = [task.score(text, e) for text, e in zip(sampled.texts, sample_examples, strict=True)]
    correct_per_prompt = [
        sum(s.correct for s in scores[start : start + num_samples]) for start in range(0, len(scores), num_samples)
    ]
    metrics["sampled_reward"] = sum(s.total for s in scores) / len(scores)
    for k in PASS_AT:
        metrics[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct_per_prompt) / len(examples)
    return metrics


def evaluate_base(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: dict[str, Task] | None = None,
    *,
    num_samples: int = 16,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """`evaluate_task` for each task (the tiny tasks by default), keyed by task name."""
    tasks = tiny_tasks() if tasks is None else tasks
    return {name: evaluate_task(model, tokenizer, t, num_samples=num_samples, seed=seed) for name, t in tasks.items()}


def target_failures(metrics: dict[str, dict[str, float]]) -> list[str]:
    """The targets in `TARGETS` that `metrics` misses, as readable lines (empty when all hold)."""
    failures = []
    for task_name, targets in TARGETS.items():
        for metric, (low, high) in targets.items():
            value = metrics.get(task_name, {}).get(metric, math.nan)
            if not low <= value <= high:  # False for NaN: a missing metric is a miss
                failures.append(f"{task_name} {metric} = {value:.3f}, target [{low}, {high}]")
    return failures


def format_table(metrics: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per task and metric, with the target range where there is one."""
    lines = ["| task | metric | value | target |", "|---|---|---|---|"]
    for task_name, values in metrics.items():
        for metric, value in values.items():
            low_high = TARGETS.get(task_name, {}).get(metric)
            target = f"{low_high[0]:.2f}-{low_high[1]:.2f}" if low_high else ""
            lines.append(f"| {task_name} | {metric} | {value:.3f} | {target} |")
    return "\n".join(lines)


def __getattr__(name: str):
    """`pass_at_k` is `llm_pg.callbacks.sharded_eval.pass_at_k`, imported on first use: that module loads torch and
    Lightning."""
    if name == "pass_at_k":
        from llm_pg.callbacks.sharded_eval import pass_at_k

        return pass_at_k
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg eval-tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=TINY_CHAT_DIR, help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=16, help="samples per prompt at T=1 (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"llm-pg eval-tiny: error: --model {args.model}: no checkpoint here (no config.json)", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_pg.cli.console import silence_known_noise

    silence_known_noise()  # transformers' weight-loading bar
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    metrics = evaluate_base(model, tokenizer, num_samples=args.samples, seed=args.seed)
    print(format_table(metrics))
    failures = target_failures(metrics)
    for line in failures:
        print("missed:", line)
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
