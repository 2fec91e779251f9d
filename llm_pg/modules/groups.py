"""The typed groups of the module's settings: the keys that are not the course's, each under one name.

The course's keys stay at the top level of `model.init_args` (`group_size`, `ppo_epochs`, `clip_eps`, `kl_coef`,
`lr`, `minibatch_size`, `grad_accum_steps`, `warmup_steps`, the sampling keys, ...); the rest sit in these groups,
each a frozen dataclass that jsonargparse reads as nested keys (`--model.init_args.evaluation.every 5`):

    evaluation        when and how the policy is evaluated
    correction        the importance correction against the rollout engine's sampler, and the off-policy mask
    speed             levers that change the cost of an iteration, not what it computes (to float rounding)
    vllm              the vLLM engine's memory and batching
    log_generations   the sampled-completion tables

The policy objective is a group of its own, chosen by class (`llm_pg.core.objectives`). A config written before the
groups still loads: `llm_pg.runs.spelling` moves its flat keys here and says so in one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from llm_pg.core.correction import SamplerCorrection, SamplerIsMode


@dataclass(frozen=True)
class Evaluation:
    """When and how the policy is evaluated (`llm_pg.callbacks.evaluation`).

    Args:
        every: greedy evaluation every this many iterations (and at iteration 0 and the end).
        max_new_tokens: the generation budget of an evaluation (null: the rollouts' `max_new_tokens`).
        generate_batch_size: prompts per generate call of an evaluation, sized for memory (null: the whole eval set
            in one call with vLLM, `speed.logprob_batch_size` prompts with HF; with `samples: k`, that many rows).
        samples: k > 0 also samples k completions per eval prompt at `temperature` and logs `eval/pass_at_1` and
            `eval/pass_at_k` (0: greedy evaluation only). See docs/algorithms.md, "Variants".
        temperature: the sampling temperature of the `samples` completions.
    """

    every: int = 10
    max_new_tokens: int | None = None
    generate_batch_size: int | None = None
    samples: int = 0
    temperature: float = 1.0


@dataclass(frozen=True)
class Correction:
    """The policy term's importance correction against the rollout engine's sampler (docs/algorithms.md, "TIS").

    Args:
        mode: null (off, the course) | `token_truncate` | `token_mask` (a weight `exp(old_logp - sampler_logp)` per
            token) | `sequence_truncate` | `sequence_mask` (one per completion: the product over its tokens),
            truncated to `[min, max]` or set to 0 outside it (`llm_pg.core.correction.sampler_is_weight`; TRL's
            `vllm_importance_sampling_mode`). `sampler_logp` is the engine's own log-prob of the token (vLLM; with HF
            the weight is exactly 1, so the sequence modes need `rollout_engine: vllm`). Logs
            `rollout/tis_weight_mean` and `rollout/tis_clipped_frac` or `rollout/tis_masked_frac`.
        max: the weight's upper bound (>= 1); `mode: token_truncate, max: C` is truncated importance sampling.
        min: its lower bound (null: none; else in (0, 1]).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence masking (null: off): a completion with a
            negative advantage whose mean per-token `log pi_sampler - log pi_theta` exceeds this value leaves the
            policy term (`llm_pg.core.correction.off_policy_keep`; TRL's `off_policy_mask_threshold`); pi_sampler is
            the engine's log-probs, or pi_old with HF. Logs `train/off_policy_masked_frac`.
    """

    mode: SamplerIsMode | None = None
    max: float = 2.0
    min: float | None = None
    off_policy_mask_threshold: float | None = None

    def sampler(self) -> SamplerCorrection | None:
        """The weight's settings for the objective (`llm_pg.core.correction.SamplerCorrection`), or None when off."""
        return None if self.mode is None else SamplerCorrection(self.mode, self.max, self.min)


@dataclass(frozen=True)
class Speed:
    """Levers of what an iteration costs. Each computes the same step to float rounding, except
    `share_prompt_dropout` (correlated dropout masks: the same expected gradient, another variance) and
    `reuse_first_pass_logp` (pi_old of the dropout-perturbed policy), which say so below.

    Args:
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        logprob_batch_size: rows per no-grad forward pass for old/reference log-probs.
        logprob_chunk_size: token positions per chunk of the LM head and log-softmax, recomputed in the backward
            (`llm_pg.core.chunked_logprobs`), so no `[rows, positions, vocabulary]` logits tensor is held. A forward
            without prefix sharing then also packs each row's tokens to the left (`logprobs.packed_layout`). 0: the
            plain path, one head call over the whole micro-batch.
        pack_sequences: with the chunked head, run a forward's rows as a few packed sequences of their real tokens
            under a block-diagonal causal mask (`llm_pg.modules.packing`; SDPA or eager attention), so the layers and
            the head touch no padding; prefix sharing still runs each prompt once. false: rows padded to the longest.
        share_prompt_prefix: run each distinct prompt of a forward once and its completions on its cached keys and
            values (`llm_pg.modules.logprobs`): the same log-probs and gradients up to float rounding, fewer tokens.
        share_prompt_dropout: let prefix sharing run in a training forward with dropout (LoRA's 0.05): the rows of a
            prompt then share one dropout mask on its tokens, which changes only the gradient's variance (each row's
            mask is still a fresh draw, marginally); false draws a mask per row, as the course does. Non-reentrant
            gradient checkpointing shares too.
        group_by_length: when a pass is one optimizer step and prefix sharing does not apply to its forwards, run rows
            of similar length together (`update.forward_rows`): the same step to float rounding, less padding.
        compile_generation: with `rollout_engine: hf`, run `generate`'s decode steps through `torch.compile`
            (dynamic shapes; `llm_pg.models.decoding.compiled_forward`); training forwards stay eager. The logits
            are eager's to float rounding, so a sampled token can in principle differ from an eager run's.
        reuse_first_pass_logp: take pi_old from the update's first pass even when the policy has dropout (an
            objective with a ratio, one optimizer step per pass): one forward fewer per iteration, pi_old then of the
            dropout-perturbed policy (docs/algorithms.md).
    """

    gradient_checkpointing: bool = False
    logprob_batch_size: int = 32
    logprob_chunk_size: int = 256
    pack_sequences: bool = True
    share_prompt_prefix: bool = True
    share_prompt_dropout: bool = True
    group_by_length: bool = True
    compile_generation: bool = False
    reuse_first_pass_logp: bool = False


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's memory and batching (`rollout_engine: vllm`; `llm_pg.engines.vllm.VLLMEngine`).

    Args:
        gpu_memory_utilization: the share of the GPU vLLM may take (what fits beside training: docs/runs.md).
        kv_cache_memory_bytes: a fixed KV cache size instead (null: from the share; on the CPU the share is of the
            machine's memory).
        max_num_batched_tokens: tokens per vLLM step (null: vLLM's default; on the CPU give at least the rollout's
            prompt tokens, rows x padded prompt length).
    """

    gpu_memory_utilization: float = 0.3
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class GenerationTables:
    """The sampled-completion tables (`llm_pg.callbacks.generations`).

    Args:
        every: iterations between tables (0: never).
        rows: rows per table, in whole prompt groups (at least one group).
    """

    every: int = 10
    rows: int = 24


GROUPS: dict[str, type] = {
    "evaluation": Evaluation,
    "correction": Correction,
    "speed": Speed,
    "vllm": VLLMSettings,
    "log_generations": GenerationTables,
}

Group = TypeVar("Group")


def as_group(cls: type[Group], value: Group | dict[str, Any] | None, name: str) -> Group:
    """`value` as a `cls`: itself, the defaults for None, or built from a mapping (a Python caller's dict), with a
    one-line error that names the unknown key."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"model.{name}.{unknown[0]} is not a key of {name}; its keys: {', '.join(sorted(known))}")
        return cls(**value)
    raise ValueError(f"model.{name} must be a mapping of {', '.join(f.name for f in fields(cls))}, got {value!r}")


def flat_settings(groups: dict[str, Any]) -> dict[str, Any]:
    """The groups' keys as dotted names (`evaluation.every`), for the settings checks."""
    return {f"{name}.{key}": value for name, group in groups.items() for key, value in asdict(group).items()}
