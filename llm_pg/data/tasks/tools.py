"""Tasks whose model may call tools between its turns (`ToolTask`), and the per-episode tools (`ToolEnvironment`).

An episode alternates model turns and tool observations. The model writes a call as the last thing of its turn,
`<name>input</name>` for one of the task's tool names, and ends its turn (its end-of-turn token); the rollout loop
(`llm_pg.engines.episodes`) finds the call (`ToolTask.find_call`), runs it (`call_tool`, in the reward workers when
the tools are a user's code), and appends the result as a tool turn of the chat template. A turn without a call
ends the episode, and the task scores the model's turns (`Task.score` on `model_text`).

A tool is `function(input text) -> observation text`. A tool that cannot serve the model's input raises
`ToolError`: its message becomes the observation (`error: ...`) and counts in `train/tool_errors`. Anything else a
tool raises, or a tool that hangs, exits or returns a non-string, stops the run in one line, as a reward does.
Tools with state (a scratch file system, a game) subclass `ToolEnvironment`: `ToolTask.environment(example)` makes
a fresh one for every row of every rollout, so nothing carries over between rows or iterations.

The episodes speak this tag dialect: one call per turn, no remote tools. The JSON function calls of real chat models
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several a turn, checked against each tool's JSON schema)
are parsed by `llm_pg.data.tasks.tool_calls`, with schemas from `llm_pg.models.chat.tool_schemas`; the episode loop
does not speak them yet (issue 41).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from llm_pg.data.tasks.base import Example, Task

__all__ = ["ToolEnvironment", "ToolError", "ToolOutcome", "ToolTask", "call_tool", "model_text"]

TURN_SEPARATOR = "\n\n"  # between the model's turns in the text a task scores


class ToolError(ValueError):
    """The model's input cannot be served (a malformed expression, a missing file): the message is the observation."""


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's result: the observation text, whether it is an error observation (`ToolError`), and the
    environment after the call (it travels to and from a reward worker with the call)."""

    observation: str
    error: bool
    environment: ToolEnvironment


class ToolEnvironment:
    """The tools of one episode (one row of one rollout): `call(name, text)` runs tool `name` on the model's input.

    The base class holds stateless functions; a subclass may keep state in its attributes, which live for the
    episode only. It must be picklable when the tools run in reward workers (user code)."""

    def __init__(self, tools: Mapping[str, Callable[[str], str]]) -> None:
        self.tools = dict(tools)

    def call(self, name: str, text: str) -> str:
        return self.tools[name](text)


class ToolTask(Task):
    """A task whose episodes may call `tools` (name -> function) for up to `max_turns` model turns.

    Subclasses set `tools` (or override `environment` for tools with state) and score the model's turns as any task
    scores a completion. `observation_role` is the chat role of a tool turn (`tool`; a template without that role
    may want `user`).

    Args:
        max_turns: the most model turns of an episode (1: the model answers at once; a call it writes is not run).
        max_tool_tokens: the most tokens of one observation's content; a longer result is cut to its first ones.
        system_prompt: the system turn (null: none); tell the model its tools and how to call them.
        eval_size: eval examples.
        eval_seed: seed of the eval set.
    """

    tools: ClassVar[Mapping[str, Callable[[str], str]]] = {}
    observation_role = "tool"

    def __init__(
        self,
        max_turns: int = 3,
        max_tool_tokens: int = 64,
        system_prompt: str | None = None,
        eval_size: int = 64,
        eval_seed: int | None = 1234,
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size, eval_seed=eval_seed)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {max_tool_tokens}")
        self.max_turns, self.max_tool_tokens = max_turns, max_tool_tokens

    def environment(self, example: Example) -> ToolEnvironment:
        """A fresh environment for one episode answering `example`."""
        return ToolEnvironment(self.tools)

    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tools)

    def find_call(self, turn: str) -> tuple[str, str] | None:
        """`(name, input)` when the turn ends (trailing whitespace aside) with `<name>input</name>` for one of the
        task's tools, else None. Linear in the turn's length; the input is everything between the last `<name>` and
        the closing tag."""
        text = turn.rstrip()
        for name in self.tool_names():
            close = f"</{name}>"
            if text.endswith(close):
                start = text.rfind(f"<{name}>", 0, len(text) - len(close))
                if start >= 0:
                    return name, text[start + len(name) + 2 : len(text) - len(close)]
        return None


def call_tool(environment: ToolEnvironment, name: str, text: str) -> ToolOutcome:
    """Run one call: its observation, or an error observation for a `ToolError`. Any other exception propagates
    (the caller turns it into the run's stop), and so does a result that is not a string."""
    try:
        result = environment.call(name, text)
    except ToolError as error:
        return ToolOutcome(f"error: {error}", True, environment)
    if not isinstance(result, str):
        raise TypeError(f"tool {name!r} returned {type(result).__name__} {result!r:.60}; a tool returns a string")
    return ToolOutcome(result, False, environment)


def model_text(turns: Sequence[str]) -> str:
    """The text a tool task scores: the model's own turns, blank-line separated (observations are not the model's)."""
    return TURN_SEPARATOR.join(turns)
