"""Checks of the `model.init_args` keys, run in the module's constructor before anything is loaded.

Each failure is one line: `model.<key> must be <rule>, got <value>; <how to fix it>`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from typing import Any, Literal, NoReturn, get_args

from llm_pg.core.advantages import ADVANTAGE_ESTIMATORS
from llm_pg.core.correction import SAMPLER_IS_MODES, SEQUENCE_MODES
from llm_pg.core.losses import LOSS_AGGREGATIONS, RATIO_LEVELS
from llm_pg.core.objectives import CISPO, OBJECTIVES, LossTerms, Objective
from llm_pg.core.schedule import LR_SCHEDULES

COMPUTE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which the update loop does not do
RolloutEngine = Literal["hf", "vllm"]
ROLLOUT_ENGINES = get_args(RolloutEngine)


def _fail(key: str, rule: str, value: Any, fix: str) -> NoReturn:
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
    _at_least("evaluation.every", hp["evaluation.every"], 1, "iterations between greedy evaluations")
    if hp["evaluation.max_new_tokens"] is not None:
        _at_least("evaluation.max_new_tokens", hp["evaluation.max_new_tokens"], 1, "null uses max_new_tokens")
    _at_least("speed.logprob_batch_size", hp["speed.logprob_batch_size"], 1, "rows per no-grad forward pass")
    _at_least(
        "speed.logprob_chunk_size", hp["speed.logprob_chunk_size"], 0, "positions per LM-head chunk; 0: one head call"
    )
    if hp["evaluation.generate_batch_size"] is not None:
        _at_least(
            "evaluation.generate_batch_size",
            hp["evaluation.generate_batch_size"],
            1,
            "prompts per eval generate call; null: the engine's default",
        )


def _check_loss_terms(hp: dict[str, Any]) -> None:
    """The clip range, the overlong punishment and the sampler correction."""
    if not (_number(hp["clip_eps"]) and 0 < hp["clip_eps"] < 1):
        _fail(
            "clip_eps",
            "in (0, 1)",
            hp["clip_eps"],
            "the ratio is clipped to [1 - clip_eps, 1 + clip_eps]; the course uses 0.2",
        )
    if not (isinstance(hp["overlong_buffer"], int) and 0 <= hp["overlong_buffer"] <= hp["max_new_tokens"]):
        _fail(
            "overlong_buffer",
            f"an integer in [0, max_new_tokens={hp['max_new_tokens']}]",
            hp["overlong_buffer"],
            "the last tokens before max_new_tokens over which the overlong punishment grows; 0 turns it off",
        )
    _at_least("overlong_penalty", hp["overlong_penalty"], 0, "the punishment at max_new_tokens, e.g. 1.0")
    check_sampler_correction(hp)


def _check_logging_and_guards(hp: dict[str, Any]) -> None:
    """Completion tables, the divergence guard, the seed, log-prob T and the dtype."""
    _at_least("log_generations.every", hp["log_generations.every"], 0, "0 logs no completion tables")
    table_rows = hp["log_generations.rows"]
    if not (isinstance(table_rows, int) and not isinstance(table_rows, bool) and table_rows >= 1):
        _fail(
            "log_generations.rows", "an integer >= 1", table_rows, "rows per completion table, in whole prompt groups"
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
    """The `correction` group: the mode with its bounds, and the off-policy mask (docs/algorithms.md, "TIS")."""
    mode = hp["correction.mode"]
    if mode is not None:
        _one_of("correction.mode", mode, SAMPLER_IS_MODES, "or null (off); token_truncate is TIS")
    _at_least("correction.max", hp["correction.max"], 1, "the upper bound of the importance weight, e.g. 2.0")
    low = hp["correction.min"]
    if low is not None and not (_number(low) and 0 < low <= 1):
        _fail("correction.min", "in (0, 1] or null", low, "the lower bound of the importance weight, e.g. 0.5")
    if mode is None and (low is not None or hp["correction.max"] != 2.0):
        raise ValueError(
            "model.correction.min / correction.max bound the weight of correction.mode, which is null: set "
            "model.correction.mode (token_truncate, token_mask, sequence_truncate or sequence_mask), or drop the bound"
        )
    if mode in SEQUENCE_MODES and hp["rollout_engine"] != "vllm":
        raise ValueError(
            f"model.correction.mode={mode!r} corrects for a rollout engine that samples apart from the trainer, but "
            f"rollout_engine is {hp['rollout_engine']!r}, which samples with the policy itself (every weight would be "
            "exactly 1): set model.rollout_engine: vllm, or correction.mode: null"
        )
    threshold = hp["correction.off_policy_mask_threshold"]
    if threshold is not None:
        _at_least(
            "correction.off_policy_mask_threshold",
            threshold,
            0,
            "the mean log-ratio above which a sequence drops, e.g. 0.5",
        )


def check_off_policy_mask(hp: dict[str, Any], correction: Any, has_pi_old: bool) -> None:
    """An off-policy mask needs something to be off-policy from: pi_old (an objective with a ratio) or the engine's
    sampler (vLLM)."""
    if correction.off_policy_mask_threshold is not None and not has_pi_old and hp["rollout_engine"] != "vllm":
        raise ValueError(
            "model.correction.off_policy_mask_threshold is set, but an objective without a ratio (sequence_mean) "
            "with rollout_engine hf trains on the policy's own samples in one pass: no sequence is ever off-policy; "
            "use rollout_engine: vllm or an objective with a ratio (GRPOModule), or drop it"
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
    for lever in ("gradient_checkpointing", "share_prompt_prefix", "group_by_length", "share_prompt_dropout"):
        _flag(f"speed.{lever}", hp[f"speed.{lever}"])
    _flag("speed.reuse_first_pass_logp", hp["speed.reuse_first_pass_logp"])
    samples = hp["evaluation.samples"]
    if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0):
        _fail("evaluation.samples", "an integer >= 0", samples, "0: greedy evaluation only; k > 0 adds pass@1/pass@k")
    _above("evaluation.temperature", hp["evaluation.temperature"], 0, "the sampling temperature of evaluation.samples")


def check_engine_settings(hp: dict[str, Any]) -> None:
    """`rollout_engine` and the `vllm` group; with `vllm`, that vLLM is installed and can report the log-probs of
    `logprob_temperature` (docs/runs.md, "vLLM rollouts")."""
    _one_of("rollout_engine", hp["rollout_engine"], ROLLOUT_ENGINES, "hf (default) samples with HF generate")
    share = hp["vllm.gpu_memory_utilization"]
    if not (_number(share) and 0 < share < 1):
        _fail(
            "vllm.gpu_memory_utilization",
            "in (0, 1)",
            share,
            "the share of the GPU vLLM takes beside training, e.g. 0.3",
        )
    for key in ("vllm.kv_cache_memory_bytes", "vllm.max_num_batched_tokens"):
        if hp[key] is not None:
            _at_least(key, hp[key], 1, "null keeps vLLM's default")
    _flag("speed.compile_generation", hp["speed.compile_generation"])
    if hp["rollout_engine"] != "vllm":
        return
    if hp["speed.compile_generation"]:
        raise ValueError(
            "model.speed.compile_generation=true compiles HF generate's decode steps, but rollout_engine is vllm, "
            "which samples with graphs of its own: set speed.compile_generation: false, or rollout_engine: hf"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            'model.rollout_engine=vllm but vLLM is not installed; pip install -e ".[vllm]" on a GPU machine, '
            "`make test-vllm` builds a CPU environment (.venv-vllm), or use rollout_engine: hf"
        )
    from llm_pg.engines.vllm import vllm_logprobs_mode  # raises for a logprob_temperature vLLM cannot report

    vllm_logprobs_mode(hp["logprob_temperature"], hp["temperature"])


def check_grpo_settings(ppo_epochs: Any) -> None:
    """The key only GRPO has."""
    if not (isinstance(ppo_epochs, int) and not isinstance(ppo_epochs, bool) and ppo_epochs >= 1):
        _fail("ppo_epochs", ">= 1", ppo_epochs, "passes over each rollout; the course uses 2")


def objective_factory(objective: Any) -> Callable[[LossTerms], Objective]:
    """The `objective` key as what builds the objective from `LossTerms`: jsonargparse's callable, an objective
    class, or a short name of `OBJECTIVES` (a Python caller's)."""
    if isinstance(objective, str):
        if objective not in OBJECTIVES:
            _fail(
                "objective",
                f"one of {', '.join(OBJECTIVES)} or a class of llm_pg.core.objectives",
                objective,
                "clip is GRPO's",
            )
        return OBJECTIVES[objective]
    if callable(objective):
        return objective
    _fail("objective", "an objective class (class_path) or a short name", objective, "e.g. objective: clip")


def objective_config(objective: Objective) -> dict[str, Any]:
    """`objective` as a config spells it: `{class_path, init_args}`, its own settings without the module's terms."""
    cls = type(objective)
    own = {f.name: getattr(objective, f.name) for f in dataclasses.fields(objective) if f.name != "terms"}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": own}


def check_objective(objective: Objective) -> None:
    """The objective's own settings (`objective.init_args`)."""
    _one_of(
        "objective.init_args.aggregation",
        objective.aggregation,
        LOSS_AGGREGATIONS,
        "seq_mean_token_mean is the course's reduction",
    )
    _below(
        "objective.init_args.entropy_coef",
        objective.entropy_coef,
        0,
        1,
        "the entropy bonus's weight; 0 turns it off",
        True,
    )
    high = getattr(objective, "clip_eps_high", None)
    if high is not None and not (_number(high) and high > 0):
        _fail(
            "objective.init_args.clip_eps_high",
            "> 0 or null",
            high,
            "the upper clip 1 + clip_eps_high; null = clip_eps",
        )
    if isinstance(objective, CISPO):
        _one_of("objective.init_args.ratio_level", objective.ratio_level, RATIO_LEVELS, "token, or sequence (GSPO's)")


GRPO_KEYS = ("ppo_epochs",)


def grpo_key_hint(message: str) -> str:
    """`message` (a config parse error), with the fix added when it refuses a GRPO key set for ReinforceModule."""
    for key in GRPO_KEYS:
        if "ReinforceModule" in message and f"Option '{key}' is not accepted" in message:
            return (
                f"{message}: model.{key} is a GRPOModule key, and REINFORCE makes one pass over each rollout; "
                f"remove {key}, or use llm_pg.modules.GRPOModule"
            )
    return message
