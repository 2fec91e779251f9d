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
model's turns are what the rewards score (`ToolTask.scored_text`: not the observations, nor JSON calls). A tool is
a built-in name (`BUILTIN_TOOLS`: `calculator`, the bounded integer calculator) or a typed function of the user's,
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
from llm_pg.data.tasks.rewards import named_functions
from llm_pg.data.tasks.tools import ToolTask

__all__ = ["BUILTIN_TOOLS", "DatasetToolTask", "resolve_tools"]

BUILTIN_TOOLS: Mapping[str, Callable[..., str]] = {"calculator": calc}


def resolve_tools(entries: Sequence[str]) -> dict[str, Callable[..., str]]:
    """Each entry's tool by the name the model calls it: a built-in name, or `"module:function"` (imported now, so a
    typo fails before training, in one line)."""
    tools: dict[str, Callable[..., str]] = {}
    for _, name, tool in named_functions(entries, BUILTIN_TOOLS, "tool", "calculator", "mytools:lookup"):
        if name in tools:
            raise ValueError(f"tools: two tools are named {name!r}; the model calls a tool by its name")
        tools[name] = tool
    return tools


class DatasetToolTask(DatasetTask, ToolTask):
    """A `DatasetTask` whose model may call `tools` between its turns (see the module docstring). Every
    `DatasetTask` argument (dataset, data_files, prompt_column, system_prompt, eval_size, ...) is taken as there.

    Args:
        rewards: built-in names (boxed_number, answer_tag, exact, boxed_exact) or "module:function" entries.
        tools: built-in tool names (calculator) or "module:function" typed functions.
        call_format: json (<tool_call> JSON calls, the tools' schemas in the chat template's tools= block) or tags
            (<name>input</name>, one call a turn, each tool taking one text).
        max_turns: the most model turns of an episode (1: no call runs, and JSON tools are not shown).
        max_tool_tokens: the most tokens of one observation's content.
    """

    name = "dataset_tools"

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        call_format: str = "json",
        max_turns: int = 3,
        max_tool_tokens: int = 64,
        rewards: Sequence[str] = ("boxed_number",),
        **kwargs,
    ) -> None:
        super().__init__(rewards=rewards, **kwargs)  # DatasetTask's: the rows, the prompt, the eval set, the rewards
        self.set_tool_settings(max_turns, max_tool_tokens, call_format)
        self.tools = resolve_tools(tools)  # a function without a readable schema is refused before training
