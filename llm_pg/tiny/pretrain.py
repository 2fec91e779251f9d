"""Pretrain the tiny chat model from scratch on noisy demonstrations of the tiny tasks.

Each step draws `batch_size` fresh examples, two thirds arith and one third format_copy (copying is learnt
far sooner than arithmetic), each from `task.train_example(index, seed)`; it renders the prompt with the
task's own messages and the tokenizer's chat template, and appends a noisy
demonstration (`llm_pg.tiny.demonstrations`) plus `<|im_end|>`. The loss is the mean cross-entropy over
completion tokens only, so the model learns to answer, not to write prompts. AdamW, linear warmup, then
cosine decay to a tenth of the peak rate.

Greedy scores swing between checkpoints, so every `eval_every` steps the model is scored on the tasks' eval
sets (`llm_pg.tiny.evaluate`); checkpoints that meet the base-policy targets are saved as candidates, and
the latest of them is copied to `--out`. The committed checkpoint was made with

    python -m llm_pg.tiny.pretrain --out llm_pg/assets/tiny-chat --threads 1

(one thread, because other jobs shared the two cores: 26 minutes; a rerun gave identical weights). With the
default two threads it took 18.4 minutes on a partly shared 2-core machine (about 0.32 s a step when idle)
and also met the targets, with slightly different weights.

torch and transformers are imported inside the functions that use them, so `llm-pg pretrain-tiny --help` answers
at once.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from llm_pg.data.tasks.base import Task
from llm_pg.tiny.demonstrations import demonstration, demonstration_rng
from llm_pg.tiny.evaluate import evaluate_base, format_table, target_failures, tiny_tasks
from llm_pg.tiny.tokenizer import ENDOFTEXT, IM_END, build_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label of prompt and padding positions: no loss there


def tiny_config(
    tokenizer: PreTrainedTokenizerBase, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4
) -> LlamaConfig:
    """A small Llama over the byte vocabulary; the MLP is ~2.75x wide, as in Llama; embeddings are tied."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=int(2.75 * hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,  # RoPE has no parameters; room for prompts plus completions
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_batch(
    tokenizer: PreTrainedTokenizerBase, task: Task, start: int, count: int, seed: int
) -> dict[str, torch.Tensor]:
    """`input_ids` and `labels` `[count, L]` for training examples `start .. start+count-1` of `task`.

    Each row is prompt + demonstration + `<|im_end|>`, right-padded; labels are IGNORE_INDEX on prompt and
    padding tokens. No attention mask is needed: with right padding and causal attention no real token
    attends to a pad.
    """
    import torch

    prompts, completions = [], []
    for index in range(start, start + count):
        example = task.train_example(index, seed)
        prompts.append(
            tokenizer.apply_chat_template(task.messages(example), tokenize=False, add_generation_prompt=True)
        )
        completions.append(demonstration(task.name, example, demonstration_rng(seed, task.name, index)) + IM_END)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True))
    input_ids = torch.full((count, width), tokenizer.pad_token_id, dtype=torch.long)  # [B, L]
    labels = torch.full((count, width), IGNORE_INDEX, dtype=torch.long)  # [B, L]
    for row, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        input_ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
    return {"input_ids": input_ids, "labels": labels}


def train_step(model: LlamaForCausalLM, batches: Sequence[dict[str, torch.Tensor]]) -> float:
    """Backward the mean cross-entropy over the completion tokens of all `batches`; returns that mean.

    One batch per task, so short arith rows are not padded to the width of format_copy rows; dividing each
    batch's summed loss by the total token count makes the gradient that of one joint batch.
    """
    num_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    total = 0.0
    for batch in batches:
        loss = model(**batch, num_items_in_batch=num_tokens).loss
        loss.backward()
        total += loss.item()
    return total


def save_checkpoint(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, metrics: dict[str, object]
) -> None:
    """Model (safetensors), tokenizer, generation config (stop at `<|im_end|>` or `<|endoftext|>`) and the
    eval metrics (`metrics.json`), loadable by the Auto classes."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llm-pg pretrain-tiny", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=Path("runs/tiny-chat"), help="final checkpoint directory (default: %(default)s)")
    add("--candidates", type=Path, default=Path("runs/tiny-pretrain"), help="where eval'd checkpoints go")
    add("--steps", type=int, default=2500, help="optimizer steps; the cosine schedule spans them")
    add("--minutes", type=float, default=None, help="time budget: stop early after this many minutes (default: none)")
    add("--batch-size", type=int, default=128, help="examples per step")
    add("--arith-share", type=float, default=2 / 3, help="share of arith in each batch (copying is learnt sooner)")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup-steps", type=int, default=100)
    add("--weight-decay", type=float, default=0.1)
    add("--hidden-size", type=int, default=128)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=4)
    add("--eval-every", type=int, default=100, help="score on the eval sets every this many steps (0: never)")
    add("--eval-from", type=int, default=1000, help="first step to score (earlier ones cannot meet the targets)")
    add("--samples", type=int, default=16, help="samples per eval prompt at T=1 (for pass@1 and pass@8)")
    add("--seed", type=int, default=0, help="seeds the initialisation, the example stream and the noise")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's); 1 is faster on shared cores")
    return parser.parse_args(argv)


def train(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, tasks: dict[str, Task], args: argparse.Namespace
) -> Path | None:
    """The pretraining loop; returns the latest saved candidate that met the targets (None if none did)."""
    import torch
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    num_arith = round(args.batch_size * args.arith_share)
    per_step = [(tasks["format_copy"], args.batch_size - num_arith), (tasks["arith"], num_arith)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup_steps, args.steps, min_lr_rate=0.1)
    start, smoothed, passing = time.monotonic(), math.nan, None
    progress = tqdm(range(1, args.steps + 1), desc="pretrain-tiny", unit="step")
    for step in progress:
        model.train()
        loss = train_step(model, [make_batch(tokenizer, task, (step - 1) * n, n, args.seed) for task, n in per_step])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        smoothed = loss if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * loss
        progress.set_postfix(loss=f"{smoothed:.4f}", lr=f"{schedule.get_last_lr()[0]:.1e}")
        out_of_time = args.minutes is not None and time.monotonic() - start > 60 * args.minutes
        last = step == args.steps or out_of_time
        if args.eval_every and step >= args.eval_from and (step % args.eval_every == 0 or last):
            metrics = evaluate_base(model, tokenizer, tasks, num_samples=args.samples, seed=args.seed)
            failures = target_failures(metrics)
            summary = {t: {m: round(v, 3) for m, v in values.items()} for t, values in metrics.items()}
            progress.write(f"step {step}: {json.dumps(summary)}" + (f" missed {failures}" if failures else " OK"))
            if not failures:
                passing = args.candidates / f"step-{step}"
                save_checkpoint(model, tokenizer, passing, {"step": step, "loss": smoothed, **metrics})
        if out_of_time:
            progress.write(f"time budget of {args.minutes} minutes spent after step {step}")
            break
    progress.close()
    print(f"pretraining took {(time.monotonic() - start) / 60:.1f} minutes, {step} steps, loss {smoothed:.4f}")
    return passing


def main(argv: Sequence[str] | None = None) -> int:
    """Train; copy the latest candidate that met the targets to `--out` (status 1 when none did)."""
    args = parse_args(argv)
    for flag, path in (("--out", args.out), ("--candidates", args.candidates)):
        if path.exists() and not path.is_dir():  # found now, not after the training
            print(f"llm-pg pretrain-tiny: error: {flag} {path} is a file; give a folder", file=sys.stderr)
            return 2
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar, ours: not one per candidate save
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    tasks = tiny_tasks()
    model = LlamaForCausalLM(tiny_config(tokenizer, args.hidden_size, args.layers, args.heads))
    print(f"tiny Llama: {sum(p.numel() for p in model.parameters()):,} parameters")
    passing = train(model, tokenizer, tasks, args)
    if passing is None:
        save_checkpoint(model, tokenizer, args.out, {})
        scored = bool(args.eval_every)
        print(f"saved the last checkpoint to {args.out}" + (": no checkpoint met the targets" if scored else ""))
        return 1 if scored else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for path in passing.iterdir():  # file by file, so a README already in --out stays
        shutil.copy2(path, args.out / path.name)
    report = json.loads((passing / "metrics.json").read_text())
    print(f"{passing} meets the targets; copied to {args.out}")
    print(format_table({name: report[name] for name in tasks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
