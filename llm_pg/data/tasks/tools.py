"""Tasks whose model may call tools between its turns (`ToolTask`), and the per-episode tools (`ToolEnvironment`).

An episode alternates model turns and tool observations. The model writes its calls in its turn and ends the turn
(its end-of-turn token); the rollout loop (`llm_pg.engines.episodes`) reads the calls (`ToolTask.calls`), runs them
(`call_tool`, in the reward workers when the tools are a user's code), and appends the results as the chat
template's tool turn. A turn without a call ends the episode, and the task scores the model's turns (`Task.score`
on `scored_text`: the model's turns, with JSON calls taken out). Each task speaks one of two call formats
(`call_format`):

    tags  `<name>input</name>` as the last thing of the turn, one call a turn; the tool is `function(text) -> str`.
          The tiny model's dialect (`<calc>37*48</calc>`); the system prompt tells the model its tools.
    json  the function calls of real chat models (Qwen2.5, Qwen3, Llama 3.x, Hermes): any number of
          `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the turn, parsed and checked against each
          tool's JSON schema (`llm_pg.data.tasks.tool_calls`); the tool is a typed function called with the keyword
          arguments, and its schema (transformers' `get_json_schema`, from its type hints and docstring) goes to the
          chat template as `tools=`, so the model sees its native tool block. A call the model got wrong (bad JSON,
          an unknown tool, wrong arguments) is answered with an error observation it reads.

A tool that cannot serve the model's input raises `ToolError`: its message becomes the observation (`error: ...`)
and counts in `train/tool_errors`. Anything else a tool raises, or a tool that hangs, exits or returns a non-string,
stops the run in one line, as a reward does. Tools with state (a scratch file system, a game) subclass
`ToolEnvironment`: `ToolTask.environment(example)` makes a fresh one for every row of every rollout, so nothing
carries over between rows or iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from llm_pg.data.tasks.base import Example, Task
from llm_pg.data.tasks.tool_calls import CallError, CallLimits, ToolCall, parse_calls, without_calls

__all__ = [
    "CALL_FORMATS",
    "ToolEnvironment",
    "ToolError",
    "ToolInput",
    "ToolOutcome",
    "ToolTask",
    "call_tool",
    "model_text",
]

CALL_FORMATS = ("tags", "json")
ToolInput = str | Mapping[str, Any]  # a tag call's text, or a JSON call's keyword arguments

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
    """The tools of one episode (one row of one rollout): `call(name, arguments)` runs tool `name` on the model's
    input, the text of a tag call or the keyword arguments of a JSON call.

    The base class holds stateless functions; a subclass may keep state in its attributes, which live for the
    episode only. It must be picklable when the tools run in reward workers (user code)."""

    def __init__(self, tools: Mapping[str, Callable[..., str]]) -> None:
        self.tools = dict(tools)

    def call(self, name: str, arguments: ToolInput) -> str:
        tool = self.tools[name]
        return tool(arguments) if isinstance(arguments, str) else tool(**arguments)


class ToolTask(Task):
    """A task whose episodes may call `tools` (name -> function) for up to `max_turns` model turns.

    Subclasses set `tools` (or override `environment` for tools with state) and score the model's turns as any task
    scores a completion. `observation_role` is the chat role of a tool turn (`tool`; a template without that role
    may want `user`). With `call_format: json` each tool needs a JSON schema: it is read from the function's type
    hints and docstring (transformers' `get_json_schema`, in `llm_pg.models.chat.task_tool_schemas`), or given in
    `schemas` (tool name -> schema). `call_limits` bounds what a turn's JSON calls may hold.

    Args:
        max_turns: the most model turns of an episode (1: the model answers at once; a call it writes is not run,
            and JSON tools are not shown to it).
        max_tool_tokens: the most tokens of one observation's content; a longer result is cut to its first ones.
        system_prompt: the system turn (null: none); tell the model its tools and how to call them.
        eval_size: eval examples.
        eval_seed: seed of the eval set.
        call_format: how the model calls tools: tags (<name>input</name>, one a turn) or json (<tool_call> JSON
            function calls, the tools' schemas in the chat template's tools= block).
    """

    tools: ClassVar[Mapping[str, Callable[..., str]]] = {}
    observation_role = "tool"
    call_limits: ClassVar[CallLimits] = CallLimits()
    schemas: ClassVar[Mapping[str, Mapping[str, Any]]] = {}  # explicit JSON schemas by tool name (else from hints)
    call_format = "tags"

    def __init__(
        self,
        max_turns: int = 3,
        max_tool_tokens: int = 64,
        system_prompt: str | None = None,
        eval_size: int = 64,
        eval_seed: int | None = 1234,
        call_format: str = "tags",
    ) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size, eval_seed=eval_seed)
        self.set_tool_settings(max_turns, max_tool_tokens, call_format)

    def set_tool_settings(self, max_turns: int, max_tool_tokens: int, call_format: str) -> None:
        """Check and set the episode settings (`__init__`'s; a task that also inherits another task's `__init__`
        calls it itself)."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {max_tool_tokens}")
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}")
        self.max_turns, self.max_tool_tokens, self.call_format = max_turns, max_tool_tokens, call_format

    def environment(self, example: Example) -> ToolEnvironment:
        """A fresh environment for one episode answering `example`."""
        return ToolEnvironment(self.tools)

    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tools)

    @property
    def shows_tools(self) -> bool:
        """Whether the model sees the tools' JSON schemas (the chat template's `tools=` block): json calls, and a call
        can run (`max_turns` > 1)."""
        return self.call_format == "json" and self.max_turns > 1

    def calls(self, turn: str, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> list[ToolCall | CallError]:
        """The calls of a finished model turn, in order: tags, the one `find_call` finds; json, every
        `<tool_call>` of the turn, each a `ToolCall` checked against `schemas` (the tools' JSON schemas by name:
        `llm_pg.models.chat.task_tool_schemas`) or the `CallError` the model will read. Never raises on any text
        (a subclass's `find_call` aside). The episode loop calls `find_call` itself for tags (so that a parser of
        yours that raises is named), and this method for json: override `find_call` for another tag dialect."""
        if self.call_format == "json":
            return parse_calls(turn, schemas or {}, self.call_limits)
        call = self.find_call(turn)
        return [] if call is None else [ToolCall(*call)]

    def scored_text(self, turns: Sequence[str]) -> str:
        """The text `score` and `eval_metrics` get: the model's turns, blank-line separated (`model_text`); with
        json calls, each turn without its calls (`tool_calls.without_calls`: the content a chat API would keep apart
        from the message's `tool_calls`), and a turn that was nothing but a call left out. So a call's arguments
        never count as an answer. The tag dialect scores its turns whole, calls included, as it always has."""
        if self.call_format != "json":
            return model_text(turns)
        kept = (without_calls(turn, self.tool_names(), self.call_limits) for turn in turns)
        return model_text([text for text in kept if text.strip()])

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


def call_tool(environment: ToolEnvironment, name: str, arguments: ToolInput) -> ToolOutcome:
    """Run one call: its observation, or an error observation for a `ToolError`. Any other exception propagates
    (the caller turns it into the run's stop), and so does a result that is not a string."""
    try:
        result = environment.call(name, arguments)
    except ToolError as error:
        return ToolOutcome(f"error: {error}", True, environment)
    if not isinstance(result, str):
        raise TypeError(f"tool {name!r} returned {type(result).__name__} {result!r:.60}; a tool returns a string")
    return ToolOutcome(result, False, environment)


def model_text(turns: Sequence[str]) -> str:
    """The text a tool task scores: the model's own turns, blank-line separated (observations are not the model's)."""
    return TURN_SEPARATOR.join(turns)
