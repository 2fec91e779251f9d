"""What `llm-pg fit` checks after the settings and before it touches a run directory, each failure one line naming
the key or file and the fix: the config files are mappings, the task's data loads and keeps rows, the tokenizer loads
with what the config asks of it (a chat template, EOS and pad tokens), and the LoRA targets name modules of the
model (checked on a weightless copy of its architecture: nothing is downloaded or allocated beyond the config)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llm_pg.data.tasks.base import Example, Task
from llm_pg.data.tasks.tools import ToolTask
from llm_pg.data.user_code import config_files
from llm_pg.models.chat import ChatObservations, TemplateError, probe_json_call, task_tool_schemas


def one_line(message: str) -> str:
    """The sentence that matters in a jsonargparse / constructor error: the constructor's own message when the
    error wraps one, without the subtype list and the dump of the given value."""
    noise = ("Subtypes:", "Given value", "Errors:", "- Expected a <class 'NoneType'>", "tip:")
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    kept = [line.removeprefix("- ") for line in lines if not line.startswith(noise)]
    union = "Does not validate against any of the Union subtypes"
    return " ".join(part for part in (line.replace(union, "").strip() for line in kept) if part)


def not_a_mapping(words: Sequence[str]) -> str | None:
    """The sentence for a `--config` file that is empty, only comments, or not a mapping of keys (jsonargparse says
    only "Unexpected config")."""
    import yaml

    for path in config_files(words):
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if not isinstance(loaded, dict):
            what = "empty (or only comments)" if loaded is None else f"a YAML {type(loaded).__name__}, not a mapping"
            return (
                f"config file {path} is {what}; give a YAML mapping of settings (model:, data:, trainer:, ...), "
                "e.g. a copy of configs/tiny/format_copy_grpo.yaml"
            )
    return None


def check_task_data(task: Any) -> None:
    """`task.prepare()` (loads and filters the data), its errors as one ValueError naming the data."""
    files = getattr(task, "data_files", None) or getattr(task, "dataset", None)
    try:
        task.prepare()
    except UnicodeDecodeError as error:  # a ValueError, but one that names no file
        raise ValueError(
            f"data.task: {type(task).__name__} data ({files}) is not UTF-8 text ({error.reason} at byte "
            f"{error.start}); save the file as UTF-8"
        ) from None
    except ValueError:
        raise
    except Exception as error:  # a reader's own error (pyarrow's, ...) that names no file
        where = f" ({files})" if files else ""
        raise ValueError(
            f"data.task: {type(task).__name__} could not load its data{where}: {type(error).__name__}: "
            f"{one_line(str(error))[:300]}; check the file (UTF-8 JSON lines, JSON, Parquet or CSV)"
        ) from None


def check_model(hp: Any, lora: Any, task: Task | None = None) -> None:
    """The tokenizer and the LoRA targets of `model.init_args` (`hp`: the module's hparams; `lora`: its LoRA), and
    for a tool task (`task`), that the chat template frames tool turns token for token (`check_tool_template`)."""
    from llm_pg.models.loading import load_tokenizer, resolve_model_path

    name = hp.model_name_or_path
    fix = "save the tokenizer beside the weights (tokenizer.save_pretrained(dir)) or give a model that has one"
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, RuntimeError, ValueError, TypeError) as error:
        raise ValueError(
            f"model.init_args.model_name_or_path: no tokenizer loads from {name!r} ({one_line(str(error))[:200]}); "
            f"{fix}"
        ) from None
    if len(tokenizer) < 2 or tokenizer.eos_token_id is None:
        raise ValueError(
            f"model.init_args.model_name_or_path: the tokenizer of {name!r} has {len(tokenizer)} tokens and EOS "
            f"{tokenizer.eos_token!r}: completions could never end; {fix}"
        )
    if hp.chat_template and not tokenizer.chat_template:
        raise ValueError(
            f"model.init_args.chat_template is true but the tokenizer of {name!r} has no chat template; set "
            "chat_template: false (prompts are then the turns joined by blank lines) or use a chat model"
        )
    if isinstance(task, ToolTask):
        if not hp.chat_template:
            raise ValueError(
                f"model.init_args.chat_template is false, but task {type(task).__name__} has tools: an episode's tool "
                "turns are framed by the chat template; set chat_template: true"
            )
        try:
            check_tool_template(tokenizer, task, repr(name), end_ids(resolve_model_path(name), tokenizer))
        except TemplateError as error:
            raise ValueError(f"data.task: {error}") from None
        except ValueError as error:  # a tool whose JSON schema cannot be read
            raise ValueError(f"data.task.init_args.tools: {error}") from None
    if lora is not None and lora.r > 0:
        _check_lora_targets(resolve_model_path(name), list(lora.target_modules))


def end_ids(path: str, tokenizer) -> list[int]:
    """The ids that end a turn, as the run reads them (`eos_token_ids`): the checkpoint's generation config EOS ids
    (when it has a readable one) and the tokenizer's."""
    from transformers import GenerationConfig

    from llm_pg.models.generation import configured_eos_ids

    try:
        config = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        config = None
    return configured_eos_ids(config, tokenizer)


def check_tool_template(tokenizer, task: Task, name: str = "the model", eos: list[int] | None = None) -> None:
    """Refuse (`TemplateError`), before training, a chat template that cannot frame `task`'s tool turns token for
    token: one that rewrites earlier turns, refuses the tool role or closes no turn (`ChatObservations.check`).
    `eos`: the ids that end a turn (the tokenizer's EOS when not given). A no-op for tasks without tools."""
    if not isinstance(task, ToolTask):
        return
    if eos is None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    schemas = task_tool_schemas(task)  # json calls: the tools= block (a function without a readable schema: refused)
    conversation = task.messages(Example("1+1=?", "2"))
    if schemas is None:
        ChatObservations(tokenizer, task.observation_role, eos, name).check(conversation)
        return
    observations = ChatObservations(tokenizer, task.observation_role, eos, name, tools=list(schemas.values()))
    tool = next(iter(schemas), "tool")
    probe = probe_json_call(tool)
    ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if "<tool_call>" not in tokenizer.decode(ids, skip_special_tokens=True):
        raise TemplateError(
            f"the tokenizer of {name} marks <tool_call> as a special token, which a turn's text (decoded without "
            "special tokens) loses, so tagged JSON calls could not be read; use call_format: tags or another model"
        )
    for results in (1, 2):  # one call a turn, and several answered together
        observations.check(conversation, call="\n".join([probe_json_call(tool)] * results), results=results)


def _check_lora_targets(path: str, targets: list[str]) -> None:
    """Every `lora.target_modules` entry is the last name part of some module (peft's suffix match)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture this check cannot build: peft's own error will say it
        return
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [target for target in targets if target not in names]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n}
        )
        raise ValueError(
            f"model.init_args.lora.target_modules: {missing} name no module of {config.model_type} models; its linear "
            f"layers are {linear}"
        )
