"""Checks of the `model.init_args` keys, run in the module's constructor before anything is loaded.

Each failure is one line: `model.<key> must be <rule>, got <value>; <how to fix it>`.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Literal, get_args

from llm_pg.core.advantages import ADVANTAGE_ESTIMATORS
from llm_pg.core.correction import SAMPLER_IS_MODES
from llm_pg.core.losses import LOSS_AGGREGATIONS, RATIO_LEVELS
from llm_pg.core.objectives import POLICY_LOSSES
from llm_pg.core.schedule import LR_SCHEDULES

COMPUTE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which the update loop does not do
RolloutEngine = Literal["hf", "vllm"]
ROLLOUT_ENGINES = get_args(RolloutEngine)


def _fail(key: str, rule: str, value: Any, fix: str) -> None:
    raise ValueError(f"model.{key} must be {rule}, got {value!r}; {fix}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _at_least(key: str, value: Any, low: float, fix: str) -> None:
    if not (_number(value) and value >= low):
        _fail(key, f">= {low}", value, fix)


def _above(key: str, value: Any, low: float, fix: str) -> None:
    if not (_number(value) and value > low):
        _fail(key, f"> {low}", value, fix)


def _below(key: str, value: Any, low: float, high: float, fix: str, low_included: bool = False) -> None:
    """`low < value < high` (`low <= value` when `low_included`): the upper bound is where no value can be meant."""
    if not (_number(value) and (low <= value if low_included else low < value) and value < high):
        _fail(key, f"{'>=' if low_included else '>'} {low:g} and < {high:g}", value, fix)


def check_settings(hp: dict[str, Any]) -> None:
    """Raise ValueError for the first key of `hp` (a module's init args) whose value cannot work."""
    _check_batches(hp)
    _check_optimizer(hp)
    _check_sampling(hp)
    _check_loss_terms(hp)
    _check_logging_and_guards(hp)
    check_variant_settings(hp)
    check_engine_settings(hp)
    _check_lora(hp["lora"])


def _check_batches(hp: dict[str, Any]) -> None:
    """The iteration's shape: iterations, groups, prompts, micro-batches and accumulation."""
    _at_least("iterations", hp["iterations"], 1, "set how many RL iterations to train")
    _at_least("group_size", hp["group_size"], 2, "rewards are normalised within a group of >= 2 completions")
    _at_least("prompts_per_step", hp["prompts_per_step"], 1, "set data.prompts_per_step")
    _at_least("minibatch_size", hp["minibatch_size"], 1, "rows per forward/backward pass")
    _at_least("grad_accum_steps", hp["grad_accum_steps"], 1, "micro-batches per optimizer step")
    rows = hp["prompts_per_step"] * hp["group_size"]
    if hp["minibatch_size"] > rows:
        raise ValueError(
            f"model.minibatch_size={hp['minibatch_size']} is larger than one iteration's {rows} rows "
            f"(prompts_per_step {hp['prompts_per_step']} x group_size {hp['group_size']}); lower minibatch_size"
        )


def _check_optimizer(hp: dict[str, Any]) -> None:
    """The KL weight, AdamW and the learning-rate schedule."""
    _below("kl_coef", hp["kl_coef"], 0, 100, "0: no KL penalty (and no reference); the course uses 0.05", True)
    _below("lr", hp["lr"], 0, 1, "the course uses 3e-5; a rate of 1 or more can only diverge")
    _below("weight_decay", hp["weight_decay"], 0, 1, "AdamW's decoupled decay; the course uses 0", low_included=True)
    _at_least("warmup_steps", hp["warmup_steps"], 0, "0 disables the learning-rate warmup")
    _one_of("lr_schedule", hp["lr_schedule"], LR_SCHEDULES, "constant is the course's; linear and cosine decay")
    if not (_number(hp["min_lr_ratio"]) and 0 <= hp["min_lr_ratio"] <= 1):
        _fail("min_lr_ratio", "in [0, 1]", hp["min_lr_ratio"], "the decay's floor as a share of lr, e.g. 0.1")
    if hp["lr_schedule"] == "constant" and hp["min_lr_ratio"] != 0:
        raise ValueError(
            f"model.min_lr_ratio={hp['min_lr_ratio']!r} means nothing with lr_schedule 'constant' (no decay); "
            "set model.lr_schedule to linear or cosine, or drop min_lr_ratio"
        )


def _check_sampling(hp: dict[str, Any]) -> None:
    """The gradient clip, the advantage clip, sampling, evaluation and the log-prob passes."""
    _above("max_grad_norm", hp["max_grad_norm"], 0, "the course clips the gradient norm to 0.5")
    _above("adv_clip", hp["adv_clip"], 0, "advantages are clipped to +-adv_clip; the course uses 5.0")
    _below("temperature", hp["temperature"], 0, 100, "sampling needs a positive temperature; the course uses 0.8")
    if not (_number(hp["top_p"]) and 0 < hp["top_p"] <= 1):
        _fail("top_p", "in (0, 1]", hp["top_p"], "1.0 turns nucleus sampling off")
    _at_least("max_new_tokens", hp["max_new_tokens"], 1, "the completion budget in tokens")
    if not (_number(hp["min_new_tokens"]) and 0 <= hp["min_new_tokens"] <= hp["max_new_tokens"]):
        _fail("min_new_tokens", f"in [0, max_new_tokens={hp['max_new_tokens']}]", hp["min_new_tokens"], "0: no minimum")
    if hp["max_prompt_tokens"] is not None:
        _at_least("max_prompt_tokens", hp["max_prompt_tokens"], 1, "null keeps whole prompts")
    _at_least("eval_every", hp["eval_every"], 1, "iterations between greedy evaluations")
    if hp["eval_max_new_tokens"] is not None:
        _at_least("eval_max_new_tokens", hp["eval_max_new_tokens"], 1, "null uses max_new_tokens")
    _at_least("logprob_batch_size", hp["logprob_batch_size"], 1, "rows per no-grad forward pass")
    _at_least("logprob_chunk_size", hp["logprob_chunk_size"], 0, "positions per LM-head chunk; 0: one head call")
    if hp["eval_batch_size"] is not None:
        _at_least("eval_batch_size", hp["eval_batch_size"], 1, "prompts per eval generate call; null: engine default")


def _check_loss_terms(hp: dict[str, Any]) -> None:
    """The entropy bonus, the overlong punishment and the sampler correction."""
    _below("entropy_coef", hp["entropy_coef"], 0, 1, "the entropy bonus's weight; 0 turns it off", True)
    if not (isinstance(hp["overlong_buffer"], int) and 0 <= hp["overlong_buffer"] <= hp["max_new_tokens"]):
        _fail(
            "overlong_buffer",
            f"an integer in [0, max_new_tokens={hp['max_new_tokens']}]",
            hp["overlong_buffer"],
            "the last tokens before max_new_tokens over which the overlong punishment grows; 0 turns it off",
        )
    _at_least("overlong_penalty", hp["overlong_penalty"], 0, "the punishment at max_new_tokens, e.g. 1.0")
    if hp["tis_cap"] is not None:
        _at_least("tis_cap", hp["tis_cap"], 1, "the truncation C of min(exp(old_logp - sampler_logp), C), e.g. 2.0")
    check_sampler_correction(hp)


def _check_logging_and_guards(hp: dict[str, Any]) -> None:
    """Completion tables, the divergence guard, the seed, log-prob T and the dtype."""
    _at_least("log_generations_every", hp["log_generations_every"], 0, "0 logs no completion tables")
    table_rows = hp["log_generations_rows"]
    if not (isinstance(table_rows, int) and not isinstance(table_rows, bool) and table_rows >= 1):
        _fail(
            "log_generations_rows", "an integer >= 1", table_rows, "rows per completion table, in whole prompt groups"
        )
    if not (isinstance(hp["max_skipped_iterations"], int) and hp["max_skipped_iterations"] >= 1):
        _fail(
            "max_skipped_iterations",
            "an integer >= 1",
            hp["max_skipped_iterations"],
            "consecutive iterations of only skipped (non-finite) steps before the run stops; 3 by default",
        )
    if not (isinstance(hp["seed"], int) and hp["seed"] >= 0):
        _fail("seed", ">= 0", hp["seed"], "set the top-level `seed` to a non-negative integer")
    if hp["logprob_temperature"] is not None:
        _above(
            "logprob_temperature", hp["logprob_temperature"], 0, "1.0 (raw logits, the course) or null (= temperature)"
        )
    if hp["dtype"] is not None and hp["dtype"] not in (*COMPUTE_DTYPES, "auto"):
        _fail(
            "dtype",
            f"one of {COMPUTE_DTYPES}",
            hp["dtype"],
            "auto (bf16 where bf16 matmuls are faster) or null (bfloat16 on a GPU, float32 on the CPU)",
        )


def _check_lora(lora) -> None:
    """The LoRA settings, when given."""
    if lora is not None:
        _at_least("lora.r", lora.r, 0, "0 trains every weight (full fine-tuning); the course uses 16")
        _above("lora.alpha", lora.alpha, 0, "the adapter scale is alpha / r; the course uses 32")
        if not (_number(lora.dropout) and 0 <= lora.dropout < 1):
            _fail("lora.dropout", "in [0, 1)", lora.dropout, "the course uses 0.05")
        if lora.r > 0 and not lora.target_modules:
            _fail("lora.target_modules", "non-empty", lora.target_modules, "name the projections to adapt, e.g. q_proj")


def check_sampler_correction(hp: dict[str, Any]) -> None:
    """`sampler_is_mode` with its bounds, and `off_policy_mask_threshold` (docs/algorithms.md, "TIS")."""
    mode = hp["sampler_is_mode"]
    if mode is not None:
        _one_of("sampler_is_mode", mode, SAMPLER_IS_MODES, "or null (off); tis_cap is the token_truncate shorthand")
    _at_least("sampler_is_max", hp["sampler_is_max"], 1, "the upper bound of the importance weight, e.g. 2.0")
    low = hp["sampler_is_min"]
    if low is not None and not (_number(low) and 0 < low <= 1):
        _fail("sampler_is_min", "in (0, 1] or null", low, "the lower bound of the importance weight, e.g. 0.5")
    if mode is None and (low is not None or hp["sampler_is_max"] != 2.0):
        raise ValueError(
            "model.sampler_is_min / sampler_is_max bound the weight of sampler_is_mode, which is null: set "
            "model.sampler_is_mode (token_truncate, token_mask, sequence_truncate or sequence_mask), or drop the bound"
        )
    if mode is not None and hp["tis_cap"] is not None:
        raise ValueError(
            f"model.tis_cap={hp['tis_cap']!r} is the shorthand of sampler_is_mode: token_truncate, and "
            f"sampler_is_mode is {mode!r} too: keep one (tis_cap: C is sampler_is_mode: token_truncate with "
            "sampler_is_max: C)"
        )
    if mode is not None and mode.startswith("sequence") and hp["rollout_engine"] != "vllm":
        raise ValueError(
            f"model.sampler_is_mode={mode!r} corrects for a rollout engine that samples apart from the trainer, but "
            f"rollout_engine is {hp['rollout_engine']!r}, which samples with the policy itself (every weight would be "
            "exactly 1): set model.rollout_engine: vllm, or sampler_is_mode: null"
        )
    threshold = hp["off_policy_mask_threshold"]
    if threshold is not None:
        _at_least(
            "off_policy_mask_threshold", threshold, 0, "the mean log-ratio above which a sequence drops, e.g. 0.5"
        )


def check_off_policy_mask(hp: dict[str, Any], has_pi_old: bool) -> None:
    """An off-policy mask needs something to be off-policy from: pi_old (GRPO) or the engine's sampler (vLLM)."""
    if hp["off_policy_mask_threshold"] is not None and not has_pi_old and hp["rollout_engine"] != "vllm":
        raise ValueError(
            "model.off_policy_mask_threshold is set, but REINFORCE with rollout_engine hf trains on the policy's own "
            "samples in one pass: no sequence is ever off-policy; use rollout_engine: vllm or GRPOModule, or drop it"
        )


def _one_of(key: str, value: Any, names: tuple[str, ...], fix: str) -> None:
    if value not in names:
        _fail(key, f"one of {', '.join(names)}", value, fix)


def _flag(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(key, "true or false", value, "a YAML boolean")


def check_variant_settings(hp: dict[str, Any]) -> None:
    """The algorithm-variant keys both modules take (docs/algorithms.md, "Variants")."""
    _one_of("advantage", hp["advantage"], ADVANTAGE_ESTIMATORS, "grpo is the course's estimator")
    _one_of(
        "loss_aggregation", hp["loss_aggregation"], LOSS_AGGREGATIONS, "seq_mean_token_mean is the course's reduction"
    )
    _flag("filter_zero_std_groups", hp["filter_zero_std_groups"])
    rounds = hp["max_sampling_rounds"]
    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1):
        _fail(
            "max_sampling_rounds",
            "an integer >= 1",
            rounds,
            "prompt batches sampled per iteration at most; 1: no refill",
        )
    if rounds > 1 and not hp["filter_zero_std_groups"]:
        raise ValueError(
            f"model.max_sampling_rounds={rounds} refills the groups that filter_zero_std_groups drops, but "
            "filter_zero_std_groups is false: set model.filter_zero_std_groups: true, or max_sampling_rounds: 1"
        )
    _flag("mask_truncated", hp["mask_truncated"])
    _flag("share_prompt_prefix", hp["share_prompt_prefix"])
    _flag("group_by_length", hp["group_by_length"])
    _flag("share_prompt_dropout", hp["share_prompt_dropout"])
    if not (
        isinstance(hp["eval_samples"], int) and not isinstance(hp["eval_samples"], bool) and hp["eval_samples"] >= 0
    ):
        _fail(
            "eval_samples", "an integer >= 0", hp["eval_samples"], "0: greedy evaluation only; k > 0 adds pass@1/pass@k"
        )
    _above("eval_temperature", hp["eval_temperature"], 0, "the sampling temperature of eval_samples; 1.0 by default")


def check_engine_settings(hp: dict[str, Any]) -> None:
    """`rollout_engine` and the `vllm_*` keys; with `vllm`, that vLLM is installed and can report the log-probs of
    `logprob_temperature` (docs/runs.md, "vLLM rollouts")."""
    _one_of("rollout_engine", hp["rollout_engine"], ROLLOUT_ENGINES, "hf (default) samples with HF generate")
    if not (_number(hp["vllm_gpu_memory_utilization"]) and 0 < hp["vllm_gpu_memory_utilization"] < 1):
        _fail(
            "vllm_gpu_memory_utilization",
            "in (0, 1)",
            hp["vllm_gpu_memory_utilization"],
            "the share of the GPU vLLM takes beside training, e.g. 0.3",
        )
    for key in ("vllm_kv_cache_memory_bytes", "vllm_max_num_batched_tokens"):
        if hp[key] is not None:
            _at_least(key, hp[key], 1, "null keeps vLLM's default")
    _flag("compile_generation", hp["compile_generation"])
    if hp["rollout_engine"] != "vllm":
        return
    if hp["compile_generation"]:
        raise ValueError(
            "model.compile_generation=true compiles HF generate's decode steps, but rollout_engine is vllm, which "
            "samples with graphs of its own: set compile_generation: false, or rollout_engine: hf"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            'model.rollout_engine=vllm but vLLM is not installed; pip install -e ".[vllm]" on a GPU machine, '
            "`make test-vllm` builds a CPU environment (.venv-vllm), or use rollout_engine: hf"
        )
    from llm_pg.engines.vllm import vllm_logprobs_mode  # raises for a logprob_temperature vLLM cannot report

    vllm_logprobs_mode(hp["logprob_temperature"], hp["temperature"])


def check_grpo_settings(
    ppo_epochs: Any,
    clip_eps: Any,
    clip_eps_high: Any = None,
    ratio_level: Any = "token",
    reuse_first_pass_logp: Any = False,
    policy_loss: Any = "clip",
) -> None:
    """The keys only GRPO has."""
    if not (isinstance(ppo_epochs, int) and ppo_epochs >= 1):
        _fail("ppo_epochs", ">= 1", ppo_epochs, "passes over each rollout; the course uses 2")
    if not (_number(clip_eps) and 0 < clip_eps < 1):
        _fail(
            "clip_eps",
            "in (0, 1)",
            clip_eps,
            "the ratio is clipped to [1 - clip_eps, 1 + clip_eps]; the course uses 0.2",
        )
    if clip_eps_high is not None and not (_number(clip_eps_high) and clip_eps_high > 0):
        _fail("clip_eps_high", "> 0 or null", clip_eps_high, "the upper clip 1 + clip_eps_high; null = clip_eps")
    _one_of("ratio_level", ratio_level, RATIO_LEVELS, "token is the course's per-token ratio; sequence is GSPO's")
    _flag("reuse_first_pass_logp", reuse_first_pass_logp)
    _one_of("policy_loss", policy_loss, POLICY_LOSSES, "clip is GRPO's clipped surrogate; cispo is CISPO's")


GRPO_KEYS = ("ppo_epochs", "clip_eps", "clip_eps_high", "ratio_level", "reuse_first_pass_logp", "policy_loss")


def grpo_key_hint(message: str) -> str:
    """`message` (a config parse error), with the fix added when it refuses a GRPO key set for ReinforceModule."""
    for key in GRPO_KEYS:
        if "ReinforceModule" in message and f"Option '{key}' is not accepted" in message:
            return (
                f"{message}: model.{key} is a GRPOModule key, and REINFORCE makes one on-policy pass with no ratio "
                f"to clip or reuse; remove {key}, or use llm_pg.modules.GRPOModule"
            )
    return message
