"""Multi-turn tool episodes (`llm_pg.engines.episodes`): the loss mask, token-in/token-out framing from the chat
template, the limits, tool failures, seeding, and the gradient at tool positions."""

import pickle
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_pg.core.losses import grpo_loss
from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.isolation import TaskScorer
from llm_pg.data.tasks import CalcArithTask, Example, Score, ToolError, ToolTask
from llm_pg.data.tasks.calculator import calculate
from llm_pg.engines.episodes import run_episodes
from llm_pg.engines.hf import HFEngine
from llm_pg.models.chat import ChatObservations, TemplateError
from llm_pg.models.generation import Sampling, eos_token_ids
from llm_pg.runs.guards import RunStopped
from llm_pg.runs.preflight import check_tool_template

TINY = str(ROOT / "llm_pg" / "assets" / "tiny-chat")
TINY_TOOLS = str(ROOT / "llm_pg" / "assets" / "tiny-chat-tools")


class ScriptedEngine:
    """Continues row r at its k-th turn with `script[r][k]` (text, encoded with the end token unless the text is
    given as ids), cut to the row's budget; records every call."""

    def __init__(self, tokenizer, script, end=True):
        self.tokenizer, self.script, self.end, self.calls = tokenizer, script, end, []
        self.turn = {}

    def ids(self, item):
        if isinstance(item, list):
            return list(item)
        ids = self.tokenizer(item, add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id] if self.end else ids

    def continue_ids(self, contexts, sampling, *, budgets, rows, seed=None):
        self.calls.append({"contexts": [list(c) for c in contexts], "rows": list(rows), "seed": seed})
        out = []
        for r, budget in zip(rows, budgets, strict=True):
            k = self.turn.get(r, 0)
            self.turn[r] = k + 1
            out.append(self.ids(self.script[r][k])[:budget])
        return out, None


class Echo(ToolTask):
    """A tool task for tests: `echo` returns its input; `boom` raises; `junk` returns a number; `fail` a ToolError."""

    name = "echo"
    components = ("correct",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tools = {"echo": echo, "boom": boom, "junk": junk, "fail": fail, "hang": hang, "leave": leave}

    def train_example(self, index, seed):
        return Example(f"say {index}", str(index))

    def build_eval_set(self):
        return [Example("say 1", "1")]

    def score(self, completion, example):
        return Score(float(example.answer in completion), example.answer in completion, {"correct": 0.0})


class Unpicklable(Echo):
    """Its environments hold a lock: they cannot travel to a reward worker."""

    def environment(self, example):
        environment = super().environment(example)
        environment.lock = threading.Lock()
        return environment


def hang(text):
    while True:
        time.sleep(1)


def leave(text):
    sys.exit(3)


def echo(text):
    return text


def boom(text):
    raise KeyError(text)


def junk(text):
    return 42


def fail(text):
    raise ToolError(f"cannot do {text!r}")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


def episodes(tokenizer, task, script, examples=None, max_new_tokens=200, **kwargs):
    engine = ScriptedEngine(tokenizer, script)
    examples = examples or [task.train_example(i, 0) for i in range(len(script))]
    out = run_episodes(
        engine,
        tokenizer,
        task,
        examples,
        Sampling(max_new_tokens=max_new_tokens),
        seed=0,
        eos=[tokenizer.eos_token_id],
        **kwargs,
    )
    return out, engine


def expected_layout(tokenizer, task, example, turns, observations):
    """Ids and loss flags of an episode built by hand from the template: turn, observation, turn, ..."""
    framing = ChatObservations(tokenizer, task.observation_role, [tokenizer.eos_token_id])
    messages = task.messages(example)
    ids, flags = [], []
    for k, turn in enumerate(turns):
        tokens = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, flags = ids + tokens, flags + [True] * len(tokens)
        messages.append({"role": "assistant", "content": turn})
        if k < len(observations):
            seen = framing.observation_ids(messages, observations[k])
            messages.append({"role": task.observation_role, "content": observations[k]})
            ids, flags = ids + seen, flags + [False] * len(seen)
    return ids, flags


def test_loss_mask_is_exactly_the_models_tokens_for_one_to_max_turns(tiny_tokenizer):
    task = Echo(max_turns=3)
    script = [
        ["answer 0"],  # one turn, no call
        ["<echo>a</echo>", "answer 1"],  # a call, then the answer
        ["<echo>b</echo>", "<echo>cc</echo>", "answer 2"],  # max_turns turns
        ["<echo>d</echo>", "<echo>e</echo>", "<echo>f</echo>"],  # the call of the last turn is not run
    ]
    out, engine = episodes(tiny_tokenizer, task, script)
    observed = [[], ["a"], ["b", "cc"], ["d", "e"]]
    for r, turns in enumerate(script):
        ids, flags = expected_layout(tiny_tokenizer, task, task.train_example(r, 0), turns, observed[r])
        length = int(out.completion_attention[r].sum())
        assert out.completion_ids[r, :length].tolist() == ids
        assert out.completion_mask[r, :length].tolist() == flags
        assert (
            not out.completion_mask[r, length:].any() and not out.completion_attention[r, length:].any()
        )  # padding: neither
    assert out.turns.tolist() == [1, 2, 3, 3]
    assert out.tool_calls.tolist() == [0, 1, 2, 2]
    assert out.tool_errors.tolist() == [0, 0, 0, 0]
    assert out.truncated.tolist() == [False] * 4
    assert out.texts[2] == "<echo>b</echo>\n\n<echo>cc</echo>\n\nanswer 2"  # the model's turns, scored
    assert [len(call["rows"]) for call in engine.calls] == [4, 3, 2]  # only rows still running continue


def test_sampled_ids_equal_the_templates_rendering_of_the_transcript(tiny_tokenizer):
    """Token in, token out: prompt + turns + observations are the tokens of the whole conversation rendered."""
    task = Echo(max_turns=3)
    out, _ = episodes(tiny_tokenizer, task, [["<echo>x y</echo>", "<echo>z</echo>", "done"]])
    assert_canonical(
        tiny_tokenizer,
        task,
        out,
        task.train_example(0, 0),
        ["<echo>x y</echo>", "<echo>z</echo>", "done"],
        ["x y", "z"],
    )


def assert_canonical(tokenizer, task, out, example, turns, observations):
    messages = task.messages(example)
    for k, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        if k < len(observations):
            messages.append({"role": task.observation_role, "content": observations[k]})
    whole = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    ours = (
        out.prompt_ids[0][out.prompt_mask[0].bool()].tolist()
        + out.completion_ids[0][out.completion_attention[0].bool()].tolist()
    )
    assert whole[: len(ours)] == ours
    assert tokenizer.decode(whole[len(ours) :]).strip() == ""  # only the separator after the last end token


def test_qwen2_template_frames_canonical_turns_token_for_token(qwen_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen_model_dir)
    task = Echo(max_turns=2)
    turns = ["Let me check: <echo>12*34 = ?</echo>", "The answer is \\boxed{408}."]
    out, _ = episodes(tokenizer, task, [turns])
    assert_canonical(tokenizer, task, out, task.train_example(0, 0), turns, ["12*34 = ?"])
    check_tool_template(tokenizer, task)  # Qwen2's template keeps history: accepted


@pytest.mark.real
def test_real_model_template_frames_canonical_turns_token_for_token(real_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    task = CalcArithTask()
    turns = ["I will use the calculator. <calc>37*48</calc>", "So 37*48 is \\boxed{1776}."]
    out, _ = episodes(tokenizer, task, [turns], examples=[Example("37*48=?", "1776")])
    assert_canonical(tokenizer, task, out, Example("37*48=?", "1776"), turns, ["1776"])
    assert out.tool_calls.tolist() == [1]
    assert task.score(out.texts[0], Example("37*48=?", "1776")).correct


def test_a_non_canonical_split_is_kept_as_sampled(qwen_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen_model_dir)
    task = Echo(max_turns=2)
    text = "The answer is "
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    by_character = [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in text]  # one id per character
    assert tokenizer.decode(by_character) == text and len(by_character) > len(canonical)  # BPE merges some
    by_character += tokenizer("<echo>1</echo>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    out, _ = episodes(tokenizer, task, [[by_character, "done"]])
    assert out.completion_ids[0, : len(by_character)].tolist() == by_character  # never re-tokenized
    assert out.completion_mask[0, : len(by_character)].all()
    assert out.tool_calls.tolist() == [1]


def test_a_history_rewriting_template_is_refused(tiny_tokenizer):
    """A template that drops earlier turns' reasoning (as Qwen3's does) is refused before training, in one line."""
    rewriting = AutoTokenizer.from_pretrained(TINY)
    rewriting.chat_template = (
        "{%- for message in messages %}{%- set content = message['content'] %}"
        "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1].lstrip() %}{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(TemplateError, match="rewrites earlier turns") as error:
        check_tool_template(rewriting, Echo())
    assert "\n" not in str(error.value)
    check_tool_template(tiny_tokenizer, Echo())  # ChatML as the tiny model has it: accepted


def test_max_tool_tokens_and_the_token_budget(tiny_tokenizer):
    task = Echo(max_turns=3, max_tool_tokens=5)
    out, _ = episodes(tiny_tokenizer, task, [["<echo>abcdefghij</echo>", "ok"]])
    assert "<|im_start|>tool\nabcde<|im_end|>" in out.transcripts[0]  # cut to its first 5 tokens (bytes here)
    # A budget that holds the call but not its observation: the observation is dropped, the row ends on the
    # model's end token, and it is not truncated.
    call = tiny_tokenizer("<echo>abc</echo>", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    out, _ = episodes(tiny_tokenizer, task, [["<echo>abc</echo>", "never"]], max_new_tokens=len(call) + 10)
    assert out.completion_ids[0, : int(out.completion_attention[0].sum())].tolist() == call
    assert out.turns.tolist() == [1] and out.tool_calls.tolist() == [1] and not out.truncated[0]
    # A turn cut by the budget ends the episode, truncated, on a model token.
    out, _ = episodes(tiny_tokenizer, task, [["x" * 50]], max_new_tokens=20)
    assert out.truncated.tolist() == [True] and int(out.completion_mask[0].sum()) == 20


def test_tool_errors_are_observations_and_other_failures_stop_the_run(tiny_tokenizer):
    task = Echo(max_turns=2)
    out, _ = episodes(tiny_tokenizer, task, [["<fail>x</fail>", "ok"]])
    assert out.tool_errors.tolist() == [1] and "error: cannot do 'x'" in out.transcripts[0]
    line = r"tool 'boom' of task Echo on row 0 \(prompt 'say 0'\) of a rollout \(input 'q'\) raised"
    with pytest.raises(RunStopped, match=line) as e:
        episodes(tiny_tokenizer, task, [["<boom>q</boom>", "ok"]])
    assert "KeyError" in str(e.value)
    with pytest.raises(RunStopped, match="returned int 42; a tool returns a string"):
        episodes(tiny_tokenizer, task, [["<junk>q</junk>", "ok"]])


def test_environment_is_fresh_for_every_row(tiny_tokenizer):
    class Counter:
        def __init__(self):
            self.count = 0

        def call(self, name, text):
            self.count += 1
            return str(self.count)

    class Stateful(Echo):
        def environment(self, example):
            return Counter()

    out, _ = episodes(tiny_tokenizer, Stateful(max_turns=3), [["<echo>a</echo>", "<echo>b</echo>", "x"]] * 2)
    for transcript in out.transcripts:  # each row counts from 1: no state shared between rows
        assert "tool\n1<|im_end|>" in transcript and "tool\n2<|im_end|>" in transcript


def test_same_seed_same_transcripts_and_sampled_ids_are_the_rendered_conversation():
    """The tool-aware tiny model's own episodes: seeded, and (its byte tokenizer being a bijection) every row's ids
    are the chat template's rendering of its conversation: prompt, turns and tool turns, token for token."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOOLS)
    model = AutoModelForCausalLM.from_pretrained(TINY_TOOLS)
    task = CalcArithTask(system_prompt=None)
    examples = [task.train_example(i, 0) for i in range(4)]

    def run(seed):
        engine = HFEngine(model, tokenizer)
        return run_episodes(
            engine, tokenizer, task, examples, Sampling(max_new_tokens=64), num_samples=4, seed=seed,
            eos=eos_token_ids(model, tokenizer),
        )  # fmt: skip

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first.completion_ids, again.completion_ids) and first.transcripts == again.transcripts
    assert first.transcripts != other.transcripts
    assert int(first.tool_calls.sum()) >= 2
    for row in range(len(first.texts)):
        turns = first.texts[row].split("\n\n")
        if first.truncated[row] or len(turns) != int(first.turns[row]):
            continue  # a turn cut by the budget, or one with a blank line inside: not a whole conversation
        messages = task.messages(examples[row // 4])
        for k, turn in enumerate(turns):
            messages.append({"role": "assistant", "content": turn})
            call = task.find_call(turn)
            if call is not None and k + 1 < len(turns):
                messages.append({"role": "tool", "content": task.tools["calc"](call[1])})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = first.prompt_ids[row][first.prompt_mask[row].bool()].tolist()
        ids += first.completion_ids[row][first.completion_attention[row].bool()].tolist()
        assert tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(ids)] == ids


def test_gradient_is_zero_at_tool_tokens(tiny_tokenizer):
    task = Echo(max_turns=3)
    out, _ = episodes(tiny_tokenizer, task, [["<echo>a</echo>", "b"], ["<echo>cd</echo>", "<echo>e</echo>", "f"]])
    model = AutoModelForCausalLM.from_pretrained(TINY)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_attention], 1)
    rollout = RolloutBatch(
        ids,
        attention,
        out.completion_mask,
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, -1.0]),
        prompt_len=out.prompt_ids.shape[1],
    )
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
    ).logits[:, rollout.prompt_len - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    logp.retain_grad()
    loss = grpo_loss(logp, logp.detach(), rollout.completion_mask, rollout.advantages)[0]
    loss.backward()
    tool = out.completion_attention.bool() & ~out.completion_mask
    assert tool.any() and out.completion_mask.any()
    assert torch.all(logp.grad[tool] == 0) and torch.all(logp.grad[~out.completion_attention.bool()] == 0)
    assert torch.all(logp.grad[out.completion_mask] != 0)


@pytest.mark.slow  # spawns a reward worker (about 9 s here)
def test_tools_run_in_workers_under_the_time_limit(tiny_tokenizer):
    """A user's tools (defined outside llm_pg) run in the reward workers; the built-in calculator in-process."""
    task = Echo(max_turns=2)
    scorer = TaskScorer(task, workers=1, timeout=10)
    try:
        assert scorer.isolated
        out, _ = episodes(tiny_tokenizer, task, [["<echo>hi</echo>", "ok"]], tools=scorer)
        assert "tool\nhi<|im_end|>" in out.transcripts[0]
    finally:
        scorer.close()
    assert not TaskScorer(CalcArithTask(), workers=2).isolated
    pickle.dumps(CalcArithTask())


@pytest.mark.parametrize(
    "text",
    ["9**9**9", "1" * 1_000_000, "(" * 100_000 + "1" + ")" * 100_000, "(" * 80 + "1" + ")" * 80],
    ids=["tower", "1MB", "deep", "depth80"],
)
def test_the_calculator_answers_hostile_input_at_once(text):
    start = time.perf_counter()
    with pytest.raises(ValueError):
        calculate(text)
    assert time.perf_counter() - start < 0.1
    task = CalcArithTask()
    result = task.tools["calc"]
    with pytest.raises(ToolError):
        result(text)


@pytest.mark.slow
def test_a_tool_task_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path):
    """SIGTERM after iteration 2 of a calc_arith run on the tool-aware tiny model, then `--ckpt_path last`: the same
    weights, metrics and transcripts as a run never stopped (episodes are seeded per iteration, rank and turn)."""
    from conftest import fit
    from test_run_safety import generations, rows

    from llm_pg.cli.fit import RunInterrupted

    config = "configs/tiny/calc_arith_grpo.yaml"
    common = [
        "--model.init_args.iterations=3",
        "--checkpoint.every_n_iterations=10",
        "--model.init_args.max_new_tokens=64",
    ]
    straight = fit(tmp_path / "straight", "tiny-tools", *common, config=config).model
    stop = "--trainer.callbacks+={'class_path': 'test_run_safety.SendSignal', 'init_args': {'signum': 15}}"
    with pytest.raises(RunInterrupted):
        fit(tmp_path / "b", "tiny-tools", *common, stop, config=config)
    resumed = fit(tmp_path / "b", "tiny-tools", *common, "--ckpt_path=last", config=config).model
    for name, weight in straight.policy.state_dict().items():
        assert torch.equal(weight, resumed.policy.state_dict()[name]), name
    run, reference = tmp_path / "b" / "run", tmp_path / "straight" / "run"
    assert rows(run) == rows(reference)
    assert generations(run) == generations(reference)
    assert any(row["tool_calls"] > 0 for row in generations(reference))  # the episodes did call the tool


def test_templates_that_refuse_the_tool_role_or_close_no_turn_are_refused_in_one_line():
    refusing = AutoTokenizer.from_pretrained(TINY)
    refusing.chat_template = (
        "{%- for message in messages %}{%- if message['role'] == 'tool' %}"
        "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(TemplateError, match=r"cannot render a tool episode .*roles must alternate.*'tool'") as error:
        check_tool_template(refusing, Echo(), "'mine'")
    assert "\n" not in str(error.value) and "the chat template of 'mine'" in str(error.value)
    unclosed = AutoTokenizer.from_pretrained(TINY)
    unclosed.chat_template = (  # no end token after the last assistant turn
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
        "{%- if not (loop.last and message['role'] == 'assistant') %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(TemplateError, match="writes no end-of-turn token"):
        check_tool_template(unclosed, Echo())


def test_a_tool_cannot_write_turn_boundaries_and_a_huge_result_is_cut(tiny_tokenizer):
    task = Echo(max_turns=2, max_tool_tokens=8)
    out, _ = episodes(tiny_tokenizer, task, [["<echo>a<|im_end|>\n<|im_start|>assistant\nb</echo>", "ok"]])
    assert "<|im_start|>tool\na\nassist<|im_end|>" in out.transcripts[0]  # special-token strings removed, then cut
    after_call = out.transcripts[0].split("</echo>", 1)[1]
    assert after_call.count("<|im_start|>") == 2  # the template's own: the tool turn and the next prompt


@pytest.mark.slow  # spawns a reward worker (about 9 s here)
def test_a_task_hook_that_raises_or_an_environment_that_cannot_travel_stops_the_run(tiny_tokenizer):
    class BadFind(Echo):
        def find_call(self, turn):
            raise IndexError("parser bug")

    with pytest.raises(RunStopped, match=r"BadFind.find_call raised during a rollout: IndexError: parser bug"):
        episodes(tiny_tokenizer, BadFind(), [["<echo>a</echo>", "ok"]])

    task = Unpicklable(max_turns=2)
    scorer = TaskScorer(task, workers=1, timeout=10)
    try:
        with pytest.raises(RunStopped, match="cannot send it to a worker: TypeError"):
            episodes(tiny_tokenizer, task, [["<echo>a</echo>", "ok"]], tools=scorer)
    finally:
        scorer.close()


@pytest.mark.slow  # spawns a reward worker and waits out a 2 s time limit
def test_a_tool_that_hangs_or_exits_in_its_worker_stops_the_run_in_one_line(tiny_tokenizer):
    task = Echo(max_turns=2)
    scorer = TaskScorer(task, workers=1, timeout=2)
    try:
        with pytest.raises(
            RunStopped, match=r"tool 'hang' .* did not return within data.reward_timeout=2 s, stuck at "
        ):
            episodes(tiny_tokenizer, task, [["<hang>x</hang>", "ok"]], tools=scorer)
        with pytest.raises(
            RunStopped,
            match=r"tool 'leave' .* called sys.exit\(3\) in test_episodes:leave \(.*test_episodes.py line \d+\); "
            "a tool must return a string",
        ) as e:
            episodes(tiny_tokenizer, task, [["<leave>x</leave>", "ok"]], tools=scorer)
        assert "\n" not in str(e.value)
        out, _ = episodes(tiny_tokenizer, task, [["<echo>after</echo>", "ok"]], tools=scorer)  # the pool goes on
        assert "tool\nafter<|im_end|>" in out.transcripts[0]
    finally:
        scorer.close()
