"""JSON tool calls as real chat models write them (Hermes / Qwen2.5 / Qwen3): parsed, checked against the tools'
schemas, and answered with an error the model can read when it got one wrong. Pure text in, typed calls out; never
raises on any completion text, never evaluates it.

A model turn holds zero or more calls, in order, each

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "22*55"}}
    </tool_call>

(`<tool_call>` and `</tool_call>` are single tokens in Qwen2.5's vocabulary). `parse_calls(turn, schemas)` returns one
entry per call: a `ToolCall` to run, or a `CallError` whose `message` becomes the model's observation and whose
`kind` is counted (`train/tool_errors` by kind). The checks, in order:

    unclosed       an opening tag without its closing tag (the rest of the turn is not a call)
    too_many       more calls in one turn than `CallLimits.max_calls` (the first ones are kept)
    bad_json       not one JSON value: malformed, longer than `max_json_chars`, nested deeper than `max_depth`, a
                   duplicate key, NaN or Infinity, a number past Python's digit limit, a lone surrogate
    not_a_call     JSON, but not an object `{"name": <string>, "arguments": <object>}` (`arguments` may be absent
                   for a tool without parameters, or a string holding that object, as some models write it)
    unknown_tool   a name that is not one of the task's tools
    bad_arguments  the arguments do not match the tool's JSON schema (`transformers.utils.get_json_schema`'s form):
                   a missing required key, a key the tool does not take, a wrong type or a value outside its enum

and one kind the episode loop adds when a well-formed call runs: `tool_error`, the tool raised `ToolError` (input
it cannot serve, e.g. a malformed expression for the calculator).

A turn without any `<tool_call>` tag that is nothing but one JSON object naming one of the task's tools (`"name":
"calculator"`; a ``` or ```json fence around it allowed) is read as one call too (`CallLimits.whole_turn`): Llama
3.x writes its calls that way, and so does Qwen2.5-Coder-0.5B-Instruct: after Qwen2.5's tool block, greedy and
sampled, it answers `{"name": "calculator", "arguments": {...}}` bare or fenced and gives the `<tool_call>` token a
probability below 1e-4. Such an object with a key a call does not have (`"return": ...`) is a `not_a_call` error,
and such a turn that is not valid JSON (`{{"name": "calculator", ...}}}`, as Qwen2.5-Coder-1.5B samples) a
`bad_json` error: the model reads why, rather than the episode ending on a call it cannot see was refused. A JSON
object or text naming no tool is an answer, not a call. `"parameters"` is read as `"arguments"` (Llama 3.x's key).
Otherwise a call inside a fenced code block (```) is quoted, not made: it is skipped. Every scan is linear in the
turn's length (each `str.find` starts where the last one ended; the JSON is bounded before it is parsed), so a 1 MB
turn of hostile text answers in milliseconds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

OPEN, CLOSE, FENCE = "<tool_call>", "</tool_call>", "```"
_NAMED = re.compile(r'"name"\s*:\s*"([^"\\]{1,128})"')  # `"name": "calculator"` in text that is not valid JSON


class CallErrorKind(StrEnum):
    UNCLOSED = "unclosed"
    TOO_MANY = "too_many"
    BAD_JSON = "bad_json"
    NOT_A_CALL = "not_a_call"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    TOOL_ERROR = "tool_error"  # a well-formed call whose tool raised ToolError


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of one of the task's tools: a JSON call's keyword arguments, checked against the tool's
    schema, or (the `<name>input</name>` tag dialect) the one input text."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)


@dataclass(frozen=True)
class CallError:
    """A call the model got wrong: what kind (a metric) and the message it reads as the call's observation."""

    kind: CallErrorKind
    message: str


@dataclass(frozen=True)
class CallLimits:
    """How much of a turn is read as calls: calls per turn, characters and nesting of one call's JSON, and whether a
    turn that is one bare (or fenced) JSON call object counts as a call."""

    max_calls: int = 8
    max_json_chars: int = 8192
    max_depth: int = 16
    whole_turn: bool = True


LIMITS = CallLimits()


def parse_calls(
    turn: str, schemas: Mapping[str, Mapping[str, Any]], limits: CallLimits = LIMITS
) -> list[ToolCall | CallError]:
    """The calls of a finished model turn, in order: each a checked `ToolCall` or a `CallError`. `schemas` maps each
    tool's name to its JSON schema (`{"type": "function", "function": {"name", "parameters", ...}}`)."""
    out: list[ToolCall | CallError] = []
    bodies = _call_bodies(turn, limits)
    if not bodies and limits.whole_turn and OPEN not in turn:
        bodies = _whole_turn_call(turn, schemas, limits)
    for body in bodies:
        if isinstance(body, CallError):
            out.append(body)
            continue
        call = _as_call(body, limits)
        out.append(call if isinstance(call, CallError) else check_call(call, schemas))
    return out


def _call_bodies(turn: str, limits: CallLimits) -> list[str | CallError]:
    """The text between each `<tool_call>` and its `</tool_call>` outside fenced code blocks, at most
    `limits.max_calls` of them (then a `too_many` error), and an `unclosed` error for an opening tag left open."""
    return [body for _, _, body in _call_spans(turn, limits.max_calls)]


def _call_spans(turn: str, max_calls: int) -> list[tuple[int, int, str | CallError]]:
    """`(start, end, body)` of each `<tool_call>...</tool_call>` outside fenced code blocks, in order; a call past
    `max_calls`, or an opening tag left open, ends the scan with its error spanning the rest of the turn."""
    spans: list[tuple[int, int, str | CallError]] = []
    position, start = 0, turn.find(OPEN)
    while start >= 0:
        fence = turn.find(FENCE, position, start)
        if fence >= 0:  # a code block opens before the tag: skip to its end (an unclosed block runs to the end)
            end = turn.find(FENCE, fence + len(FENCE))
            if end < 0:
                break
            position = end + len(FENCE)
            if position > start:  # the tag was inside the block: the next tag after it
                start = turn.find(OPEN, position)
            continue
        if len(spans) == max_calls:
            error = CallError(CallErrorKind.TOO_MANY, f"error: at most {max_calls} tool calls a turn")
            spans.append((start, len(turn), error))
            break
        end = turn.find(CLOSE, start + len(OPEN))
        if end < 0:
            spans.append((start, len(turn), CallError(CallErrorKind.UNCLOSED, f"error: {OPEN} without {CLOSE}")))
            break
        spans.append((start, end + len(CLOSE), turn[start + len(OPEN) : end]))
        position = end + len(CLOSE)
        start = turn.find(OPEN, position)
    return spans


def without_calls(turn: str, names: Collection[str], limits: CallLimits = LIMITS) -> str:
    """The turn's text addressed to the user: the turn with every call `parse_calls` reads taken out (each
    `<tool_call>...</tool_call>`, an unclosed or surplus one with the rest of the turn), or "" for a turn that is
    one whole call object naming one of `names` (the task's tools). What a JSON tool task scores: a chat API keeps
    a message's `tool_calls` apart from its `content`, and a call's arguments are not an answer
    (`{"expression": "1776"}` would otherwise end the text on the gold number). Linear; never raises."""
    spans = _call_spans(turn, limits.max_calls)
    if not spans:
        whole = (
            limits.whole_turn
            and OPEN not in turn
            and (_whole_turn_call(turn, names, limits) or _cut_call(turn, names, limits))
        )
        return "" if whole else turn
    pieces, position = [], 0
    for start, end, _ in spans:
        pieces.append(turn[position:start])
        position = end
    pieces.append(turn[position:])
    return "".join(pieces)


def _whole_turn_call(turn: str, names: Collection[str], limits: CallLimits) -> list[str | CallError]:
    """The turn as one call body when, whitespace and a ``` or ```json fence aside, it is one JSON object whose name
    is one of the task's tools (its other keys are `_as_call`'s to check), or its `bad_json` error when it is not
    valid JSON yet names a tool (`"name": "calculator"`): a JSON answer (`{"name": "Alice", "age": 3}`) is not taken
    for a call."""
    text = turn.strip()
    if text.startswith(FENCE):  # ```json\n{...}\n```: the block must be the whole turn
        newline = text.find("\n")
        if newline < 0 or text[len(FENCE) : newline].strip() not in ("", "json") or not text.endswith(FENCE):
            return []
        text = text[newline + 1 : -len(FENCE)].strip()
    if not text.startswith("{") or len(text) > limits.max_json_chars:
        return []
    value = load_json(text, limits)
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] in names:
        return [text]
    if isinstance(value, CallError) and any(name in names for name in _NAMED.findall(text)):
        return [value]
    return []


def _cut_call(turn: str, names: Collection[str], limits: CallLimits) -> bool:
    """Whether the turn is a fenced call the token budget cut off: a ``` fence that never closes, around text that
    starts as a JSON object naming one of `names` (its arguments, `{"expression": "4582`, are no answer either)."""
    text = turn.strip()
    if not text.startswith(FENCE) or text.find(FENCE, len(FENCE)) >= 0:
        return False
    body = text[text.find("\n") + 1 :].lstrip() if "\n" in text else ""
    return body.startswith("{") and any(name in names for name in _NAMED.findall(body[: limits.max_json_chars]))


def _as_call(body: str, limits: CallLimits) -> ToolCall | CallError:
    """The call a body spells: `{"name": str, "arguments": object}`, before its arguments are checked."""
    value = load_json(body, limits)
    if isinstance(value, CallError):
        return value
    shape = 'a tool call is {"name": <tool name>, "arguments": {...}}'
    if isinstance(value, dict) and "parameters" in value and "arguments" not in value:  # Llama 3.x's key
        value = {("arguments" if key == "parameters" else key): item for key, item in value.items()}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallError(CallErrorKind.NOT_A_CALL, f"error: {shape}")
    if extra := sorted(set(value) - {"name", "arguments"}):
        keys = ", ".join(map(repr, extra))[:120]
        return CallError(CallErrorKind.NOT_A_CALL, f"error: {shape}; unexpected key {keys}")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # the arguments as a JSON string, as some models write them
        arguments = load_json(arguments, limits)
        if isinstance(arguments, CallError):
            return arguments
    if not isinstance(arguments, dict):
        return CallError(CallErrorKind.NOT_A_CALL, f"error: {shape}; arguments must be an object")
    return ToolCall(value["name"], arguments)


def load_json(text: str, limits: CallLimits = LIMITS) -> Any | CallError:
    """One JSON value from `text`, or a `bad_json` error: bounded in size and depth before the parser sees it, with
    duplicate keys, NaN and Infinity refused, and strings that are not valid UTF-8 (lone surrogates) refused."""
    text = text.strip()
    if len(text) > limits.max_json_chars:
        return _bad_json(f"the call is longer than {limits.max_json_chars} characters")
    if _depth(text) > limits.max_depth:
        return _bad_json(f"the call nests deeper than {limits.max_depth} levels")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape cannot be encoded
    except json.JSONDecodeError as error:
        return _bad_json(f"invalid JSON ({error.msg} at character {error.pos})")
    except (ValueError, RecursionError, UnicodeEncodeError) as error:  # duplicate key, NaN, digits, surrogates
        return _bad_json(f"invalid JSON ({str(error)[:120]})")
    return value


def _bad_json(why: str) -> CallError:
    return CallError(CallErrorKind.BAD_JSON, f"error: {why}")


def _depth(text: str) -> int:
    """The deepest nesting of `[` and `{` in `text` outside JSON strings (linear; malformed text is bounded too)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_call(call: ToolCall, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall | CallError:
    """`call` when its name is one of `schemas` and its arguments match that tool's parameters, else the error."""
    schema = schemas.get(call.name)
    if schema is None:
        names = ", ".join(sorted(schemas)) or "none"
        return CallError(CallErrorKind.UNKNOWN_TOOL, f"error: unknown tool {call.name[:60]!r}; the tools: {names}")
    parameters = schema.get("function", schema).get("parameters") or {"type": "object", "properties": {}}
    problem = _mismatch(call.arguments, {"additionalProperties": False, **parameters}, "")
    if problem is not None:
        return CallError(CallErrorKind.BAD_ARGUMENTS, f"error: {call.name}: {problem}")
    return call


JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _mismatch(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    """Why `value` does not match `schema` (the subset of JSON schema `get_json_schema` writes), or None."""
    what = f"argument {where!r}" if where else "the arguments"
    if value is None and schema.get("nullable"):
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds and not any(JSON_TYPES.get(kind, lambda v: True)(value) for kind in kinds):
        return f"{what} must be {' or '.join(kinds)}, got {_json_type(value)}"
    if "enum" in schema and not any(type(value) is type(option) and value == option for option in schema["enum"]):
        return f"{what} must be one of {', '.join(json.dumps(option) for option in schema['enum'])}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            problem = _mismatch(item, schema["items"], f"{where}[{index}]")
            if problem is not None:
                return problem
    if isinstance(value, dict):
        return _object_mismatch(value, schema, where)
    return None


def _object_mismatch(value: dict[str, Any], schema: Mapping[str, Any], where: str) -> str | None:
    properties = schema.get("properties") or {}
    prefix = f"{where}." if where else ""
    for key in schema.get("required") or []:
        if key not in value:
            return f"missing required argument {prefix + key!r}"
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            sub = properties[key]
        elif isinstance(extra, Mapping):
            sub = extra
        elif extra is False:
            return f"unknown argument {(prefix + key)[:60]!r}; the arguments: {', '.join(properties) or 'none'}"
        else:
            continue
        problem = _mismatch(item, sub, prefix + key)
        if problem is not None:
            return problem
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for kind in ("integer", "number", "string", "null", "array", "object"):
        if JSON_TYPES[kind](value):
            return kind
    return type(value).__name__
