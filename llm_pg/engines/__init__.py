"""Rollout engines: prompts in, `Generation` out, behind one interface (`Engine`).

Every engine has

- `generate(conversations, sampling, *, num_samples, seed) -> Generation`: `num_samples` completions per
  conversation drawn as the `llm_pg.models.generation.Sampling` settings say, group-contiguous
  (row `i*G + j` answers prompt i), prompts left-padded with the tokenizer's pad id by `encode_prompts`,
  completions right-padded with the pad id after their first EOS, their masks, texts decoded without special
  tokens, and the engine's own log-prob of each sampled token where it has one;
- `continue_ids(contexts, sampling, *, budgets, rows, seed)`: one continuation per token-id context (the turns of
  a tool task's episodes, `llm_pg.engines.episodes`), and its log-probs where the engine has them;
- `load_weights(model)`: make the engine sample from `model`'s current weights;
- `context`: the longest prompt plus completion it takes, in tokens (None: unknown);
- `schedules_batches`: whether it batches requests itself (an evaluation then sends the whole set in one call);
- `describe()`: one line for the terminal at start.

`HFEngine` (default) samples with the policy itself (`llm_pg.models.generation.generate`, HF `generate`'s
tokens from our decode loop); `VLLMEngine` (optional, `llm-pg[vllm]`) runs vLLM colocated in the training process
and also returns vLLM's log-prob of every sampled token. It is imported from `llm_pg.engines.vllm` only when asked
for, because importing vLLM is slow and it is not installed by default. `build_engine` makes the one a fit's
`rollout_engine` key names (`ENGINES`); the module holds it as `module.engine`, through which every rollout and
evaluation generates. Adding an engine is one file with a class that has the members above, and its builder in
`ENGINES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from lightning.pytorch.utilities import rank_zero_info

from llm_pg.engines.health import SamplerHealth, logprob_mismatch, tis_metrics
from llm_pg.engines.hf import HFEngine
from llm_pg.models.generation import Conversation, Generation, Sampling

__all__ = [
    "ENGINES",
    "Engine",
    "EngineSettings",
    "HFEngine",
    "SamplerHealth",
    "build_engine",
    "logprob_mismatch",
    "samples_sharded",
    "tis_metrics",
]


class Engine(Protocol):
    """What every rollout engine does (the module docstring says each member's contract)."""

    context: int | None
    schedules_batches: bool

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: Sampling,
        *,
        num_samples: int = 1,
        seed: int | None = None,
    ) -> Generation: ...

    def continue_ids(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        budgets: Sequence[int],
        rows: Sequence[int],
        seed: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]] | None]: ...

    def load_weights(self, model: torch.nn.Module) -> None: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, gathered once by the module (`PolicyGradientModule.engine`).

    Args:
        model_name_or_path: the checkpoint the policy loaded (vLLM loads it again).
        eos: every id that ends a completion.
        dtype: the compute dtype.
        device: this rank's device.
        autocast: forward passes in the compute dtype (HF).
        share_prompt_prefix: prefill each prompt once for its samples (HF).
        compiled: decode steps through `torch.compile` (HF: `speed.compile_generation`).
        max_model_len: the longest prompt plus completion (None: the model's own).
        seed: the run's seed (vLLM's own generator, per rank).
        logprob_temperature, temperature: the T of the trainer's log-probs and of sampling (vLLM reports its
            log-probs at the one that matches: `llm_pg.engines.vllm.vllm_logprobs_mode`).
        lora_rank: the policy's LoRA rank (None: full fine-tuning).
        gpu_memory_utilization, kv_cache_memory_bytes, max_num_batched_tokens: the `vllm_*` keys.
        log_file: where vLLM's log goes (None: stderr).
        world_size: data-parallel ranks; strategy: the trainer's strategy (vLLM samples under DDP only).
    """

    model_name_or_path: str
    eos: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    autocast: Callable[[], AbstractContextManager] = nullcontext
    share_prompt_prefix: bool = True
    compiled: bool = False
    max_model_len: int | None = None
    seed: int = 0
    logprob_temperature: float | None = 1.0
    temperature: float = 1.0
    lora_rank: int | None = None
    gpu_memory_utilization: float = 0.3
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    log_file: Path | None = None
    world_size: int = 1
    strategy: object = None


def _hf(policy: torch.nn.Module, tokenizer, settings: EngineSettings) -> HFEngine:
    return HFEngine(
        policy,
        tokenizer,
        autocast=settings.autocast,
        share_prompt_prefix=settings.share_prompt_prefix,
        compiled=settings.compiled,
    )


def _vllm(policy: torch.nn.Module, tokenizer, settings: EngineSettings) -> Engine:
    """vLLM set up from the fit's settings. On the CPU it runs eagerly (no graph compilation, which would take
    minutes for a rollout that takes a second). With LoRA vLLM serves the adapter itself (`lora_rank`,
    `llm_pg.engines.vllm_weights`); one line at start (`VLLMEngine.describe`) names the engine, its dtype and memory.

    Under DDP each rank builds its own engine on its own device, tensor parallel 1, inside the trainer's process
    group (`llm_pg.engines.vllm`'s docstring), with a vLLM seed of its own; the requests' seeds already differ by
    rank. Under any other multi-rank strategy (FSDP2, DeepSpeed) it is refused: a sharded policy has no full weights
    on any rank to push."""
    if settings.world_size > 1:
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        strategy = settings.strategy
        if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(
                f"model.rollout_engine=vllm with trainer.strategy {type(strategy).__name__}: several ranks sample "
                "with vLLM under DDP only; set trainer.strategy: ddp, or rollout_engine: hf"
            )
    from llm_pg.engines.vllm import VLLMEngine, vllm_logprobs_mode

    engine = VLLMEngine(
        settings.model_name_or_path,
        tokenizer,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        seed=settings.seed % 2**32,  # vLLM wants < 2**32
        logprobs_mode=vllm_logprobs_mode(settings.logprob_temperature, settings.temperature),
        eos_token_ids=list(settings.eos),
        enforce_eager=settings.device.type == "cpu",
        max_num_batched_tokens=settings.max_num_batched_tokens,
        device=settings.device,
        lora_rank=settings.lora_rank,
        log_file=settings.log_file,
    )
    rank_zero_info(engine.describe())
    return engine


# The engines a fit's `rollout_engine` key names, each built from the policy, its tokenizer and the settings.
ENGINES: dict[str, Callable[[torch.nn.Module, object, EngineSettings], Engine]] = {"hf": _hf, "vllm": _vllm}


def samples_sharded(name: str) -> bool:
    """Whether engine `name` can sample with a policy sharded by FSDP2: only one that samples with the policy
    itself (HF), whose call gathers the shards (a separate engine would need full weights on some rank)."""
    return name == "hf"


def build_engine(name: str, policy: torch.nn.Module, tokenizer, settings: EngineSettings) -> Engine:
    """The engine `name` (`ENGINES`) sampling from `policy` (after `configure_model`)."""
    if name not in ENGINES:
        raise ValueError(f"model.rollout_engine must be one of {sorted(ENGINES)}, got {name!r}")
    return ENGINES[name](policy, tokenizer, settings)
