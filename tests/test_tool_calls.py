"""JSON tool calls (issue 41, deliverables 1-2): a typed function's schema is transformers' own; the Hermes / Qwen
call format is parsed in order, checked against the schemas, and every way a model can get a call wrong is an error
it can read, of a kind; hostile text never raises and answers fast."""

import json
import time
from typing import Literal

import pytest
from transformers.utils import get_json_schema

from llm_pg.data.tasks.tool_calls import (
    CallError,
    CallErrorKind,
    CallLimits,
    ToolCall,
    load_json,
    parse_calls,
    without_calls,
)
from llm_pg.models.chat import tool_schemas


def calculator(expression: str, precision: int | None = None) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 22*55.
        precision: Digits after the point.
    """
    return expression


def convert(value: float, unit: Literal["km", "mi"], tags: list[str] | None = None) -> str:
    """Convert a distance.

    Args:
        value: The distance.
        unit: Its unit.
        tags: Labels.
    """
    return str(value)


CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time.", "parameters": None}}
SCHEMAS = tool_schemas([calculator, convert, CLOCK])


def call(payload) -> str:
    return f"<tool_call>\n{payload if isinstance(payload, str) else json.dumps(payload)}\n</tool_call>"


def test_a_typed_functions_schema_is_transformers_own_and_a_given_schema_passes_through():
    assert SCHEMAS["calculator"] == get_json_schema(calculator)
    assert SCHEMAS["convert"]["function"]["parameters"]["properties"]["unit"]["enum"] == ["km", "mi"]
    assert SCHEMAS["clock"] == CLOCK

    def undocumented(x: int) -> str:
        return str(x)

    with pytest.raises(ValueError, match=r"^tool undocumented: no JSON schema \(.*\); give it type hints and a doc"):
        tool_schemas([undocumented])
    with pytest.raises(ValueError, match="each tool needs a name of its own"):
        tool_schemas([calculator, get_json_schema(calculator)])


def test_several_calls_in_one_turn_are_read_in_order():
    turn = (
        "Let me compute both.\n"
        + call({"name": "calculator", "arguments": {"expression": "22*55"}})
        + "\n"
        + call({"name": "convert", "arguments": {"value": 3, "unit": "km", "tags": ["a"]}})
        + "\n"
        + call({"name": "clock"})
    )
    assert parse_calls(turn, SCHEMAS) == [
        ToolCall("calculator", {"expression": "22*55"}),
        ToolCall("convert", {"value": 3, "unit": "km", "tags": ["a"]}),
        ToolCall("clock", {}),
    ]
    as_string = call({"name": "calculator", "arguments": json.dumps({"expression": "1+1", "precision": None})})
    assert parse_calls(as_string, SCHEMAS) == [ToolCall("calculator", {"expression": "1+1", "precision": None})]
    assert parse_calls("No call here: the answer is 4.", SCHEMAS) == []


@pytest.mark.parametrize(
    ("payload", "kind", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', CallErrorKind.BAD_JSON, "invalid JSON ("),
        ('{"name": "calculator", "name": "convert"}', CallErrorKind.BAD_JSON, "duplicate key 'name'"),
        ('{"name": "calculator", "arguments": {"expression": NaN}}', CallErrorKind.BAD_JSON, "NaN is not a JSON"),
        ('{"name": "calculator", "arguments": {"expression": "\\ud800"}}', CallErrorKind.BAD_JSON, "invalid JSON"),
        ("[" * 40 + "]" * 40, CallErrorKind.BAD_JSON, "nests deeper than 16 levels"),
        ("1" * 5000, CallErrorKind.BAD_JSON, "invalid JSON"),  # past Python's digit limit
        ('["calculator", "1+1"]', CallErrorKind.NOT_A_CALL, 'a tool call is {"name": <tool name>'),
        ({"name": "calculator", "arguments": [1]}, CallErrorKind.NOT_A_CALL, "arguments must be an object"),
        ({"name": "calculator", "args": {}}, CallErrorKind.NOT_A_CALL, "a tool call is"),
        ({"name": "calc", "arguments": {}}, CallErrorKind.UNKNOWN_TOOL, "unknown tool 'calc'; the tools: calculator,"),
        ({"name": "calculator", "arguments": {}}, CallErrorKind.BAD_ARGUMENTS, "missing required argument 'expr"),
        (
            {"name": "calculator", "arguments": {"expression": "1", "digits": 2}},
            CallErrorKind.BAD_ARGUMENTS,
            "unknown argument 'digits'; the arguments: expression, precision",
        ),
        (
            {"name": "calculator", "arguments": {"expression": 12}},
            CallErrorKind.BAD_ARGUMENTS,
            "argument 'expression' must be string, got integer",
        ),
        (
            {"name": "calculator", "arguments": {"expression": "1", "precision": True}},
            CallErrorKind.BAD_ARGUMENTS,
            "argument 'precision' must be integer, got boolean",
        ),
        (
            {"name": "convert", "arguments": {"value": 1, "unit": "m"}},
            CallErrorKind.BAD_ARGUMENTS,
            'argument \'unit\' must be one of "km", "mi"',
        ),
        (
            {"name": "convert", "arguments": {"value": 1, "unit": "km", "tags": ["a", 2]}},
            CallErrorKind.BAD_ARGUMENTS,
            "argument 'tags[1]' must be string, got integer",
        ),
        ({"name": "clock", "arguments": {"zone": "UTC"}}, CallErrorKind.BAD_ARGUMENTS, "unknown argument 'zone'"),
    ],
)
def test_a_call_the_model_got_wrong_is_an_error_it_reads(payload, kind, message):
    [error] = parse_calls("I will call it. " + call(payload), SCHEMAS)
    assert isinstance(error, CallError) and error.kind == kind, error
    assert error.message.startswith("error: ") and message in error.message, error.message
    assert "\n" not in error.message and len(error.message) < 300


def test_nullable_and_numbers_follow_the_schema():
    ok = call({"name": "calculator", "arguments": {"expression": "2", "precision": None}})
    assert parse_calls(ok, SCHEMAS) == [ToolCall("calculator", {"expression": "2", "precision": None})]
    floats = call({"name": "convert", "arguments": {"value": 2.5, "unit": "mi", "tags": None}})
    assert parse_calls(floats, SCHEMAS) == [ToolCall("convert", {"value": 2.5, "unit": "mi", "tags": None})]
    huge = call('{"name": "convert", "arguments": {"value": ' + "9" * 400 + ', "unit": "km"}}')
    assert parse_calls(huge, SCHEMAS)[0].arguments["value"] == int("9" * 400)  # an int is a number, however large


def test_an_unclosed_call_too_many_calls_and_quoted_calls():
    good = call({"name": "clock"})
    [error] = parse_calls("<tool_call>\n{" + '"name": "clock"}', SCHEMAS)
    assert error.kind == CallErrorKind.UNCLOSED
    out = parse_calls(good * 3, SCHEMAS, CallLimits(max_calls=2))
    assert out[:2] == [ToolCall("clock", {})] * 2 and out[2].kind == CallErrorKind.TOO_MANY and len(out) == 3
    quoted = f"Write it like this:\n```\n{call({'name': 'calc'})}\n```\nNow for real: {good}"
    assert parse_calls(quoted, SCHEMAS) == [ToolCall("clock", {})]  # the quoted (and unknown) call is not made
    assert parse_calls("```\n" + good, SCHEMAS) == []  # an unclosed code block runs to the end of the turn


HOSTILE = {
    "opening tags": "<tool_call>" * 100_000,
    "closing tags": "</tool_call>" * 100_000,
    "fences then a call": "``````" * 170_000 + call({"name": "clock"}),
    "1 MB of JSON": call('{"name": "calculator", "arguments": {"expression": "' + "1+" * 500_000 + '1"}}'),
    "deep JSON": call("[" * 500_000 + "]" * 500_000),
    "many keys": call("{" + ",".join(f'"k{i}": {i}' for i in range(100_000)) + "}"),
    "unclosed string": call('{"name": "' + "a" * 1_000_000),
    "surrogates and bytes": "\udcff\udcfe" * 300_000 + call({"name": "clock"}),
    "nested code blocks": ("```" + call({"name": "clock"})) * 50_000,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_text_never_raises_and_answers_in_linear_time(name):
    # A guard against a quadratic path (a 1 MB turn would then take minutes), not a benchmark: milliseconds here.
    turn = HOSTILE[name]
    assert len(turn) >= 500_000
    start = time.perf_counter()
    out = parse_calls(turn, SCHEMAS)
    assert time.perf_counter() - start < 1.0, name
    assert all(isinstance(item, ToolCall | CallError) for item in out) and len(out) <= CallLimits().max_calls + 1


def test_load_json_bounds_size_and_depth_before_parsing():
    assert load_json('  {"a": [1, {"b": null}]} ') == {"a": [1, {"b": None}]}
    assert load_json('"' + "x" * 9000 + '"').kind == CallErrorKind.BAD_JSON
    assert load_json('["[[[[[[[[[[[[[[[[[[[[["]') == ["[[[[[[[[[[[[[[[[[[[[["]  # brackets inside a string do not nest


def test_a_turn_that_is_one_bare_or_fenced_call_object_is_a_call():
    """Llama 3.x's form, and Qwen2.5-Coder-0.5B's habit: the whole turn is the call, without `<tool_call>` tags."""
    bare = '{"name": "calculator", "arguments": {"expression": "37*48"}}'
    fenced = '```json\n{\n  "name": "calculator",\n  "parameters": {\n    "expression": "58*91"\n  }\n}\n```'
    assert parse_calls(bare, SCHEMAS) == [ToolCall("calculator", {"expression": "37*48"})]
    assert parse_calls(f"  {bare}\n", SCHEMAS) == [ToolCall("calculator", {"expression": "37*48"})]
    assert parse_calls(fenced, SCHEMAS) == [ToolCall("calculator", {"expression": "58*91"})]  # "parameters" read too
    assert parse_calls(f"<tool_call>{bare}</tool_call>", SCHEMAS, CallLimits(whole_turn=False)) != []
    for answer in (
        '{"answer": 5}',  # JSON, but no name: an answer
        '{"name": "abacus", "arguments": {}}',  # a name that is no tool's: an answer
        '{"name": "Alice", "age": 3}',  # other keys: a JSON answer, not a call
        f"```python\n{bare}\n```",  # a fence of another language
        f"The call would be {bare}",  # text around it: not the whole turn
        f"```json\n{bare}",  # an unclosed fence
        "{" * 10_000,  # not JSON
        '{"name": 5}',  # a name that is not a string
        "\\boxed{5}",
    ):
        assert parse_calls(answer, SCHEMAS) == [], answer
    assert parse_calls(bare, SCHEMAS, CallLimits(whole_turn=False)) == []
    assert parse_calls('{"name": "Alice", "age": 3', SCHEMAS) == []  # broken JSON naming no tool: an answer
    tagged = f"<tool_call>{bare}</tool_call>"
    assert parse_calls(tagged + "\n" + bare, SCHEMAS) == [ToolCall("calculator", {"expression": "37*48"})]  # tags win


def test_a_whole_turn_that_names_a_tool_but_is_no_clean_call_is_answered_with_its_error():
    """What Qwen2.5-Coder samples after the tool block: doubled braces, an unquoted key, a `"return"` key beside the
    call. Each names the calculator, so the model reads why its call was refused instead of the episode ending."""
    doubled = '{{"name": "calculator", "arguments": {"expression": "22*58"}}}'
    (error,) = parse_calls(doubled, SCHEMAS)
    assert error.kind == CallErrorKind.BAD_JSON and error.message.startswith("error: invalid JSON")
    (error,) = parse_calls('```json\n{"name" : "calculator", arguments: {"expression": "1+1"}}\n```', SCHEMAS)
    assert error.kind == CallErrorKind.BAD_JSON
    (error,) = parse_calls('{"name": "calculator", "arguments": {"expression": "22*58"}, "return": "1276"}', SCHEMAS)
    assert error.kind == CallErrorKind.NOT_A_CALL and error.message.endswith("unexpected key 'return'")
    assert parse_calls('{"name": "abacus", "arguments": {}', SCHEMAS) == []  # broken, but naming no tool
    assert parse_calls('{"name": "calc\\"ulator"', SCHEMAS) == []  # an escaped quote: no tool's name
    hostile = '{"name": "calculator"' + ', "name": "x"' * 600  # long and broken: bounded, linear, an error
    assert [e.kind for e in parse_calls(hostile, SCHEMAS)] == [CallErrorKind.BAD_JSON]


def test_without_calls_keeps_the_text_addressed_to_the_user():
    """What a JSON tool task scores: the turn with its calls taken out, as a chat API keeps `tool_calls` apart from
    `content`; a turn that is one whole call is nothing, a quoted call stays (it is text), and an unclosed or
    surplus call takes the rest of the turn with it."""
    names = ("calculator", "clock")
    bare = '{"name": "calculator", "arguments": {"expression": "1776"}}'
    good = call({"name": "clock"})
    assert without_calls(f"Let me check.{good} So \\boxed{{5}}.", names) == "Let me check. So \\boxed{5}."
    assert without_calls(f"{good}\n{good}", names) == "\n"
    assert without_calls(bare, names) == ""
    assert without_calls(f"```json\n{bare}\n```", names) == ""
    assert without_calls('{{"name": "calculator", "arguments": {}}}', names) == ""  # a near-call is a call too
    assert without_calls('{"name": "Alice", "age": 3}', names) == '{"name": "Alice", "age": 3}'  # an answer
    assert without_calls(bare, ()) == bare  # no tool of that name: an answer
    quoted = f"Write it like this:\n```\n{good}\n```\nDone: 12"
    assert without_calls(quoted, names) == quoted
    assert without_calls(f"12 <tool_call>{bare}", names) == "12 "  # unclosed: the rest of the turn is the call
    cut = '```json\n{\n  "name": "calculator",\n  "arguments": {\n    "expression": "4582'  # out of tokens
    assert without_calls(cut, names) == "" and without_calls("```\nThe product is 4582", names) != ""
    assert without_calls(good * 3 + " 7", names, CallLimits(max_calls=2)) == ""  # surplus: likewise
    assert without_calls("\\boxed{12}", names) == "\\boxed{12}"


@pytest.mark.parametrize("name", HOSTILE)
def test_without_calls_on_hostile_text_never_raises_and_is_linear(name):
    start = time.perf_counter()
    out = without_calls(HOSTILE[name], ("calculator", "clock"))
    assert time.perf_counter() - start < 1.0, name
    assert isinstance(out, str) and len(out) <= len(HOSTILE[name])
