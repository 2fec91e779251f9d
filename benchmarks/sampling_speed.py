"""Seconds to sample one rollout with top-p: llm_pg's nucleus sampler against transformers' top-p warper.

    .venv/bin/python benchmarks/sampling_speed.py [--model smollm2-135m-instruct] [--reps 3] [--threads 2]

Samples the course's format_copy rollout shape (8 prompts x 6 completions, up to 24 new tokens, T 0.8, top-p 0.95)
with the LoRA policy of configs/real_cpu/format_copy_grpo.yaml (r16 on the seven projections), both ways in the same
process, alternating: `llm_pg.models.generation.generate` (its `NucleusSampler`, shared prefill, reserved KV
cache) and the
same call with transformers' own `do_sample=True, top_p=...` (a full sort of the vocabulary and one exponential draw
per vocabulary entry at every token). Prints each repetition and the medians; the last line is JSON
`{"nucleus_s": ..., "transformers_s": ..., "ratio": ...}`. A figure to compare, never an assertion.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LogitsProcessorList

from llm_pg.data.tasks import FormatCopyTask
from llm_pg.models import generation
from llm_pg.models.generation import Sampling
from llm_pg.models.loading import LoRA, load_policy, load_tokenizer

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    policy = load_policy(args.model, torch.float32, LoRA(r=16, alpha=32, target_modules=SEVEN))
    task = FormatCopyTask()
    task.bind_seed(0)
    conversations = [task.messages(task.train_example(i, 0)) for i in range(8)]
    settings = Sampling(max_new_tokens=24, min_new_tokens=1, temperature=0.8, top_p=0.95)
    original = policy.generate

    def transformers_top_p(*call_args, **kwargs):
        """`generate` as before the nucleus sampler: transformers' warper and multinomial draw."""
        if isinstance(kwargs.get("logits_processor"), LogitsProcessorList):
            kwargs.pop("logits_processor")
            kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        return original(*call_args, **kwargs)

    times: dict[str, list[float]] = {"nucleus": [], "transformers": []}
    for rep in range(args.reps):
        for side in ("nucleus", "transformers") if rep % 2 == 0 else ("transformers", "nucleus"):
            policy.generate = original if side == "nucleus" else transformers_top_p
            start = time.perf_counter()
            out = generation.generate(policy, tokenizer, conversations, settings, num_samples=6, seed=rep)
            times[side].append(time.perf_counter() - start)
            tokens = int((out.completion_ids != tokenizer.pad_token_id).sum())
            print(f"rep {rep} {side:>12}: {times[side][-1]:.2f} s ({tokens} completion tokens other than EOS/pad)")
    nucleus, plain = statistics.median(times["nucleus"]), statistics.median(times["transformers"])
    for side, values in times.items():
        print(f"{side:>12}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    print(
        json.dumps(
            {"nucleus_s": round(nucleus, 3), "transformers_s": round(plain, 3), "ratio": round(nucleus / plain, 3)}
        )
    )


if __name__ == "__main__":
    main()
