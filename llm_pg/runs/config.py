"""What a checkpoint's config must share with the run that resumes from it.

The checkpoint stores the run's resolved config (`plain_config`); a resume compares its own with it
(`config_changes`) before any model loads, and stops when a setting that changes what is trained differs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from typing import Any

from llm_pg.data.datamodule import PromptGroupDataModule

# Settings a resume may change: how long to train, how often to evaluate and log, where and how to save, and
# the trainer's progress/logging knobs. Every other key changes what is trained, so a resume must keep it.
RESUME_MAY_CHANGE = {
    "model.init_args.iterations",
    "model.init_args.evaluation.every",
    "model.init_args.log_generations.every",
    "model.init_args.log_generations.rows",
    "model.init_args.max_skipped_iterations",
    "model.init_args.evaluation.max_new_tokens",
    "model.init_args.speed.logprob_batch_size",
    "model.init_args.speed.logprob_chunk_size",
    "model.init_args.speed.group_by_length",
    "model.init_args.speed.pack_sequences",
    "model.init_args.evaluation.generate_batch_size",
    "data.validate_batch_size",
    "data.reward_timeout",  # how the rewards run, not what they are
    "data.reward_workers",
    "run_name",
    "runs_root",
    "wandb_project",
    "torch_threads",
    "verbose",  # `validate`'s own argument
}
RESUME_MAY_CHANGE_PREFIXES = ("checkpoint.", "trainer.")
RESUME_MUST_KEEP = {
    "trainer.accelerator",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.precision",
}  # world size, numerics


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): tree}


def config_changes(
    stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """`key: old -> new` for every setting that differs between a checkpoint's config and this run's and
    changes what is trained (anything but RESUME_MAY_CHANGE and the checkpoint/trainer progress keys).

    A key one side lacks (added to the code since, or a null the config leaves out) is no change when the other side
    holds its default value (`defaults`, dotted keys): defaults reproduce the earlier behaviour. A checkpoint from
    before the settings were grouped is compared in today's spelling (`llm_pg.runs.spelling.upgrade_config`, which
    also drops the GRPO keys ReinforceModule once held at the value it always applied). `iterations` may change only
    under a constant learning rate: a linear or cosine decay spans them."""
    old, new, defaults = _flatten(stored), _flatten(current), defaults or {}
    changes = []
    for key in sorted(set(old) | set(new)):
        one_sided = key in defaults and (key not in old or key not in new)
        if one_sided and (old if key in old else new)[key] == defaults[key]:
            continue
        allowed = key in RESUME_MAY_CHANGE or key.startswith(RESUME_MAY_CHANGE_PREFIXES)
        if key == "model.init_args.iterations" and new.get("model.init_args.lr_schedule", "constant") != "constant":
            allowed = False  # a decaying learning rate spans `iterations`: another count changes every later rate
        if old.get(key, "<unset>") != new.get(key, "<unset>") and (not allowed or key in RESUME_MUST_KEEP):
            changes.append(f"{key}: {old.get(key, '<unset>')} -> {new.get(key, '<unset>')}")
    return changes


def plain_config(config) -> dict[str, Any]:
    """The resolved config as plain JSON types, without the config-file paths and the checkpoint to resume."""
    plain = json.loads(json.dumps(config.as_dict(), default=str))
    for key in ("config", "ckpt_path", "overwrite"):
        plain.pop(key, None)
    return plain


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def class_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor defaults of the model, data module and task classes, the module's groups and its objective, as
    dotted config keys (plain JSON)."""

    def of(cls: type, prefix: str) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):  # a subclass's default wins
            for name, param in inspect.signature(klass.__init__).parameters.items():
                default = param.default
                if default is inspect.Parameter.empty:
                    continue
                if dataclasses.is_dataclass(default) and not isinstance(default, type):  # a settings group
                    found |= {f"{prefix}{name}.{k}": _plain(v) for k, v in dataclasses.asdict(default).items()}
                else:
                    found[f"{prefix}{name}"] = _plain(default)
        return found

    defaults = of(PromptGroupDataModule, "data.")

    def load(class_path: str) -> type:
        module, _, name = class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    model = config.get("model") or {}
    nodes = {
        "model.init_args.": model,
        "data.task.init_args.": (config.get("data") or {}).get("task"),
        "model.init_args.objective.init_args.": (model.get("init_args") or {}).get("objective"),
    }
    for prefix, node in nodes.items():
        if isinstance(node, dict) and node.get("class_path"):
            try:
                defaults |= of(load(node["class_path"]), prefix)
            except (ImportError, AttributeError, ValueError, TypeError):
                continue
    return defaults
