"""Seconds per phase of a math_hard-shaped GRPO iteration on a randomly initialised Qwen2.5-Math-1.5B, per engine.

    python benchmarks/gpu_iteration.py                 # one H100-class GPU: hf, then vllm when importable
    python benchmarks/gpu_iteration.py --smoke         # CPU check of the script: 2 small layers, 16 tokens

No download: the model is built from Qwen2.5-Math-1.5B's config (below) with random weights and the tiny byte
tokenizer (ids 0-259 of its 151,936-word vocabulary), saved to a temporary directory, then loaded the way a run
loads it. The shape is the course's math_hard GRPO run: 8 prompts x 8 completions, ~300-token prompts, LoRA r16
(alpha 32, dropout 0.05) on the seven projections, bf16, gradient checkpointing, 2 passes of 8 micro-batches of
8 (one optimizer step per pass), KL to the adapter-free base, T 0.8, top-p 0.95; every completion is forced to
512 tokens (`min_new_tokens`), the longest a real rollout can be.

It drives our own classes rather than Lightning's loop: a `GRPOModule` loads the policy and computes the
pi_old / pi_ref log-probs (`frozen_logprobs`), the training log-probs (`sequence_logprobs`) and the loss (`loss`,
i.e. `losses.grpo_loss`); the engines are `llm_pg.engines.HFEngine` and `VLLMEngine`; the optimizer step is
AdamW with the gradient-norm clip, as `training_step` does. Rewards are a cheap stand-in with spread (the share
of sampled ids divisible by 7), so advantages and gradients are non-zero. Printed per engine: seconds per phase
(weight sync, rollout, old and reference log-probs, update), generated tokens/s, peak GPU memory, and for vLLM
the mismatch between its sampled-token log-probs and pi_old. A figure to compare, never an assertion.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from llm_pg.engines import HFEngine
from llm_pg.losses import completion_mask, group_advantages
from llm_pg.models import LoRA
from llm_pg.modules import GRPOModule
from llm_pg.rollout import RolloutBatch, derive_seed
from llm_pg.tiny.tokenizer import build_tokenizer

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
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS, GROUP = 8, 8


def save_random_model(config: dict, dtype: torch.dtype, out: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(model_max_length=config["max_position_embeddings"])
    model_config = Qwen2Config(
        **config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(model_config).to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)


def conversations(prompt_chars: int) -> list[list[dict[str, str]]]:
    """`PROMPTS` user turns of about `prompt_chars` bytes (= byte tokens), like a level-5 MATH problem."""
    stem = "Let $f(x) = ax^3 + bx^2 + cx + d$ with real coefficients satisfy $f(1) = 2$, $f(2) = 11$, and "
    out = []
    for i in range(PROMPTS):
        text = f"Problem {i}: " + (stem * (prompt_chars // len(stem) + 1))[:prompt_chars]
        out.append([{"role": "user", "content": text + " Put the final answer in \\boxed{}."}])
    return out


class Phases:
    """Wall seconds per named phase, synchronising the GPU at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds[name].append(time.perf_counter() - start)


def make_engine(name: str, module: GRPOModule, model_dir: str, args, max_len: int):
    if name == "hf":
        return HFEngine(module.policy, module.tokenizer)
    from llm_pg.engines.vllm import VLLMEngine, vllm_logprobs_mode

    return VLLMEngine(
        model_dir,
        module.tokenizer,
        dtype=module.compute_dtype,
        max_model_len=max_len,
        seed=0,
        logprobs_mode=vllm_logprobs_mode(module.logprob_temperature, module.hparams.temperature),
        enforce_eager=args.smoke,
        kv_cache_memory_bytes=256 * 2**20 if args.smoke else None,
        max_num_batched_tokens=16384 if args.smoke else None,  # the CPU build must prefill a rollout in one step
    )


def iteration(name: str, module: GRPOModule, engine, optimizer, phases: Phases, index: int, args, stats: dict) -> None:
    """One GRPO iteration with `engine` (`name`: hf or vllm), timing each phase into `phases`."""
    hp = module.hparams
    if name == "vllm":
        with phases("sync"):
            engine.load_weights(module.policy)
    with phases("rollout"):
        sample = engine.generate(
            conversations(args.prompt_chars),
            num_samples=GROUP,
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            temperature=hp.temperature,
            top_p=hp.top_p,
            max_prompt_tokens=hp.max_prompt_tokens,
            seed=derive_seed(hp.seed, index, 0, "sample"),
        )
    device = module.device
    ids = sample.completion_ids.to(device)
    mask = completion_mask(ids, module.tokenizer.eos_token_id)
    stats["generated_tokens"].append(int(mask.sum()))
    rewards = ((ids % 7 == 0) & mask).sum(1).float() / mask.sum(1).clamp(min=1)  # [N] stand-in with spread
    rollout = RolloutBatch(
        input_ids=torch.cat([sample.prompt_ids.to(device), ids], dim=1),
        attention_mask=torch.cat([sample.prompt_mask.to(device), mask.long()], dim=1),
        completion_mask=mask,
        rewards=rewards,
        advantages=group_advantages(rewards, GROUP).clamp(-hp.adv_clip, hp.adv_clip),
        prompt_len=sample.prompt_ids.shape[1],
        texts=sample.texts,
        prompt_index=[row // GROUP for row in range(len(sample.texts))],
    )
    with phases("old_logp"):
        rollout.old_logp = module.frozen_logprobs(rollout, reference=False)
    with phases("ref_logp"):
        rollout.ref_logp = module.frozen_logprobs(rollout, reference=True)
    if name == "vllm":  # the health figure: vLLM's and the trainer's log-probs of the same tokens
        gap = (sample.sampled_logprobs.to(device) - rollout.old_logp)[mask].abs()
        stats["mismatch_max"].append(float(gap.max()))
        stats["mismatch_mean"].append(float(gap.mean()))
    with phases("update"):
        module.policy.train()
        shuffle = torch.Generator().manual_seed(derive_seed(hp.seed, index, 0, "shuffle"))
        params = [p for p in module.policy.parameters() if p.requires_grad]
        for _ in range(module.epochs):
            micro = list(rollout.minibatches(hp.minibatch_size, shuffle))
            for first in range(0, len(micro), hp.grad_accum_steps):
                group = micro[first : first + hp.grad_accum_steps]
                for part in group:
                    logp, _ = module.sequence_logprobs(module.policy, part, with_entropy=True)
                    loss, _ = module.loss(logp, part)
                    (loss / len(group)).backward()
                torch.nn.utils.clip_grad_norm_(params, hp.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)


def run_engine(name: str, model_dir: str, args, device: torch.device) -> None:
    module = GRPOModule(
        model_name_or_path=model_dir,
        iterations=args.iterations,
        lora=LoRA(r=16, alpha=32, dropout=0.05, target_modules=SEVEN),
        dtype="float32" if args.smoke else "bfloat16",
        gradient_checkpointing=True,
        group_size=GROUP,
        prompts_per_step=PROMPTS,
        minibatch_size=8,
        grad_accum_steps=8,
        kl_coef=0.05,
        lr=3e-5,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=args.tokens,
        min_new_tokens=args.tokens,
        max_prompt_tokens=512,
        logprob_batch_size=8,
        seed=0,
    )
    module.configure_model()
    module.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = make_engine(name, module, model_dir, args, max_len=512 + args.tokens)
    optimizer = module.configure_optimizers()["optimizer"]
    phases, stats = Phases(device), defaultdict(list)
    for index in range(args.iterations):
        iteration(name, module, engine, optimizer, phases, index, args, stats)
        row = "  ".join(f"{k} {v[-1]:6.2f}" for k, v in phases.seconds.items())
        print(f"[{name}] iteration {index}: {row} s", flush=True)
    timed = slice(1, None) if args.iterations > 1 else slice(None)  # the first iteration warms up
    print(f"[{name}] mean over iterations {timed.start or 0}..{args.iterations - 1}:")
    total = 0.0
    for phase, values in phases.seconds.items():
        total += statistics.mean(values[timed])
        print(f"  {phase:<9} {statistics.mean(values[timed]):7.2f} s")
    rollout_s = statistics.mean(phases.seconds["rollout"][timed])
    tokens = statistics.mean(stats["generated_tokens"][timed])
    print(f"  iteration {total:7.2f} s   generated {tokens:.0f} tokens, {tokens / rollout_s:,.0f} tokens/s")
    if stats["mismatch_max"]:
        worst, mean = max(stats["mismatch_max"]), statistics.mean(stats["mismatch_mean"])
        print(f"  logprob mismatch vs pi_old: max {worst:.4f}  mean {mean:.5f}")
    if device.type == "cuda":
        free, total_bytes = torch.cuda.mem_get_info()
        print(
            f"  peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated by torch; "
            f"{(total_bytes - free) / 2**30:.1f} of {total_bytes / 2**30:.0f} GiB in use now"
        )
    del engine, optimizer, module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU check: 2 small layers, 16 tokens, float32")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=None, help="default: every available")
    args = parser.parse_args()
    args.tokens = 16 if args.smoke else 512
    args.prompt_chars = 40 if args.smoke else 250  # + chat template and suffix: ~80 / ~300 tokens
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no GPU here: run with --smoke for the CPU check")
    engines = args.engines or (["hf", "vllm"] if vllm_available() else ["hf"])
    with tempfile.TemporaryDirectory() as model_dir:
        start = time.perf_counter()
        save_random_model(
            SMOKE if args.smoke else QWEN_MATH_15B, torch.float32 if args.smoke else torch.bfloat16, model_dir
        )
        print(f"random model saved in {time.perf_counter() - start:.1f} s; engines: {', '.join(engines)}")
        for name in engines:
            start = time.perf_counter()
            run_engine(name, model_dir, args, device)
            print(f"[{name}] wall {time.perf_counter() - start:.1f} s (model load and engine start included)")


if __name__ == "__main__":
    main()
