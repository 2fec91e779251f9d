"""Configs and checkpoints written before the settings were grouped (2026-12-05) still load.

The module's keys were 62 flat names; the ones that are not the course's now sit in typed groups
(`llm_pg.modules.groups`) and the policy objective is chosen by class (`llm_pg.core.objectives`). This module moves
an old spelling to the new one, wherever a config comes from: a YAML file (`load_config`, the CLI's loader), the
command line (`upgrade_args`), a checkpoint's stored config or a run's `config.yaml` (`upgrade_config`). Each move
is said once, in one line, with the new spelling; a key spelled both ways is refused, naming both.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from llm_pg.core.objectives import OBJECTIVES

# model.init_args: old flat key -> (group, key in the group)
MOVED = {
    "eval_every": ("evaluation", "every"),
    "eval_max_new_tokens": ("evaluation", "max_new_tokens"),
    "eval_batch_size": ("evaluation", "generate_batch_size"),
    "eval_samples": ("evaluation", "samples"),
    "eval_temperature": ("evaluation", "temperature"),
    "sampler_is_mode": ("correction", "mode"),
    "sampler_is_max": ("correction", "max"),
    "sampler_is_min": ("correction", "min"),
    "off_policy_mask_threshold": ("correction", "off_policy_mask_threshold"),
    "gradient_checkpointing": ("speed", "gradient_checkpointing"),
    "logprob_batch_size": ("speed", "logprob_batch_size"),
    "logprob_chunk_size": ("speed", "logprob_chunk_size"),
    "share_prompt_prefix": ("speed", "share_prompt_prefix"),
    "share_prompt_dropout": ("speed", "share_prompt_dropout"),
    "group_by_length": ("speed", "group_by_length"),
    "compile_generation": ("speed", "compile_generation"),
    "reuse_first_pass_logp": ("speed", "reuse_first_pass_logp"),
    "vllm_gpu_memory_utilization": ("vllm", "gpu_memory_utilization"),
    "vllm_kv_cache_memory_bytes": ("vllm", "kv_cache_memory_bytes"),
    "vllm_max_num_batched_tokens": ("vllm", "max_num_batched_tokens"),
    "log_generations_every": ("log_generations", "every"),
    "log_generations_rows": ("log_generations", "rows"),
}
# model.init_args: old flat key -> the objective's own key (`objective.init_args`)
OBJECTIVE_KEYS = {
    "loss_aggregation": "aggregation",
    "entropy_coef": "entropy_coef",
    "clip_eps_high": "clip_eps_high",
    "ratio_level": "ratio_level",
}
DATA_MOVED = {"eval_batch_size": "validate_batch_size"}
# A short objective name (`objective: cispo`) -> its class path, the form jsonargparse takes.
OBJECTIVE_PATHS = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in OBJECTIVES.items()}
# ReinforceModule took these GRPO keys until 2026-12-03 only to refuse any other value than this one.
REINFORCE_RETIRED = {"ppo_epochs": 1, "clip_eps_high": None, "ratio_level": None, "reuse_first_pass_logp": None}

_said: set[str] = set()


def note(message: str) -> None:
    """Say `message` on stderr, once per process."""
    if message not in _said:
        _said.add(message)
        print(f"llm-pg: note: {message}", file=sys.stderr, flush=True)


def _objective(init_args: dict[str, Any], reinforce: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """The `objective` value that the old objective keys of `init_args` spell (None: none of them is there), and the
    old keys it replaces. `policy_loss: clip` with `ratio_level: sequence` is GSPO."""
    old = [key for key in ("policy_loss", *OBJECTIVE_KEYS) if key in init_args]
    if not old:
        return None, []
    loss = init_args.get("policy_loss") or ("sequence_mean" if reinforce else "clip")
    own = {OBJECTIVE_KEYS[k]: init_args[k] for k in OBJECTIVE_KEYS if k in init_args}
    if loss == "clip" and own.get("ratio_level") == "sequence":
        loss = "gspo"
    if loss != "cispo":
        own.pop("ratio_level", None)  # the class says it (GSPO's sequence, the clipped surrogate's token)
    if loss == "sequence_mean":
        own.pop("clip_eps_high", None)
    return {"class_path": OBJECTIVE_PATHS.get(loss, loss), "init_args": own}, old


def upgrade_model_args(init_args: dict[str, Any], class_path: str | None) -> list[str]:
    """Move the old keys of a module's `init_args` (in place) to their groups; the moves, as `old -> new` phrases."""
    reinforce = str(class_path or "").endswith("ReinforceModule")
    moves = []
    if reinforce:
        for key, value in REINFORCE_RETIRED.items():
            if key in init_args and init_args[key] == value and key != "ppo_epochs":
                del init_args[key]
        if init_args.get("ppo_epochs") == 1:
            del init_args["ppo_epochs"]
    objective, replaced = _objective(init_args, reinforce)
    if objective is not None:
        if isinstance(init_args.get("objective"), dict | str):
            raise ValueError(
                f"model.init_args sets objective and its old spelling ({', '.join(replaced)}) both: keep objective"
            )
        for key in replaced:
            del init_args[key]
        init_args["objective"] = objective
        moves += [
            f"{key} -> objective: {objective['class_path'].rpartition('.')[2]}"
            if key in ("policy_loss", "ratio_level")
            else f"{key} -> objective.init_args.{OBJECTIVE_KEYS[key]}"
            for key in replaced
        ]
    if "tis_cap" in init_args:
        cap = init_args.pop("tis_cap")
        if cap is not None:
            if init_args.get("sampler_is_mode") is not None:
                raise ValueError("model.init_args.tis_cap and sampler_is_mode are both set: keep correction.mode")
            init_args["sampler_is_mode"], init_args["sampler_is_max"] = "token_truncate", cap
        moves.append(f"tis_cap: {cap} -> correction: {{mode: token_truncate, max: {cap}}}" if cap is not None else "")
    if isinstance(init_args.get("objective"), str) and init_args["objective"] in OBJECTIVE_PATHS:
        init_args["objective"] = {"class_path": OBJECTIVE_PATHS[init_args["objective"]]}
    for old, (group, key) in MOVED.items():
        if old not in init_args:
            continue
        value = init_args.pop(old)
        node = init_args.setdefault(group, {})
        if not isinstance(node, dict):
            node = init_args[group] = {}
        if key in node and node[key] != value:
            raise ValueError(f"model.init_args sets {group}.{key} and its old spelling {old} both: keep {group}.{key}")
        node[key] = value
        if not (old.startswith("sampler_is_") and "tis_cap" in " ".join(moves)):
            moves.append(f"{old} -> {group}.{key}")
    return [move for move in moves if move]


def upgrade_config(config: Any) -> list[str]:
    """Move the old keys of a whole config (`model`, `data`; in place) to the new spelling; the moves made."""
    if not isinstance(config, dict):
        return []
    moves = []
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_args"), dict):
        moves += [f"model.init_args.{m}" for m in upgrade_model_args(model["init_args"], model.get("class_path"))]
    data = config.get("data")
    if isinstance(data, dict):
        for old, new in DATA_MOVED.items():
            if old in data:
                if new in data:
                    raise ValueError(f"data sets {new} and its old spelling {old} both: keep {new}")
                data[new] = data.pop(old)
                moves.append(f"data.{old} -> data.{new}")
    return moves


def load_config(text: str) -> Any:
    """The CLI's YAML loader: a config file (or any value jsonargparse parses) as YAML, in the new spelling, with a
    one-line note for each old key moved."""
    value = yaml.safe_load(text)
    if isinstance(value, dict) and ("model" in value or "data" in value):
        moves = upgrade_config(value)
        if moves:
            note(f"this config uses the spelling from before 2026-12-05, read as: {'; '.join(moves)}")
    return value


def upgrade_args(args: list[str]) -> list[str]:
    """Command-line words in the new spelling: `--model.init_args.<old> V` (or `=V`) moved to its group, and a short
    objective name made its class path; each move said in one line."""
    prefix, out, moves = "--model.init_args.", [], []
    words = list(args)
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        takes_next = not eq and i + 1 < len(words)
        if not name.startswith(prefix) and name != "--data.eval_batch_size":
            out.append(word)
            i += 1
            continue
        if not eq and not takes_next:
            out.append(word)
            break
        if not eq:
            value = words[i + 1]
        key = name.removeprefix(prefix)
        new = _upgrade_flag(key, value) if name.startswith(prefix) else [("--data.validate_batch_size", value)]
        if new is None:
            out.extend([word] if eq else [word, value])
        else:
            out.extend(f"{flag}={val}" for flag, val in new)
            if key != "objective":  # a short objective name is today's spelling: made its class path silently
                moves.append(f"{name} -> {' '.join(flag for flag, _ in new)}")
        i += 1 if eq else 2
    if moves:
        note(f"the command line uses the spelling from before 2026-12-05, read as: {'; '.join(moves)}")
    return out


def _upgrade_flag(key: str, value: str) -> list[tuple[str, str]] | None:
    """The new flags for `--model.init_args.<key> value`, or None when the key is spelled the new way."""
    prefix = "--model.init_args."
    if key == "objective" and value in OBJECTIVE_PATHS:
        return [(f"{prefix}objective", OBJECTIVE_PATHS[value])]
    if key == "policy_loss":
        return [(f"{prefix}objective", OBJECTIVE_PATHS.get(value, value))]
    if key == "ratio_level":
        return [(f"{prefix}objective", OBJECTIVE_PATHS["gspo"])] if value == "sequence" else []
    if key in OBJECTIVE_KEYS:
        return [(f"{prefix}objective.init_args.{OBJECTIVE_KEYS[key]}", value)]
    if key == "tis_cap":
        if value in ("null", "None", "~", ""):
            return [(f"{prefix}correction.mode", "null")]
        return [(f"{prefix}correction.mode", "token_truncate"), (f"{prefix}correction.max", value)]
    if key in MOVED:
        group, name = MOVED[key]
        return [(f"{prefix}{group}.{name}", value)]
    return None
