"""Rollout engines: prompts in, `Generation` out, behind one interface.

Every engine has

- `generate(conversations, sampling, *, num_samples, seed) -> Generation`: `num_samples` completions per
  conversation drawn as the `llm_pg.models.generation.Sampling` settings say, group-contiguous
  (row `i*G + j` answers prompt i), prompts left-padded with the tokenizer's pad id by `encode_prompts`,
  completions right-padded with the pad id after their first EOS, texts decoded without special tokens;
- `load_weights(model)`: make the engine sample from `model`'s current weights.

`HFEngine` (default) samples with the policy itself (`llm_pg.models.generation.generate`, HF `generate`'s
tokens from our decode loop); `VLLMEngine` (optional, `llm-pg[vllm]`)
runs vLLM colocated in the training process and also returns vLLM's log-prob of every sampled token. It is
imported from `llm_pg.engines.vllm` only when asked for, because importing vLLM is slow and it is not installed
by default. `build_engine(module)` makes the one the module's `rollout_engine` key names; the module holds it as
`module.engine`, through which every rollout and evaluation generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_info

from llm_pg.engines.health import SamplerHealth, logprob_mismatch, tis_metrics
from llm_pg.engines.hf import HFEngine
from llm_pg.models.generation import eos_token_ids
from llm_pg.runs.directory import run_dir

if TYPE_CHECKING:
    from llm_pg.engines.vllm import VLLMEngine

__all__ = ["HFEngine", "SamplerHealth", "build_engine", "logprob_mismatch", "tis_metrics"]


def build_engine(module) -> HFEngine | VLLMEngine:
    """The engine `module.hparams.rollout_engine` names, sampling from `module.policy` (after `configure_model`).

    vLLM is set up from the module's settings: the compute dtype, `max_model_len = max_prompt_tokens + the larger
    of max_new_tokens and eval_max_new_tokens` (the model's own limit when prompts are not cut), the log-prob mode
    that matches `logprob_temperature`, the policy's EOS ids, and the `vllm_*` keys. On the CPU it runs eagerly
    (no graph compilation, which would take minutes for a rollout that takes a second). With LoRA vLLM serves the
    adapter itself (`lora_rank`, `llm_pg.engines.vllm_weights`); vLLM's own log goes to `<run dir>/vllm.log`, and one
    line at start (`VLLMEngine.describe`) names the engine, its dtype and memory.

    Under DDP each rank builds its own engine on its own device (`module.device`: `cuda:<k>`, or the CPU), tensor
    parallel 1, inside the trainer's process group (`llm_pg.engines.vllm`'s docstring), with a vLLM seed of its own;
    the requests' seeds already differ by rank. Under any other multi-rank strategy (FSDP2) it is refused.
    """
    hp = module.hparams
    if hp.rollout_engine == "hf":
        return HFEngine(
            module.policy,
            module.tokenizer,
            autocast=module.autocast,
            share_prompt_prefix=hp.share_prompt_prefix,
            compiled=hp.compile_generation,
        )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        strategy = module.trainer.strategy
        if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):  # DeepSpeed shards too
            # A sharded policy (FSDP2) has no full weights on any rank to push; other strategies are untested.
            raise ValueError(
                f"model.rollout_engine=vllm with trainer.strategy {type(strategy).__name__}: several ranks sample "
                "with vLLM under DDP only; set trainer.strategy: ddp, or rollout_engine: hf"
            )
    from llm_pg.engines.vllm import VLLMEngine, vllm_logprobs_mode

    longest_new = max(hp.max_new_tokens, hp.eval_max_new_tokens or 0)
    engine = VLLMEngine(
        hp.model_name_or_path,
        module.tokenizer,
        dtype=module.compute_dtype,
        max_model_len=hp.max_prompt_tokens + longest_new if hp.max_prompt_tokens is not None else None,
        gpu_memory_utilization=hp.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=hp.vllm_kv_cache_memory_bytes,
        seed=(hp.seed + module.global_rank) % 2**32,  # unseeded requests differ by rank; vLLM wants < 2**32
        logprobs_mode=vllm_logprobs_mode(hp.logprob_temperature, hp.temperature),
        eos_token_ids=eos_token_ids(module.policy, module.tokenizer),
        enforce_eager=module.device.type == "cpu",
        max_num_batched_tokens=hp.vllm_max_num_batched_tokens,
        device=module.device,
        lora_rank=module.lora.r if module.uses_lora else None,
        log_file=_vllm_log_file(module),
    )
    rank_zero_info(engine.describe())
    return engine


def _vllm_log_file(module) -> Path | None:
    """`<run dir>/vllm.log` (`vllm_rank<k>.log` under DDP), or None outside a trainer's run (vLLM logs to stderr)."""
    trainer = module._trainer
    if trainer is None:
        return None
    name = "vllm.log" if trainer.world_size == 1 else f"vllm_rank{trainer.global_rank}.log"
    return run_dir(trainer) / name
