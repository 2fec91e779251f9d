"""JSON tool calls in episodes (issue 41): the tools' schemas in the chat template's `tools=` block, several calls
a turn answered in one observation, errors the model reads (counted by kind), token in and token out on Qwen2.5's
template, the check before training with `tools=`, and tool tasks written in YAML only."""

import json
import time
from typing import ClassVar

import pytest
import torch
from test_episodes import TINY, episodes
from transformers import AutoTokenizer

from llm_pg.callbacks.generations import table_rows
from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.isolation import TaskScorer, runs_user_code
from llm_pg.data.tasks import CalcArithTask, DatasetToolTask, Example, Score, ToolEnvironment, ToolError, ToolTask
from llm_pg.data.tasks.tool_calls import CallErrorKind
from llm_pg.engines.episodes import KINDS, episode_sums
from llm_pg.models.chat import TemplateError, named_schemas, task_tool_schemas
from llm_pg.runs.guards import RunStopped
from llm_pg.runs.preflight import check_tool_template


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return str(a + b)


def lookup(key: str) -> str:
    """Look a word up.

    Args:
        key: the word
    """
    if key == "missing":
        raise ToolError(f"no entry for {key!r}")
    return key.upper()


def tally(n: int) -> str:
    """Add n to the episode's running total and return the total.

    Args:
        n: how much to add
    """
    raise AssertionError("Tally.call answers tally")  # the environment keeps the total


def stall(seconds: int) -> str:
    """Wait.

    Args:
        seconds: how long
    """
    while True:
        time.sleep(1)


class Tally(ToolEnvironment):
    """An environment with state: the running total of one episode's `tally` calls."""

    def __init__(self, tools):
        super().__init__(tools)
        self.total = 0

    def call(self, name, arguments):
        if name == "tally":
            self.total += arguments["n"]
            return str(self.total)
        return super().call(name, arguments)


class Adder(ToolTask):
    """A JSON tool task for tests: `add(a, b)` and `lookup(key)`; the answer is in the last turn."""

    name = "adder"
    components = ("correct",)
    tools: ClassVar = {"add": add, "lookup": lookup}

    def __init__(self, **kwargs):
        super().__init__(call_format="json", **kwargs)

    def train_example(self, index, seed):
        return Example(f"What is {index}+{index}?", str(2 * index))

    def build_eval_set(self):
        return [Example("What is 1+1?", "2")]

    def score(self, completion, example):
        correct = f"\\boxed{{{example.answer}}}" in completion
        return Score(float(correct), correct, {"correct": float(correct)})


class Tallying(Adder):
    """Adder's tools and `tally`, whose total lives in the episode's environment, and `stall`, which hangs."""

    tools: ClassVar = {"add": add, "tally": tally, "stall": stall}

    def environment(self, example):
        return Tally(self.tools)


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_model_dir):
    return AutoTokenizer.from_pretrained(qwen_model_dir)


def rendered(tokenizer, task, example, turns, results):
    """The whole conversation as Qwen2.5's template renders it with `tools=`: each turn as the text the model
    sampled, then its results as consecutive tool messages."""
    messages = task.messages(example)
    for k, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        messages += [{"role": "tool", "content": text} for text in (results[k] if k < len(results) else [])]
    text = tokenizer.apply_chat_template(messages, tools=list(task_tool_schemas(task).values()), tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_schemas_are_transformers_get_json_schema_under_the_name_the_model_calls():
    from transformers.utils import get_json_schema

    schemas = task_tool_schemas(Adder())
    assert schemas["add"] == get_json_schema(add)
    assert named_schemas({"plus": add})["plus"]["function"]["name"] == "plus"  # the key is the name
    assert (
        named_schemas({"plus": add})["plus"]["function"]["parameters"] == get_json_schema(add)["function"]["parameters"]
    )
    assert task_tool_schemas(Adder(max_turns=1)) is None  # no call can run: the tools are not shown
    assert task_tool_schemas(CalcArithTask()) is None  # tags: no tools= block
    clock = {"type": "function", "function": {"name": "clock", "description": "The time.", "parameters": None}}

    class Given(Adder):
        schemas: ClassVar = {"lookup": clock}  # an explicit schema, under the name the model calls

    assert task_tool_schemas(Given())["lookup"]["function"] == {**clock["function"], "name": "lookup"}


def test_several_calls_a_turn_ids_are_the_templates_rendering_and_the_mask_is_the_models_tokens(qwen_tokenizer):
    task = Adder(max_turns=3)
    two_calls = "I will add both.\n" + call("add", a=2, b=3) + "\n" + call("lookup", key="sum")
    script = [
        [two_calls, "So \\boxed{0}."],  # two calls in one turn: one observation, two tool messages
        [call("add", a=1), "Hm.", "unused"],  # a wrong call: its error is the observation, then the model answers
        ['{"name": "add", "arguments": {"a": 4, "b": 5}}', "\\boxed{4}"],  # a bare call (Qwen2.5-Coder's habit)
        ["\\boxed{6}"],  # no call: one turn
    ]
    out, engine = episodes(qwen_tokenizer, task, script, max_new_tokens=400)
    results = [[["5", "SUM"]], [["error: add: missing required argument 'b'"]], [["9"]], []]
    for r, turns in enumerate(script):
        turns = turns[: len(results[r]) + 1]
        example = task.train_example(r, 0)
        whole = rendered(qwen_tokenizer, task, example, turns, results[r])
        prompt = out.prompt_ids[r][out.prompt_mask[r].bool()].tolist()
        region = out.completion_ids[r][out.completion_attention[r].bool()].tolist()
        assert whole[: len(prompt) + len(region)] == prompt + region  # token in, token out
        assert qwen_tokenizer.decode(whole[len(prompt) + len(region) :]).strip() == ""  # the last separator only
        # the loss mask is exactly the model's sampled tokens: each turn with its end token
        sampled = [t for turn in turns for t in engine.ids(turn)]
        mask = out.completion_mask[r][out.completion_attention[r].bool()]
        assert [t for t, m in zip(region, mask.tolist(), strict=True) if m] == sampled
        assert "# Tools" in qwen_tokenizer.decode(prompt) and '"name": "lookup"' in qwen_tokenizer.decode(prompt)
    assert out.turns.tolist() == [2, 2, 2, 1]
    assert out.tool_calls.tolist() == [2, 1, 1, 0]
    assert out.tool_errors.tolist() == [0, 1, 0, 0]
    kinds = out.tool_error_kinds
    assert kinds.shape == (4, len(KINDS)) and kinds[1, KINDS.index(CallErrorKind.BAD_ARGUMENTS)] == 1
    assert int(kinds.sum()) == 1
    assert out.calls[0] == [
        {"turn": 1, "name": "add", "arguments": {"a": 2, "b": 3}, "observation": "5"},
        {"turn": 1, "name": "lookup", "arguments": {"key": "sum"}, "observation": "SUM"},
    ]
    assert out.calls[1] == [
        {"turn": 1, "error": "bad_arguments", "observation": "error: add: missing required argument 'b'"}
    ]
    assert "<tool_response>\n5\n</tool_response>\n<tool_response>\nSUM\n</tool_response>" in out.transcripts[0]
    assert out.transcripts[0].count("<|im_start|>user") == 1  # one tool turn holds both results


def test_error_kinds_and_a_tool_error_are_observations_the_model_reads(qwen_tokenizer):
    task = Adder(max_turns=2)
    turns = [
        call("lookup", key="missing"),  # the tool raises ToolError
        call("nope"),  # unknown_tool
        "<tool_call>{not json}</tool_call>",  # bad_json
        "<tool_call>[1, 2]</tool_call>",  # not_a_call
        "<tool_call>" + '{"name": "add"',  # unclosed
        "\n".join([call("lookup", key="k")] * (task.call_limits.max_calls + 1)),  # too_many: the first 8 run
    ]
    out, _ = episodes(qwen_tokenizer, task, [[turn, "done"] for turn in turns], max_new_tokens=4000)
    sums = episode_sums(out.turns, out.tool_calls, out.tool_errors, out.tool_error_kinds)
    assert {kind: sums[f"tool_errors_{kind}"] for kind in KINDS} == {
        "unclosed": 1,
        "too_many": 1,
        "bad_json": 1,
        "not_a_call": 1,
        "unknown_tool": 1,
        "bad_arguments": 0,
        "tool_error": 1,
    }
    assert out.calls[0][0]["observation"] == "error: no entry for 'missing'"
    assert out.tool_calls.tolist() == [1, 1, 1, 1, 1, 9] and out.tool_errors.tolist() == [1, 1, 1, 1, 1, 1]
    assert out.turns.tolist() == [2] * 6  # every error is answered and the model goes on


def test_the_tag_dialect_logs_its_calls_and_has_no_error_kinds():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    task = CalcArithTask(system_prompt=None)
    out, _ = episodes(tokenizer, task, [["<calc>37*48</calc>", "\\boxed{1776}"]], examples=[Example("37*48=?", "1776")])
    assert out.tool_error_kinds is None and out.tool_calls.tolist() == [1]
    assert out.calls == [[{"turn": 1, "name": "calc", "arguments": "37*48", "observation": "1776"}]]


def test_the_check_before_training_passes_tools_and_refuses_a_history_rewriting_template(qwen_tokenizer):
    check_tool_template(qwen_tokenizer, Adder())  # Qwen2.5's template with tools=: prefix-preserving
    stripping = AutoTokenizer.from_pretrained(qwen_tokenizer.name_or_path)
    stripping.chat_template = qwen_tokenizer.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content if loop.last else "
        "message.content.split('</think>')[-1]) + '<|im_end|>' + '\\n' }}",
    )
    assert stripping.chat_template != qwen_tokenizer.chat_template  # Qwen3's way: earlier turns lose their reasoning
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        check_tool_template(stripping, Adder())

    special = AutoTokenizer.from_pretrained(qwen_tokenizer.name_or_path)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    with pytest.raises(TemplateError, match="marks <tool_call> as a special token"):
        check_tool_template(special, Adder())  # a turn's text, decoded without special tokens, would lose the tags

    class Untyped(Adder):
        tools: ClassVar = {"add": lambda a, b: str(a + b)}

    with pytest.raises(ValueError, match="no JSON schema"):
        check_tool_template(qwen_tokenizer, Untyped())


def test_the_generations_table_shows_the_calls(qwen_tokenizer):
    task = Adder(max_turns=2)
    out, _ = episodes(qwen_tokenizer, task, [[call("add", a=1, b=1), "\\boxed{2}"]], max_new_tokens=300)
    prompt_len = out.prompt_ids.shape[1]
    rollout = RolloutBatch(
        input_ids=torch.cat([out.prompt_ids, out.completion_ids], 1),
        attention_mask=torch.cat([out.prompt_mask, out.completion_attention], 1),
        completion_mask=out.completion_mask,
        rewards=torch.zeros(1),
        advantages=torch.zeros(1),
        prompt_len=prompt_len,
        texts=out.texts,
        prompt_index=[0],
        truncated=out.truncated,
        turns=out.turns,
        tool_calls=out.tool_calls,
        tool_errors=out.tool_errors,
        transcripts=out.transcripts,
        tool_error_kinds=out.tool_error_kinds,
        calls=out.calls,
    )
    scores = [task.score(out.texts[0], task.train_example(0, 0))]
    columns, rows = table_rows(1, rollout, scores, [task.train_example(0, 0)], [qwen_tokenizer.eos_token_id], 1, 4)
    row = dict(zip(columns, rows[0], strict=True))
    assert row["calls"] == [{"turn": 1, "name": "add", "arguments": {"a": 1, "b": 1}, "observation": "2"}]
    assert json.loads(json.dumps(row))["calls"][0]["arguments"] == {"a": 1, "b": 1}


def test_a_yaml_only_tool_task(tmp_path, qwen_tokenizer):
    rows = [{"question": f"What is {a}*{a + 1}?", "answer": str(a * (a + 1))} for a in range(10, 30)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = DatasetToolTask(
        data_files={"train": str(tmp_path / "train.jsonl")},
        prompt_column="question",
        rewards=["boxed_number"],
        tools=["calculator"],
        eval_size=4,
    )
    assert not runs_user_code(task)  # the built-in calculator runs in-process
    assert list(task_tool_schemas(task)) == ["calculator"]
    example = task.eval_examples[0]
    a, b = (int(x) for x in example.prompt.removeprefix("What is ").removesuffix("?").split("*"))
    turns = ['{"name": "calculator", "arguments": {"expression": "' + f"{a}*{b}" + '"}}', f"\\boxed{{{a * b}}}"]
    out, _ = episodes(qwen_tokenizer, task, [turns], examples=[example], max_new_tokens=300)
    assert out.calls[0][0]["observation"] == str(a * b)
    assert task.score(out.texts[0], example).correct
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        DatasetToolTask(data_files={"train": str(tmp_path / "train.jsonl")}, tools=["abacus"])
    with pytest.raises(ValueError, match="tool 'nomodule_xyz:f': no module"):
        DatasetToolTask(data_files={"train": str(tmp_path / "train.jsonl")}, tools=["nomodule_xyz:f"])


def test_a_json_task_scores_the_turns_without_their_calls(qwen_tokenizer):
    """Qwen2.5-Coder-0.5B's habit: call, then call again with the result. Its last call's arguments end on the gold
    number, which math_hard's `relaxed` term would pay (0.1) if calls were scored as text: they are not, in the
    episode and in the task's `scored_text`. The tag dialect scores its turns whole, as before."""
    task = CalcArithTask(call_format="json", max_turns=2)
    example = Example("37*48=?", "1776")

    def calc(expression):
        return '{"name": "calculator", "arguments": {"expression": "' + expression + '"}}'

    echo = [calc("37*48"), calc("1776")]  # the second call is in the last turn: not run
    out, _ = episodes(qwen_tokenizer, task, [echo], examples=[example], max_new_tokens=300)
    assert out.tool_calls.tolist() == [1] and out.turns.tolist() == [2] and out.texts == [""]
    assert task.score(out.texts[0], example).total == 0.0
    assert task.score("\n\n".join(echo), example).components["relaxed"] == 0.1  # what scoring the calls paid
    answer = [calc("37*48"), "So 37*48 is " + "<tool_call>" + calc("1776")[:-1] + "</tool_call>" + " \\boxed{1776}."]
    out, _ = episodes(qwen_tokenizer, task, [answer], examples=[example], max_new_tokens=300)
    assert out.texts == ["So 37*48 is  \\boxed{1776}."] and task.score(out.texts[0], example).correct
    tags = CalcArithTask(call_format="tags")
    assert tags.scored_text(["<calc>37*48</calc>", "\\boxed{1776}"]) == "<calc>37*48</calc>\n\n\\boxed{1776}"


def test_a_call_format_typo_is_refused_in_one_line():
    with pytest.raises(ValueError, match="call_format must be one of tags, json, got 'JSON'"):
        CalcArithTask(call_format="JSON")


def test_typed_user_tools_run_in_a_worker_with_the_environment_carried_between_a_turns_calls(qwen_tokenizer):
    task = Tallying(max_turns=3)
    scorer = TaskScorer(task, workers=1, timeout=10)
    try:
        assert scorer.isolated  # the tools are not llm_pg's: a reward worker runs them
        turn = call("tally", n=2) + "\n" + call("add", a=1, b=1) + "\n" + call("tally", n=3)
        script = [[turn, call("tally", n=10), "\\boxed{15}"], [call("tally", n=7), "done"]]
        out, _ = episodes(qwen_tokenizer, task, script, max_new_tokens=3000, tools=scorer)
    finally:
        scorer.close()
    assert [c["observation"] for c in out.calls[0]] == ["2", "2", "5", "15"]  # the total travels with each call
    assert [c["observation"] for c in out.calls[1]] == ["7"]  # a fresh environment for every row
    assert out.calls[0][1] == {"turn": 1, "name": "add", "arguments": {"a": 1, "b": 1}, "observation": "2"}


@pytest.mark.slow  # spawns a reward worker and waits out a 2 s time limit
def test_a_typed_tool_that_hangs_in_its_worker_stops_the_run_in_one_line(qwen_tokenizer):
    task = Tallying(max_turns=2)
    scorer = TaskScorer(task, workers=1, timeout=2)
    try:
        with pytest.raises(RunStopped, match=r"tool 'stall' .* \(input '\{\"seconds\": 5\}'\) did not return within"):
            episodes(qwen_tokenizer, task, [[call("stall", seconds=5), "done"]], max_new_tokens=500, tools=scorer)
    finally:
        scorer.close()


def test_trimming_a_rollout_cuts_the_completion_fields_only():
    """`tool_error_kinds` is `[N, K]` with K = 7: a completion 7 wide must not make it look like a completion field."""
    n, prompt, width = 2, 3, len(KINDS)
    kinds = torch.arange(n * width).view(n, width)
    attention = torch.ones(n, prompt + width, dtype=torch.long)
    attention[:, prompt + 2 :] = 0  # the longest completion is 2 tokens
    rollout = RolloutBatch(
        input_ids=torch.zeros(n, prompt + width, dtype=torch.long),
        attention_mask=attention,
        completion_mask=attention[:, prompt:].bool(),
        rewards=torch.zeros(n),
        prompt_len=prompt,
        tool_error_kinds=kinds,
    )
    cut = rollout.trimmed()
    assert cut.input_ids.shape == (n, prompt + 2) and cut.completion_mask.shape == (n, 2)
    assert torch.equal(cut.tool_error_kinds, kinds)


def test_shots_show_worked_products_the_arms_way_before_the_question(qwen_tokenizer):
    """calc_arith's `shots`: with the tool, each worked product is the template's own rendering of a call, the
    calculator's result and the boxed answer; without it (max_turns 1), the product written out. Both arms show the
    same products; an episode after them is still token in, token out."""
    with_tool, without = (
        CalcArithTask(call_format="json", shots=2),
        CalcArithTask(call_format="json", shots=2, max_turns=1),
    )
    example = Example("37*48=?", "1776")
    shown = with_tool.messages(example)
    assert [m["role"] for m in shown] == ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]
    assert shown[-1]["content"] == "37*48=?" and CalcArithTask(call_format="json").messages(example) == [
        shown[0],
        shown[-1],
    ]
    products = [m["content"][: -len("=?")] for m in shown[1:-1] if m["role"] == "user"]
    assert [m["content"] for m in without.messages(example)[1:-1] if m["role"] == "user"] == [
        p + "=?" for p in products
    ]
    text = qwen_tokenizer.apply_chat_template(
        shown, tools=list(task_tool_schemas(with_tool).values()), tokenize=False, add_generation_prompt=True
    )
    a, b = (int(x) for x in products[0].split("*"))
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + products[0] + '"}}\n</tool_call>'
        f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is \\boxed{{{a * b}}}.<|im_end|>"
    ) in text
    assert without.messages(example)[2]["content"] == f"{products[0]} = {a * b}. The answer is \\boxed{{{a * b}}}."
    check_tool_template(qwen_tokenizer, with_tool)  # the shown history keeps the template prefix-preserving
    turns = [call("calculator", expression="37*48"), "\\boxed{1776}"]
    out, _ = episodes(qwen_tokenizer, with_tool, [turns], examples=[example], max_new_tokens=300)
    whole = rendered(qwen_tokenizer, with_tool, example, turns, [["1776"]])
    prompt = out.prompt_ids[0][out.prompt_mask[0].bool()].tolist()
    region = out.completion_ids[0][out.completion_attention[0].bool()].tolist()
    assert whole[: len(prompt) + len(region)] == prompt + region and out.texts == ["\\boxed{1776}"]
    with pytest.raises(ValueError, match="shots with the tool need call_format: json"):
        CalcArithTask(call_format="tags", shots=1)
    with pytest.raises(ValueError, match="shots must be >= 0"):
        CalcArithTask(call_format="json", shots=-1)
