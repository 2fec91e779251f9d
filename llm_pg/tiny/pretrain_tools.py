"""Teach the bundled tiny model the calculator: the tool-aware checkpoint `llm_pg/assets/tiny-chat-tools`.

Starting from the tiny chat model (`llm_pg/assets/tiny-chat`, which stays as it is), fine-tune it on noisy
two-turn demonstrations of calc_arith (`CalcArithTask`, no system prompt): in `TOOL_SHARE` of them the model calls
`<calc>a*b</calc>`, reads the result from the tool turn and answers `\\boxed{result}` (copying it wrongly now and
then); in the rest it answers at once with a guess (right `GUESS_CORRECT` of the time; the tiny model cannot
multiply two-digit numbers). Each demonstration is framed exactly as a rollout frames an episode: the prompt and the
tool turn come from the chat template (`llm_pg.models.chat.ChatObservations`), and the loss covers the model's
turns only. So the base policy calls the tool in about a third of its samples and its greedy answer is a guess:
RL has a tool-call rate to raise, and a reward that rises with it.

    python -m llm_pg.tiny.pretrain_tools --out llm_pg/assets/tiny-chat-tools

made the committed checkpoint (its `metrics.json` holds the figures it was measured at).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

from llm_pg.data.tasks.base import Example
from llm_pg.data.tasks.calc_arith import CalcArithTask, calc
from llm_pg.tiny.pretrain import IGNORE_INDEX, save_checkpoint

TOOL_SHARE = 0.35  # demonstrations that call the calculator
CALL_SLIP = 0.10  # calls with one operand off by one (the result, and so the answer, is then wrong)
COPY_SLIP = 0.10  # answers that copy the tool's result with its last digit changed
GUESS_CORRECT = 0.05  # direct answers that are right
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def episode(example: Example, rng: random.Random) -> list[str]:
    """The model's turns of one noisy demonstration: `[answer]`, or `[call, answer]` (the observation between them
    is the calculator's result, added by the caller)."""
    a, b = (int(x) for x in example.prompt.split("=")[0].split("*"))
    if rng.random() < TOOL_SHARE:
        if rng.random() < CALL_SLIP:
            b += rng.choice((-1, 1))
        result = int(calc(f"{a}*{b}"))
        if rng.random() < COPY_SLIP:
            result = result - result % 10 + (result % 10 + rng.randint(1, 9)) % 10
        return [f"<calc>{a}*{b}</calc>", f"\\boxed{{{result}}}"]
    exact = a * b
    guess = exact if rng.random() < GUESS_CORRECT else exact + rng.choice((-1, 1)) * rng.randint(1, exact // 5)
    return [f"\\boxed{{{guess}}}"]


def encode_episode(tokenizer, task: CalcArithTask, example: Example, turns: list[str]) -> tuple[list[int], list[int]]:
    """Ids and labels of one demonstration, framed as `llm_pg.engines.episodes` frames a rollout: the prompt with
    its generation prompt, each turn with the end token, the tool turn from the template; labels on the turns only."""
    from llm_pg.models.chat import ChatObservations

    messages = task.messages(example)
    ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    observations = ChatObservations(tokenizer, task.observation_role, [tokenizer.eos_token_id])
    for index, turn in enumerate(turns):
        tokens = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, labels = ids + tokens, labels + tokens
        messages = [*messages, {"role": "assistant", "content": turn}]
        if index + 1 < len(turns):
            call = task.find_call(turn)
            observation = observations.observation_ids(messages, calc(call[1]))
            messages.append({"role": task.observation_role, "content": calc(call[1])})
            ids, labels = ids + observation, labels + [IGNORE_INDEX] * len(observation)
    return ids, labels


def make_batch(tokenizer, task: CalcArithTask, start: int, count: int, seed: int):
    import torch

    rows = []
    for index in range(start, start + count):
        example = task.train_example(index, seed)
        rows.append(encode_episode(tokenizer, task, example, episode(example, random.Random(f"{seed}:tools:{index}"))))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((count, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((count, width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, label) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(label)] = torch.tensor(label)
    return {"input_ids": input_ids, "labels": labels}


def measure(model, tokenizer, task: CalcArithTask, samples: int, seed: int) -> dict[str, float]:
    """Greedy exact match and tool-call rate on the eval set, and the sampled (T=1) ones over `samples` each."""
    from llm_pg.engines.episodes import run_episodes
    from llm_pg.engines.hf import HFEngine
    from llm_pg.models.generation import Sampling, eos_token_ids

    engine, eos = HFEngine(model, tokenizer), eos_token_ids(model, tokenizer)
    examples = task.eval_examples
    metrics = {}
    for name, sampling, count in (
        ("greedy", Sampling(max_new_tokens=96, greedy=True), 1),
        ("sampled", Sampling(max_new_tokens=96), samples),
    ):
        out = run_episodes(engine, tokenizer, task, examples, sampling, num_samples=count, seed=seed, eos=eos)
        rows = [examples[i // count] for i in range(len(out.texts))]
        scores = [task.score(text, example) for text, example in zip(out.texts, rows, strict=True)]
        metrics[f"{name}_exact_match"] = sum(s.correct for s in scores) / len(scores)
        metrics[f"{name}_tool_call_rate"] = float((out.tool_calls > 0).float().mean())
    return metrics


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llm_pg.tiny.pretrain_tools", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--base", type=Path, default=ASSETS / "tiny-chat", help="the checkpoint to start from")
    add("--out", type=Path, default=Path("runs/tiny-chat-tools"), help="where the checkpoint goes")
    add("--steps", type=int, default=500)
    add("--batch-size", type=int, default=64)
    add("--lr", type=float, default=1e-3)
    add("--warmup-steps", type=int, default=25)
    add("--samples", type=int, default=8, help="samples per eval prompt at T=1")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    task = CalcArithTask(system_prompt=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, args.warmup_steps, args.steps, min_lr_rate=0.1)
    start, smoothed = time.monotonic(), math.nan
    for step in range(1, args.steps + 1):
        model.train()
        batch = make_batch(tokenizer, task, (step - 1) * args.batch_size, args.batch_size, args.seed)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        smoothed = loss.item() if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * loss.item()
        if step % 50 == 0:
            print(f"step {step}: loss {smoothed:.4f} ({time.monotonic() - start:.0f} s)", flush=True)
    model.eval()
    metrics = measure(model, tokenizer, task, args.samples, args.seed)
    print(json.dumps(metrics))
    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, tokenizer, args.out, {"steps": args.steps, "loss": smoothed, "calc_arith": metrics})
    print(f"saved to {args.out} after {(time.monotonic() - start) / 60:.1f} minutes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
