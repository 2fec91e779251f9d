"""The math_hard GRPO update at the course's shapes, the path before issue 22 (`old`) against the levers (`new`).

    .venv/bin/python benchmarks/update_shapes.py [--rows 64] [--scale 1.0] [--threads 2] [--reps 1]
        [--share-prompt-dropout]

The update of configs/math_hard/grpo.yaml: 64 rows (8 prompts x G 8), 2 epochs, micro-batch 8 x accumulation 8
(one step per pass), gradient checkpointing, LoRA r16 / alpha 32 / dropout 0.05 on the seven projections, KL 0.05,
the pi_old and reference passes (`speed.logprob_batch_size` 32). The model is a random Qwen2 (seed 0) with Qwen2.5's
vocabulary, 151,936 rows, tied embeddings, and a small body (hidden 64, 2 layers, 4 query / 2 key-value heads) so
one update fits a CPU in minutes: the head is full-size, the body is not.

Lengths (seeded): prompts uniform in 100-400 tokens, one per group of 8; completions 8-512 tokens, a quarter of them
at the cap 512 (truncated, no EOS) and the rest uniform in 8-511 ending in EOS, as Qwen2.5-Math produces on MATH
level 5 under `max_new_tokens: 512`. `--scale s` multiplies every length by s; `--rows` shrinks the rollout (a
multiple of 8). The old path is `speed: {logprob_chunk_size: 0, group_by_length: false}` (the keys turn each lever
off); `old` and `new` draw a LoRA-dropout mask per row (`speed.share_prompt_dropout: false`, the course's draw).
`--share-prompt-dropout` adds a third side, `new_shared_dropout`: today's defaults
(`speed.share_prompt_dropout: true`), so the training forwards share each prompt (one LoRA-dropout mask per prompt)
through the checkpointed layers (`llm_pg.models.cache.PromptCache`); `new` keeps a mask per row, so its training
forwards run every row's prompt.

Per phase (pi_old pass, reference pass, update): token positions the decoder processed against the real tokens of
its rows, wall time, and peak memory. On the CPU memory is the process's resident set (each side in its own
subprocess): the phase's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` before the phase) over the
resident set it started with; torch's CPU allocator keeps no statistics, and tracemalloc does not see its buffers.
On a GPU: `torch.cuda.max_memory_allocated` over the memory allocated at the phase's start.
The last line is JSON: `{"old": {...}, "new": {...}}` (and `"new_shared_dropout": {...}` with the flag) with the
update's `processed_over_real`, `update_s` (median over `--reps`), `peak_mb`, and `iteration_s` (the three phases'
medians), `frozen_peak_mb`, `lora_b_abs_sum` (a fingerprint of the step, not an exactness check: the sides draw other
LoRA-dropout masks, as rows run in another order; exactness is tests/test_update_levers.py's and
tests/test_prefix_checkpointing.py's, without dropout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, EOS, PAD = 151_936, 151_645, 151_643  # Qwen2.5: <|im_end|>, <|endoftext|>
SIDES = {
    "old": {"logprob_chunk_size": 0, "group_by_length": False, "share_prompt_dropout": False},
    "new": {"share_prompt_dropout": False},  # a LoRA-dropout mask per row, as the course draws them
    "new_shared_dropout": {"share_prompt_dropout": True},  # the default since issue 27; with --share-prompt-dropout
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak(device: torch.device) -> None:
    """Start the peak over: Linux resets the resident-set high-water mark (VmHWM) on `5 > clear_refs`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_mb(device: torch.device) -> float:
    """The peak since `reset_peak`: CUDA's allocated bytes, or the resident set's high-water mark (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def make_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=EOS,
        pad_token_id=PAD,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)


def make_rollout(rows: int, scale: float, seed: int = 0):
    """Group-contiguous rows `[prompt (left-padded) | completion (right-padded)]` of the documented lengths."""
    from llm_pg.core.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [max(1, int(scale * int(torch.randint(100, 401, (1,), generator=g)))) for _ in range(rows // 8)]
    cap = max(2, int(512 * scale))
    at_cap = torch.rand(rows, generator=g) < 0.25
    lengths = [cap if c else max(2, int(scale * int(torch.randint(8, 512, (1,), generator=g)))) for c in at_cap]
    lengths = [min(n, cap) for n in lengths]
    width, prompt_len = max(lengths), max(prompts)
    ids = torch.full((rows, prompt_len + width), PAD)
    attention = torch.zeros_like(ids)
    for row in range(rows):
        p, n = prompts[row // 8], lengths[row]
        gen = torch.Generator().manual_seed(seed * 1000 + row // 8)
        ids[row, prompt_len - p : prompt_len] = torch.randint(0, 151_000, (p,), generator=gen)
        ids[row, prompt_len : prompt_len + n] = torch.randint(0, 151_000, (n,), generator=g)
        if not at_cap[row]:
            ids[row, prompt_len + n - 1] = EOS
        attention[row, prompt_len - p : prompt_len + n] = 1
    mask = attention[:, prompt_len:].bool()
    rewards = (torch.rand(rows, generator=g) < 0.3).float() * 1.3  # the share a 1.5B model solves, a non-1.0 value
    from llm_pg.core.advantages import group_advantages

    return RolloutBatch(
        input_ids=ids, attention_mask=attention, completion_mask=mask, rewards=rewards,
        advantages=group_advantages(rewards, 8).clamp(-5, 5), prompt_len=prompt_len,
        texts=[""] * rows, prompt_index=[row // 8 for row in range(rows)],
    )  # fmt: skip


def build_module(path: str, keys: dict, device: torch.device):
    from llm_pg.models.loading import LoRA, load_policy
    from llm_pg.modules import GRPOModule

    lora = LoRA(r=16, alpha=32, dropout=0.05, target_modules=SEVEN)
    module = GRPOModule(
        model_name_or_path=path, lora=lora, group_size=8, prompts_per_step=8,
        minibatch_size=8, grad_accum_steps=8, ppo_epochs=2, kl_coef=0.05, clip_eps=0.2, lr=3e-5, max_grad_norm=0.5,
        max_new_tokens=512, dtype="bfloat16" if device.type == "cuda" else "float32",
        speed={"gradient_checkpointing": True, "logprob_batch_size": 32, **keys},
    )  # fmt: skip
    module.compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module.policy = load_policy(path, torch.float32, lora, True)
    module.to(device)
    optimizer = module.configure_optimizers()["optimizer"]
    # The update outside a Trainer: one device, no DDP, the backward and optimizer the loop would call.
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()
    module._trainer = SimpleNamespace(world_size=1, strategy=None)
    return module


def count_positions(module) -> list[int]:
    seen = []
    decoder = module.policy.get_base_model().get_decoder()
    decoder.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen


def run_side(side: str, args) -> dict:
    from llm_pg.modules.update import run_update

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as path:
        make_model(path)
        module = build_module(path, SIDES[side], device)
    optimizer = module.optimizers()
    rollout = make_rollout(args.rows, args.scale).to(device)
    real = int(rollout.attention_mask.sum())
    seen = count_positions(module)
    phases = {}
    for name, epochs in (("old_logp", 1), ("ref_logp", 1), ("update", 2)):
        seen.clear()
        reset_peak(device)
        base = torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else rss_mb()
        start = time.perf_counter()
        if name == "update":
            torch.manual_seed(0)
            run_update(module.update_context, rollout, optimizer, torch.Generator().manual_seed(1))
        else:
            logp = (module.reference_logprobs if name == "ref_logp" else module.old_logprobs)(rollout)
            rollout = dataclasses.replace(rollout, **{name: logp})
        if device.type == "cuda":
            torch.cuda.synchronize()
        phases[name] = {
            "seconds": round(time.perf_counter() - start, 3),
            "positions": sum(seen),
            "real_tokens": real * epochs,
            "processed_over_real": round(sum(seen) / (real * epochs), 3),
            "peak_mb": round(peak_mb(device) - base, 1),  # this phase's peak over what it started with
        }
    lora_b = sum(float(p.detach().abs().sum()) for n, p in module.policy.named_parameters() if "lora_B" in n)
    return {"phases": phases, "lora_b_abs_sum": lora_b, "device": device.type}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def summary(side_runs: list[dict]) -> dict:
    """The update's figures of one side: positions and memory of its first run, wall times as medians over runs."""
    update = side_runs[0]["phases"]["update"]
    seconds = {name: median([run["phases"][name]["seconds"] for run in side_runs]) for name in side_runs[0]["phases"]}
    return {
        "processed_over_real": update["processed_over_real"],
        "update_s": seconds["update"],
        "peak_mb": update["peak_mb"],
        "iteration_s": round(sum(seconds.values()), 3),  # the three phases' medians
        "frozen_peak_mb": max(side_runs[0]["phases"][name]["peak_mb"] for name in ("old_logp", "ref_logp")),
        "lora_b_abs_sum": side_runs[0]["lora_b_abs_sum"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rollout rows, a multiple of 8 (prompt groups of 8)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt and completion length")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--reps", type=int, default=1, help="interleaved old/new runs; wall times are medians")
    parser.add_argument(
        "--share-prompt-dropout", action="store_true", help="add the side new_shared_dropout (share_prompt_dropout)"
    )
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # one side, in a subprocess
    args = parser.parse_args()
    if args.rows % 8:
        parser.error("--rows must be a multiple of 8")
    if args.side:
        print(json.dumps(run_side(args.side, args)))
        return
    sides = [side for side in SIDES if args.share_prompt_dropout or side != "new_shared_dropout"]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.reps):
        for side in sides:  # interleaved, each side in a fresh process: its own peak resident set
            command = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    result = {}
    for side, side_runs in runs.items():
        for name, phase in side_runs[0]["phases"].items():
            seconds = sorted(run["phases"][name]["seconds"] for run in side_runs)
            print(f"{side:18} {name:8} positions {phase['positions']:>8} real {phase['real_tokens']:>8} "
                  f"({phase['processed_over_real']:.3f}x)  {median(seconds):8.2f} s (median of "
                  f"{len(seconds)}: {seconds})  peak +{phase['peak_mb']:.0f} MB")  # fmt: skip
        result[side] = summary(side_runs)
    result["device"] = runs["new"][0]["device"]
    result["args"] = {"rows": args.rows, "scale": args.scale, "threads": args.threads, "reps": args.reps}
    result["args"]["share_prompt_dropout"] = args.share_prompt_dropout
    print(json.dumps(result))


if __name__ == "__main__":
    main()
