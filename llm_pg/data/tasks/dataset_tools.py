"""DatasetToolTask: a tool task with no code: a dataset, named tools and built-in rewards, all in YAML.

    data:
      task:
        class_path: llm_pg.data.tasks.DatasetToolTask
        init_args:
          dataset: json
          data_files: {train: products.jsonl}
          prompt_column: question
          rewards: [boxed_number]
          tools: [calculator, mytools:convert_units]    # built-in names or "module:function"
          call_format: json                             # <tool_call> JSON, schemas in the template's tools= block

Everything `DatasetTask` reads (rows, prompts, the held-out eval slice, the weighted rewards) works as there; the
model's turns are what the rewards score (`model_text`: the observations are not the model's). A tool is a built-in
name (`BUILTIN_TOOLS`: `calculator`, the bounded integer calculator) or a typed function of the user's,
`"module:function"`, found beside the config or in the working directory as a reward function is: with
`call_format: json` its JSON schema comes from its type hints and its docstring's summary and `Args:` (transformers'
`get_json_schema`), so the docstring is what the model reads. A user's tool runs in the reward workers, under
`data.reward_timeout`; it raises `llm_pg.data.tasks.ToolError` for input it cannot serve (the message becomes the
observation). The model calls a tool by its function's name (a built-in's by its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from llm_pg.data.tasks.calc_arith import calc
from llm_pg.data.tasks.dataset import DatasetTask
from llm_pg.data.tasks.rewards import import_function
from llm_pg.data.tasks.tools import ToolTask

__all__ = ["BUILTIN_TOOLS", "DatasetToolTask", "resolve_tools"]

BUILTIN_TOOLS: Mapping[str, Callable[..., str]] = {"calculator": calc}


def resolve_tools(entries: Sequence[str]) -> dict[str, Callable[..., str]]:
    """Each entry's tool by the name the model calls it: a built-in name, or `"module:function"` (imported now, so a
    typo fails before training, in one line)."""
    if isinstance(entries, str) or not entries:
        raise ValueError(f"tools must be a non-empty list of names, got {entries!r}: e.g. [calculator]")
    tools: dict[str, Callable[..., str]] = {}
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"tools entry {entry!r} must be a built-in name or 'module:function'")
        if entry in BUILTIN_TOOLS:
            name, tool = entry, BUILTIN_TOOLS[entry]
        elif ":" in entry:
            tool = import_function(entry, "tool", "mytools:lookup")
            name = entry.rpartition(":")[2]
        else:
            raise ValueError(f"unknown tool '{entry}': use one of {', '.join(BUILTIN_TOOLS)} or 'module:function'")
        if name in tools:
            raise ValueError(f"tools: two tools are named {name!r}; the model calls a tool by its name")
        tools[name] = tool
    return tools


class DatasetToolTask(DatasetTask, ToolTask):
    """A `DatasetTask` whose model may call `tools` between its turns (see the module docstring).

    Args:
        dataset: a hub id, a local directory, or a builder reading data_files: json, csv, parquet.
        data_files: a path, a list of paths, or a mapping split -> path(s); relative paths beside the config.
        config_name: the hub dataset's configuration (subset), if it has several.
        train_split: the split to train on.
        eval_split: the split to evaluate on (its first eval_size rows); null: a seeded held-out slice of train.
        prompt_column: the column holding the user turn (default `prompt` when no prompt_template).
        prompt_template: the user turn with {column} placeholders, e.g. "Solve: {question}"; braces as {{ }}.
        answer_column: the column holding the gold answer (read as a stripped string).
        system_prompt: a system turn before every prompt, or null (with tags, tell the model how to call).
        eval_size: eval rows (held out of training when eval_split is null).
        eval_seed: the held-out slice's seed; null: the run's seed.
        rewards: built-in names (boxed_number, answer_tag, exact, boxed_exact) or "module:function" entries.
        reward_weights: one weight per reward (default 1.0 each); total = sum of weight x reward.
        tools: built-in tool names (calculator) or "module:function" typed functions.
        call_format: json (<tool_call> JSON calls, the tools' schemas in the chat template's tools= block) or tags
            (<name>input</name>, one call a turn, each tool taking one text).
        max_turns: the most model turns of an episode (1: no call runs, and JSON tools are not shown).
        max_tool_tokens: the most tokens of one observation's content.
    """

    name = "dataset_tools"

    def __init__(
        self,
        dataset: str = "json",
        data_files: str | Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
        config_name: str | None = None,
        train_split: str = "train",
        eval_split: str | None = None,
        prompt_column: str | None = None,
        prompt_template: str | None = None,
        answer_column: str = "answer",
        system_prompt: str | None = None,
        eval_size: int = 64,
        eval_seed: int | None = None,
        rewards: Sequence[str] = ("boxed_number",),
        reward_weights: Sequence[float] | None = None,
        tools: Sequence[str] = ("calculator",),
        call_format: str = "json",
        max_turns: int = 3,
        max_tool_tokens: int = 64,
    ) -> None:
        super().__init__(
            dataset, data_files, config_name, train_split, eval_split, prompt_column, prompt_template,
            answer_column, system_prompt, eval_size, eval_seed, rewards, reward_weights,
        )  # fmt: skip
        self.set_tool_settings(max_turns, max_tool_tokens, call_format)
        self.tools = resolve_tools(tools)  # a function without a readable schema is refused before training
