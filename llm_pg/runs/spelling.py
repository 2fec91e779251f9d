"""Configs and checkpoints written before the settings were grouped (2026-12-05) still load.

The module's keys were 62 flat names; the ones that are not the course's now sit in typed groups
(`llm_pg.modules.groups`) and the policy objective is chosen by class (`llm_pg.core.objectives`). This module moves
an old spelling to the new one, wherever a config comes from: a YAML file (`load_config`, the CLI's loader), the
command line (`upgrade_args`), a checkpoint's stored config or a run's `config.yaml` (`upgrade_config`). Each move
is said once, in one line, with the new spelling; a key spelled both ways is refused, naming both.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from typing import Any

from jsonargparse import get_loader

from llm_pg.core.objectives import OBJECTIVES, ClippedSurrogate

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
# The objective's own keys at their defaults (the clipped surrogate's, which has all the old keys but ratio_level)
OBJECTIVE_DEFAULTS = {f.name: f.default for f in fields(ClippedSurrogate) if f.default is not MISSING}
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


def _objective(init_args: dict[str, Any], reinforce: bool, stored: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """The `objective` value that the old objective keys of `init_args` spell (None: none of them is there), and the
    old keys it replaces. `policy_loss: clip` with `ratio_level: sequence` is GSPO. Without `policy_loss` the class
    is left to the module's default (a class switched on the command line keeps its own), except in a checkpoint's
    config (`stored`), which names the class the run trained with."""
    old = [key for key in ("policy_loss", *OBJECTIVE_KEYS) if key in init_args]
    if not old:
        return None, []
    loss = init_args.get("policy_loss")
    own = {OBJECTIVE_KEYS[k]: init_args[k] for k in OBJECTIVE_KEYS if k in init_args}
    level = own.get("ratio_level")
    if loss is None and reinforce and (own.get("clip_eps_high") is not None or level == "sequence"):
        raise ValueError(
            "model.init_args sets clip_eps_high or ratio_level: sequence for ReinforceModule, whose objective, "
            "sequence_mean, has no ratio: choose one that has, e.g. objective: {class_path: clip, init_args: "
            "{clip_eps_high: 0.28}}, or drop them"
        )
    if loss in (None, "clip") and level == "sequence":
        loss = "gspo"
    if loss != "cispo":
        own.pop("ratio_level", None)  # the class says it (GSPO's sequence, the clipped surrogate's token)
    if loss is None and reinforce:
        own.pop("clip_eps_high", None)  # null: the value ReinforceModule always applied
    if loss is None and not stored:  # the module's default class; the defaults need no key (a class switch keeps them)
        own = {key: value for key, value in own.items() if value != OBJECTIVE_DEFAULTS.get(key)}
        return ({"init_args": own} if own else None), old
    loss = loss or ("sequence_mean" if reinforce else "clip")
    return {"class_path": OBJECTIVE_PATHS.get(loss, loss), "init_args": own}, old


def upgrade_model_args(init_args: dict[str, Any], class_path: str | None, stored: bool = False) -> list[str]:
    """Move the old keys of a module's `init_args` (in place) to their groups; the moves, as `old -> new` phrases.
    `stored`: a checkpoint's config, which names every class (`_objective`)."""
    reinforce = str(class_path or "").endswith("ReinforceModule")
    moves = []
    if reinforce:
        for key, value in REINFORCE_RETIRED.items():
            if key in init_args and init_args[key] == value:
                del init_args[key]
    objective, replaced = _objective(init_args, reinforce, stored)
    if replaced:
        if isinstance(init_args.get("objective"), dict | str):
            raise ValueError(
                f"model.init_args sets objective and its old spelling ({', '.join(replaced)}) both: keep objective"
            )
        for key in replaced:
            del init_args[key]
        if objective is not None:
            init_args["objective"] = objective
        named = (objective or {}).get("class_path", "the module's default").rpartition(".")[2]
        kept = (objective or {}).get("init_args", {})
        for key in replaced:
            if key in OBJECTIVE_FLAGS:
                moves.append(f"{key} -> objective: {named}")
            elif OBJECTIVE_KEYS[key] in kept:
                moves.append(f"{key} -> objective.init_args.{OBJECTIVE_KEYS[key]}")
            else:
                moves.append(f"{key} -> (the default)")
    cap = init_args.pop("tis_cap", None)
    if cap is not None:
        if init_args.get("sampler_is_mode") is not None or init_args.get("sampler_is_max", 2.0) != 2.0:
            raise ValueError("model.init_args sets tis_cap and sampler_is_mode or sampler_is_max: keep correction")
        init_args["sampler_is_mode"], init_args["sampler_is_max"] = "token_truncate", cap
        moves.append(f"tis_cap: {cap} -> correction: {{mode: token_truncate, max: {cap}}}")
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
        if not (cap is not None and old in ("sampler_is_mode", "sampler_is_max")):
            moves.append(f"{old} -> {group}.{key}")
    return moves


def upgrade_config(config: Any, stored: bool = False) -> list[str]:
    """Move the old keys of a whole config (`model`, `data`; in place) to the new spelling; the moves made.
    `stored`: a checkpoint's config (`upgrade_model_args`)."""
    if not isinstance(config, dict):
        return []
    moves = []
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_args"), dict):
        args, path = model["init_args"], model.get("class_path")
        moves += [f"model.init_args.{m}" for m in upgrade_model_args(args, path, stored)]
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
    """The CLI's YAML loader (jsonargparse's own, `get_loader("yaml")`), then a config file (or a `--model` file) in
    the new spelling, with a one-line note of the old keys moved."""
    value = get_loader("yaml")(text)
    if isinstance(value, dict) and ("model" in value or "data" in value):
        moves = upgrade_config(value)
    elif isinstance(value, dict) and str(value.get("class_path", "")).endswith("Module"):  # a `--model` file
        moves = upgrade_model_args(value.get("init_args") or {}, value["class_path"])
    else:
        return value
    if moves:
        note(f"this config uses the spelling from before 2026-12-05, read as: {'; '.join(moves)}")
    return value


PREFIXES = ("--model.init_args.", "--model.")  # `--model.X` is jsonargparse's shorthand of `--model.init_args.X`
OBJECTIVE_FLAGS = ("policy_loss", "ratio_level")


def upgrade_args(args: list[str]) -> list[str]:
    """Command-line words in the new spelling: `--model.init_args.<old> V` (or `=V`, or the `--model.<old>`
    shorthand) moved to its group, `policy_loss` and `ratio_level` read together as one objective class, and a short
    objective name made its class path; each move said in one line. A word that starts with `--` is not a value."""
    pairs = _flag_pairs(args)
    given = {key: value for prefix, key, value, _ in pairs if prefix}
    objective = {key: value for key, value in given.items() if key in OBJECTIVE_FLAGS}
    if given.get("tis_cap", "null") not in NULLS and "sampler_is_mode" in given:
        raise ValueError("the command line sets tis_cap and sampler_is_mode: keep --model.init_args.correction.mode")
    out, moves, objective_done = [], [], False
    for prefix, key, value, words in pairs:
        new = None
        if prefix and key in OBJECTIVE_FLAGS:
            new = [] if objective_done else _objective_flags(prefix, objective)
            objective_done = True
        elif prefix:
            new = _upgrade_flag(prefix, key, value)
        elif key == "--data.eval_batch_size":
            new = [("--data.validate_batch_size", value)]
        if new is None:
            out.extend(words)
            continue
        out.extend(f"{flag}={val}" for flag, val in new)
        if not key.startswith("objective"):  # a short objective name is today's spelling: made its path silently
            moves.append(f"{prefix or ''}{key} -> {' '.join(flag for flag, _ in new) or '(the default)'}")
    if moves:
        note(f"the command line uses the spelling from before 2026-12-05, read as: {'; '.join(moves)}")
    return out


NULLS = ("null", "None", "~", "")


def _flag_pairs(args: list[str]) -> list[tuple[str | None, str, str | None, list[str]]]:
    """`(prefix, key, value, words)` for each flag of `args` that takes a value (prefix None: not a model flag, key
    then the whole flag), and `(None, word, None, [word])` for any other word."""
    pairs: list[tuple[str | None, str, str | None, list[str]]] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        prefix = next((p for p in PREFIXES if name.startswith(p) and len(name) > len(p)), None)
        if name.startswith("--") and (prefix or name == "--data.eval_batch_size"):
            if eq:
                pairs.append((prefix, name.removeprefix(prefix or ""), value, [word]))
                i += 1
                continue
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                pairs.append((prefix, name.removeprefix(prefix or ""), args[i + 1], [word, args[i + 1]]))
                i += 2
                continue
        pairs.append((None, word, None, [word]))
        i += 1
    return pairs


def _objective_flags(prefix: str, given: dict[str, str]) -> list[tuple[str, str]]:
    """The new flags for the old `policy_loss` and `ratio_level` flags, read together."""
    loss, level = given.get("policy_loss"), given.get("ratio_level")
    if loss == "cispo":
        flags = [(f"{prefix}objective", OBJECTIVE_PATHS["cispo"])]
        return flags + ([(f"{prefix}objective.init_args.ratio_level", level)] if level else [])
    if level == "sequence" and loss in (None, "clip"):
        return [(f"{prefix}objective", OBJECTIVE_PATHS["gspo"])]
    if loss is None:
        return []  # ratio_level: token, the clipped surrogate's own
    return [(f"{prefix}objective", OBJECTIVE_PATHS.get(loss, loss))]


def _upgrade_flag(prefix: str, key: str, value: str) -> list[tuple[str, str]] | None:
    """The new flags for `<prefix><key> value`, or None when the key is spelled the new way."""
    if key in ("objective", "objective.help") and value in OBJECTIVE_PATHS:
        return [(f"{prefix}{key}", OBJECTIVE_PATHS[value])]
    if key in OBJECTIVE_KEYS:
        return [(f"{prefix}objective.init_args.{OBJECTIVE_KEYS[key]}", value)]
    if key == "tis_cap":
        if value in NULLS:
            return []
        return [(f"{prefix}correction.mode", "token_truncate"), (f"{prefix}correction.max", value)]
    if key in MOVED:
        group, name = MOVED[key]
        return [(f"{prefix}{group}.{name}", value)]
    return None
