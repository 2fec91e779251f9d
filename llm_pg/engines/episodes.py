"""Multi-turn episodes with tools: the rollout loop of a `ToolTask`, over any engine, token in and token out.

`run_episodes` samples `num_samples` episodes per prompt. Every turn it asks the engine to continue the rows still
running from their token ids (`engine.continue_ids`: HF and vLLM both, batched, seeded per turn), never from text:
a sampled id is never decoded and encoded again (BPE is not a bijection, and the loss would then train on tokens
the model never sampled). A turn ends on an end-of-turn (EOS) id, never on a stop string. When the finished turn
holds calls of the task's tools (`ToolTask.calls`, in the task's call format), they run in order (`call_tools`: in
the reward workers, under their time limit, when the tools are user code; the k-th calls of all rows together, each
row's environment carried from its call to the next), a call the model got wrong is answered with its error, and
the observation's tokens are appended, taken from the model's own chat template (`ChatObservations`: the tool
turn(s) rendered after the conversation, with the JSON tools' schemas as `tools=` as in the prompt, and cut after
the model's end-of-turn token). A turn without a call, or a turn cut by the token budget, ends the episode.

The completion region of a row is `[turn 1 | observation 1 | turn 2 | ...]`: the attention mask covers all of it,
the loss mask only the model's turns (each with its end token). Limits: `max_turns` model turns (a call in the
last one is not run), `max_tool_tokens` tokens of observation content, and `max_new_tokens` tokens in the whole
region: an observation that would leave no room for a token after it is dropped, and the row ends on the model's
end token.

Single-turn tasks do not come here (`Sampler`): their rollouts are exactly those of `engine.generate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from llm_pg.core.rollout import derive_seed
from llm_pg.data.isolation import TaskScorer
from llm_pg.data.tasks.base import Example, Task
from llm_pg.data.tasks.tool_calls import CallError, CallErrorKind, ToolCall
from llm_pg.data.tasks.tools import ToolTask
from llm_pg.models.chat import ChatObservations, TemplateError, task_tool_schemas
from llm_pg.models.generation import Generation, Sampling, encode_prompts, pad_token_id
from llm_pg.models.parallel import unsharded
from llm_pg.runs.guards import RunStopped, checked_outcomes, quoted

KINDS = tuple(CallErrorKind)  # the columns of `Generation.tool_error_kinds`


@dataclass
class _Episodes:
    """The episodes in progress, one entry per row: the prompt's ids, the conversation so far (for the template's
    observation framing), the tool environment, the completion region's ids with their loss flags and engine
    log-probs, the model's turns as text, the counts (errors also by kind) and the calls with their observations."""

    prompts: list[list[int]]
    messages: list[list[dict]]
    environments: list
    ids: list[list[int]] = field(init=False)
    loss: list[list[bool]] = field(init=False)
    logps: list[list[float]] = field(init=False)
    turns: list[list[str]] = field(init=False)
    calls: list[int] = field(init=False)
    errors: list[int] = field(init=False)
    truncated: list[bool] = field(init=False)
    kinds: list[list[int]] = field(init=False)
    log: list[list[dict]] = field(init=False)
    has_logps: bool = False

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.ids, self.loss, self.logps = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        self.turns = [[] for _ in range(n)]
        self.calls, self.errors, self.truncated = [0] * n, [0] * n, [False] * n
        self.kinds, self.log = [[0] * len(KINDS) for _ in range(n)], [[] for _ in range(n)]


def run_episodes(
    engine,
    tokenizer,
    task: ToolTask,
    examples: Sequence[Example],
    sampling: Sampling,
    *,
    num_samples: int = 1,
    seed: int | None = None,
    eos: Sequence[int],
    context: int | None = None,
    tools: ToolTask | TaskScorer | None = None,
    where: str = "a rollout",
) -> Generation:
    """`num_samples` episodes per example (rows group-contiguous, as `engine.generate`). `tools` runs the calls (a
    `TaskScorer`, or the task itself: in-process); a tool that fails otherwise than with a `ToolError` raises
    `RunStopped` naming the row and the call (`where`: the phase, for the message)."""
    conversations = [task.messages(e) for e in examples]
    schemas = hook(task_tool_schemas, task, where=where)  # json calls: the tools= block; tags: None
    block = list(schemas.values()) if schemas else None
    encoded = encode_prompts(
        tokenizer, conversations, sampling.max_prompt_tokens, sampling.chat_template, context, sampling.max_new_tokens,
        tools=block,
    )  # fmt: skip
    prompt_ids = encoded["input_ids"].repeat_interleave(num_samples, dim=0)  # [N, P]
    prompt_mask = encoded["attention_mask"].repeat_interleave(num_samples, dim=0)  # [N, P]
    n = prompt_ids.shape[0]
    scorer = tools if isinstance(tools, TaskScorer) else TaskScorer(task, workers=0)
    row_example = [examples[r // num_samples] for r in range(n)]
    episodes = _Episodes(
        prompts=[ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)],
        messages=[list(conversations[r // num_samples]) for r in range(n)],
        environments=[hook(task.environment, example, where=where) for example in row_example],
    )
    observations = ChatObservations(tokenizer, task.observation_role, eos, tools=block)
    active = list(range(n))
    for turn in range(1, task.max_turns + 1):
        if not active:
            break
        new, new_logps = engine.continue_ids(
            [episodes.prompts[r] + episodes.ids[r] for r in active],
            sampling if turn == 1 else replace(sampling, min_new_tokens=0),  # min_new_tokens: the first turn's
            budgets=[sampling.max_new_tokens - len(episodes.ids[r]) for r in active],
            rows=active,
            seed=None if seed is None else derive_seed(seed, "turn", turn),
        )
        may_call = turn < task.max_turns
        wanted = _model_turn(episodes, active, new, new_logps, tokenizer, task, schemas, set(eos), may_call, where)
        answers = _answers(scorer, episodes, wanted, [row_example[r].prompt for r in range(n)], where)
        active = _observations(episodes, wanted, answers, observations, tokenizer, task, sampling.max_new_tokens, where)
    texts = [hook(task.scored_text, turns, where=where) for turns in episodes.turns]
    return _assembled(tokenizer, eos, prompt_ids, prompt_mask, episodes, texts, json_calls=schemas is not None)


def _model_turn(
    episodes: _Episodes, active: list[int], new: list[list[int]], new_logps, tokenizer, task: ToolTask,
    schemas: dict | None, eos: set[int], may_call: bool, where: str,
) -> list[tuple]:  # fmt: skip
    """Append each active row's sampled turn (`new`, with the engine's log-probs `new_logps` or None); returns the
    calls to answer, `(row, [ToolCall | CallError, ...])`, of the turns that ended on an end-of-turn id with calls
    (`may_call`: not the last turn). A turn cut by the budget ends its episode."""
    episodes.has_logps = episodes.has_logps or new_logps is not None
    wanted = []
    for k, r in enumerate(active):
        tokens = new[k]
        episodes.ids[r] += tokens
        episodes.loss[r] += [True] * len(tokens)
        episodes.logps[r] += new_logps[k] if new_logps is not None else [0.0] * len(tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        episodes.turns[r].append(text)
        episodes.messages[r].append({"role": "assistant", "content": text})
        if not tokens or tokens[-1] not in eos:
            episodes.truncated[r] = True  # out of tokens mid-turn: the episode ends here
            continue
        if task.call_format == "tags":  # the task's own parser, named if it raises
            call = hook(task.find_call, text, where=where)
            calls = [] if call is None else [ToolCall(*call)]
        else:
            calls = hook(task.calls, text, schemas, where=where)
        if calls and may_call:
            wanted.append((r, calls))
    return wanted


def _answers(
    scorer: TaskScorer, episodes: _Episodes, wanted: list[tuple], prompts: list[str], where: str
) -> list[list[tuple[str, CallErrorKind | None, ToolCall | None]]]:
    """Each wanted row's answers, one per call in order: `(observation, error kind or None, the call run or None)`.
    A `CallError` is answered with its message; the `ToolCall`s run in rounds (the k-th call of every row together,
    in the reward workers when the tools are user code), each row's environment carried from one call to the next."""
    answers: list[list] = [[None] * len(calls) for _, calls in wanted]
    for k in range(max((len(calls) for _, calls in wanted), default=0)):
        batch = []
        for i, (r, calls) in enumerate(wanted):
            if k < len(calls) and isinstance(calls[k], CallError):
                answers[i][k] = (calls[k].message, calls[k].kind, None)
            elif k < len(calls):
                batch.append((i, r, calls[k]))
        outcomes = checked_outcomes(
            scorer,
            [(episodes.environments[r], call.name, call.arguments) for _, r, call in batch],
            [f"row {r} (prompt {quoted(prompts[r], 60)})" for _, r, _ in batch],
            where,
        )
        for (i, r, call), outcome in zip(batch, outcomes, strict=True):
            episodes.environments[r] = outcome.environment
            answers[i][k] = (outcome.observation, CallErrorKind.TOOL_ERROR if outcome.error else None, call)
    return answers


def _observations(
    episodes: _Episodes, wanted: list[tuple], answers: list[list[tuple]], observations: ChatObservations,
    tokenizer, task: ToolTask, budget: int, where: str,
) -> list[int]:  # fmt: skip
    """Append each row's answers (one tool turn per call, framed together by the chat template: `observations`) to
    its row; returns the rows that go on to another turn (an observation that would leave no room for a token after
    it is dropped, and the row ends on the model's end token)."""
    active = []
    for (r, _calls), answer in zip(wanted, answers, strict=True):
        contents = [_cut(tokenizer, observations.clean(text), task.max_tool_tokens) for text, _, _ in answer]
        for content, (_, kind, call) in zip(contents, answer, strict=True):
            episodes.calls[r] += 1
            episodes.errors[r] += kind is not None
            if kind is not None:
                episodes.kinds[r][KINDS.index(kind)] += 1
            entry = {"turn": len(episodes.turns[r])}
            entry |= {"name": call.name, "arguments": call.arguments} if call is not None else {}
            episodes.log[r].append(entry | ({"error": str(kind)} if kind else {}) | {"observation": content})
        try:
            observed = observations.observation_ids(episodes.messages[r], contents)
        except TemplateError as error:  # a template the check before training let through
            raise RunStopped(f"{where}: {error}") from None
        episodes.messages[r] += [{"role": task.observation_role, "content": content} for content in contents]
        if len(episodes.ids[r]) + len(observed) >= budget:
            continue  # no room for a turn after it: the row ends on the model's end token
        episodes.ids[r] += observed
        episodes.loss[r] += [False] * len(observed)
        episodes.logps[r] += [0.0] * len(observed)
        active.append(r)
    return active


def episode_sums(
    turns: Tensor, tool_calls: Tensor, tool_errors: Tensor, kinds: Tensor | None = None
) -> dict[str, float]:
    """Sums over episodes (`[N]` each) of `turns`, `tool_calls`, `tool_errors` and `tool_call_rate` (episodes with a
    call), and with JSON calls (`kinds`, `[N, K]`) `tool_errors_<kind>` for each kind: divided by the episode count,
    the metrics of a rollout and of an evaluation."""
    sums = {
        "turns": float(turns.sum()),
        "tool_calls": float(tool_calls.sum()),
        "tool_errors": float(tool_errors.sum()),
        "tool_call_rate": float((tool_calls > 0).sum()),
    }
    if kinds is not None:
        sums |= {f"tool_errors_{kind}": float(kinds[:, k].sum()) for k, kind in enumerate(KINDS)}
    return sums


def hook(function, *arguments, where: str):
    """A task's own method (`environment`, `find_call`, ...) on `arguments`; what it raises stops the run in one
    line."""
    try:
        return function(*arguments)
    except Exception as error:
        name = getattr(function, "__qualname__", repr(function))
        raise RunStopped(f"{name} raised during {where}: {type(error).__name__}: {error}") from None


def _cut(tokenizer, content: str, max_tokens: int) -> str:
    """`content` cut to its first `max_tokens` tokens (it is the tool's text, not sampled: re-encoding is fine). It is
    first cut to 8 characters per allowed token (more than a token of text usually holds), so a huge result costs
    nothing to tokenize."""
    content = content[: 8 * max_tokens + 8] if len(content) > 8 * max_tokens + 8 else content
    tokens = tokenizer(content, add_special_tokens=False)["input_ids"]
    return content if len(tokens) <= max_tokens else tokenizer.decode(tokens[:max_tokens])


def _assembled(
    tokenizer, eos, prompt_ids, prompt_mask, episodes: _Episodes, texts: list[str], json_calls: bool
) -> Generation:
    ids, loss, turns = episodes.ids, episodes.loss, episodes.turns
    logps = episodes.logps if episodes.has_logps else None
    n = len(ids)
    width = max(max((len(row) for row in ids), default=0), 1)  # C
    pad = pad_token_id(tokenizer, eos)
    completion = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    sampled = torch.zeros((n, width), dtype=torch.float32) if logps is not None else None
    for r in range(n):
        length = len(ids[r])
        completion[r, :length] = torch.tensor(ids[r], dtype=torch.long)
        attention[r, :length] = 1
        loss_mask[r, :length] = torch.tensor(loss[r], dtype=torch.bool)
        if sampled is not None:
            sampled[r, :length] = torch.tensor(logps[r], dtype=torch.float32)
    return Generation(
        prompt_ids,
        prompt_mask,
        completion,
        texts,
        completion_mask=loss_mask,
        completion_attention=attention,
        transcripts=[tokenizer.decode(row, skip_special_tokens=False) for row in ids],
        turns=torch.tensor([len(t) for t in turns], dtype=torch.long),
        tool_calls=torch.tensor(episodes.calls, dtype=torch.long),
        tool_errors=torch.tensor(episodes.errors, dtype=torch.long),
        truncated=torch.tensor(episodes.truncated, dtype=torch.bool),
        sampled_logp=sampled,
        tool_error_kinds=torch.tensor(episodes.kinds, dtype=torch.long).view(n, len(KINDS)) if json_calls else None,
        calls=episodes.log,
    )


@dataclass(frozen=True)
class Sampler:
    """A fit's way from prompts to completions, built once by the module (`PolicyGradientModule.sampler`): `engine`
    (`__call__`'s first argument) sampling `examples` of `task`, with `engine.generate` for a single-turn task and
    `run_episodes` for a `ToolTask`, whose tools `scorer` runs (the data module's reward workers, or the task
    itself). Rollouts and evaluations both come here.

    Args:
        task: the fit's task.
        scorer: what scores completions and runs tools (`llm_pg.runs.guards.scorer_of`).
        tokenizer: the policy's tokenizer.
        eos: every id that ends a turn (`llm_pg.models.generation.eos_token_ids`).
        policy: the trained model (a tool task's episode loop gathers an FSDP2-sharded one once).
        device: where the completions go.
    """

    task: Task
    scorer: Task | TaskScorer
    tokenizer: object
    eos: tuple[int, ...]
    policy: torch.nn.Module
    device: torch.device | str = "cpu"

    def __call__(
        self, engine, examples: Sequence[Example], sampling: Sampling, *, num_samples: int = 1, seed=None, where=""
    ) -> Generation:
        """`num_samples` completions of each of `examples` (rows group-contiguous). Raises `PromptTooLong`, and
        `RunStopped` for a tool that failed."""
        task = self.task
        if not isinstance(task, ToolTask):
            return engine.generate([task.messages(e) for e in examples], sampling, num_samples=num_samples, seed=seed)
        # FSDP2: one gather for the whole episode loop, whose number of engine calls differs between ranks
        with unsharded(self.policy):
            generation = run_episodes(
                engine,
                self.tokenizer,
                task,
                examples,
                sampling,
                num_samples=num_samples,
                seed=seed,
                eos=list(self.eos),
                context=engine.context,
                tools=self.scorer,
                where=where,
            )
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention",
                     "sampled_logp", "tool_error_kinds"):  # fmt: skip
            value = getattr(generation, name)
            if value is not None:
                setattr(generation, name, value.to(self.device))
        return generation


__all__ = [
    "ChatObservations",
    "RunStopped",
    "Sampler",
    "TemplateError",
    "run_episodes",
]
