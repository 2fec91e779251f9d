"""The token ids of a tool turn, taken from the tokenizer's chat template (`ChatObservations`), and the check that
refuses a template that rewrites earlier turns (multi-turn episodes: `llm_pg.engines.episodes`). With JSON tool
calls every rendering passes the tools' schemas as `tools=`, as the prompt's did, so the template writes the same
tool block each time."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Reasoning blocks, which some templates drop from earlier turns: one with text, and an empty one.
PROBE_THINKING = ("<think>\nfirst thought\n</think>\n\n", "<think>\n\n</think>\n\n")
PROBE_CALL = "<calc>1+1</calc>"


def probe_json_call(name: str) -> str:
    """A JSON call of tool `name` as Qwen2.5 writes one, for the template checks."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'


class TemplateError(ValueError):
    """The tokenizer's chat template cannot frame tool turns token for token (it rewrites earlier turns)."""


class ChatObservations:
    """The token ids of a tool turn, from the tokenizer's chat template: render the conversation up to the model's
    last turn, and again with the tool turn and the next generation prompt; the observation is what the second
    rendering adds after the first one's end-of-turn token (so the separator after it, `\\n` in ChatML, is the
    observation's). The observation starts after a special token, so its tokens are those of the whole rendering.
    A template whose second rendering does not start with the first (one that rewrites earlier turns), or that
    refuses a turn of `role`, is a `TemplateError`.

    The tool's text is the content of that turn with the tokenizer's special-token strings removed, so a tool that
    echoes `<|im_end|>` cannot write turn boundaries of its own into the context. Several results of one turn (JSON
    calls) are consecutive tool turns, which the template frames its own way (Qwen2.5: one user turn of
    `<tool_response>` blocks). `tools`: the schemas every rendering passes as `tools=` (None: none)."""

    def __init__(
        self,
        tokenizer,
        role: str,
        eos: Sequence[int],
        name: str = "the model",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.tokenizer, self.role = tokenizer, role
        self.tools = list(tools) if tools else None
        self.name = f"the chat template of {name}"
        self.ends = [end for end in (tokenizer.decode([token]) for token in eos) if end]  # the end-of-turn texts
        self.specials = sorted({t for t in tokenizer.all_special_tokens if t} | set(self._added()), key=len)[::-1]

    def _added(self) -> list[str]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return [token.content for token in decoder.values() if getattr(token, "special", False) and token.content]

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except Exception as error:  # jinja's own errors (a template that refuses a role) are not ValueErrors
            raise TemplateError(
                f"{self.name} cannot render a tool episode ({type(error).__name__}: {error}); tool turns have the "
                f"role {self.role!r} (the task's observation_role): use a template that accepts it"
            ) from None

    def clean(self, content: str) -> str:
        """The tool's text without special-token strings."""
        for token in self.specials:
            content = content.replace(token, "")
        return content

    def observation_text(self, messages: list[dict[str, str]], content: str | Sequence[str]) -> str:
        """The text of the tool turn `content` (or of one tool turn per result, in order) after `messages` (which end
        with the model's turn)."""
        contents = [content] if isinstance(content, str) else list(content)
        before = self.render(messages, generation_prompt=False)
        cut = max((before.rfind(end) + len(end) for end in self.ends if before.rfind(end) >= 0), default=-1)
        if cut < 0:
            raise TemplateError(
                f"{self.name} writes none of the end-of-turn tokens {self.ends} after an assistant turn; tool episodes "
                "need the turn's end token in the template"
            )
        results = [{"role": self.role, "content": self.clean(text)} for text in contents]
        after = self.render([*messages, *results], generation_prompt=True)
        if not after.startswith(before[:cut]):
            raise TemplateError(
                f"{self.name} rewrites earlier turns when a {self.role!r} turn follows (the rendering with the tool "
                "turn does not start with the rendering without it), so the sampled tokens would not be the context "
                "of the next turn; use a prefix-preserving template (tokenizer chat_template) for tool tasks"
            )
        return after[cut:]

    def observation_ids(self, messages: list[dict[str, str]], content: str | Sequence[str]) -> list[int]:
        return self.tokenizer(self.observation_text(messages, content), add_special_tokens=False)["input_ids"]

    def check(self, conversation: list[dict[str, str]], call: str = PROBE_CALL, results: int = 1) -> None:
        """Refuse (`TemplateError`) a template that is not prefix-preserving on probe episodes after `conversation`
        (two model turns, each with a reasoning block, and `results` tool turns after the first, which ends with
        `call`), or whose end-of-turn token does not follow the model's turn."""
        for thinking in PROBE_THINKING:
            messages = [*conversation, {"role": "assistant", "content": thinking + call}]
            if call in self.observation_text(messages, ["2"] * results):
                raise TemplateError(
                    f"{self.name} writes no end-of-turn token {self.ends} after the model's last turn, so a turn "
                    "could not end where the template ends it; use a template that closes every assistant turn"
                )
            history = [*messages, *[{"role": self.role, "content": "2"}] * results]
            prompt = self.render(history, generation_prompt=True)
            whole = self.render([*history, {"role": "assistant", "content": thinking + "\\boxed{2}"}], False)
            if not whole.startswith(prompt):
                raise TemplateError(
                    f"{self.name} renders a finished episode otherwise than the turns it was sampled from (it "
                    "rewrites earlier turns or the generation prompt); use a prefix-preserving template (tokenizer "
                    "chat_template) for tool tasks"
                )


def tool_schemas(tools: Sequence[Callable[..., Any] | Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's JSON schema by name, what the chat template's `tools=` block shows the model and what
    `llm_pg.data.tasks.tool_calls.check_call` checks a call against: a typed function's from transformers'
    `get_json_schema` (its type hints, and its docstring's summary and `Args:`), an explicit schema as given. A function
    whose hints or docstring transformers cannot read is refused in one line naming it."""
    from transformers.utils import get_json_schema

    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if isinstance(tool, Mapping):
            schema = dict(tool)
        else:
            try:
                schema = get_json_schema(tool)
            except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
                name = getattr(tool, "__name__", repr(tool))
                raise ValueError(
                    f"tool {name}: no JSON schema ({str(error).splitlines()[0]}); give it type hints and a docstring "
                    "with a summary line and an Args: entry per parameter, or pass its schema as a mapping"
                ) from None
        name = schema.get("function", schema).get("name")
        if not isinstance(name, str) or name in schemas:
            raise ValueError(f"tool schema {schema!r:.80}: each tool needs a name of its own")
        schemas[name] = schema
    return schemas


def named_schemas(
    tools: Mapping[str, Callable[..., Any]], given: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """`tool_schemas` of a task's `tools` mapping, each schema under the name the model calls it by (the key, which
    may differ from the function's own name); `given`: explicit schemas by name, used as they are."""
    out: dict[str, dict[str, Any]] = {}
    for name, tool in tools.items():
        (schema,) = tool_schemas([(given or {}).get(name, tool)]).values()
        schema = copy.deepcopy(schema)  # a copy of its own: the key's name is written into it
        schema.get("function", schema)["name"] = name
        out[name] = schema
    return out


def task_tool_schemas(task) -> dict[str, dict[str, Any]] | None:
    """A tool task's schemas by name, what its prompts' `tools=` block shows and its JSON calls are checked against
    (`ToolTask.shows_tools`; None for the tag dialect and for a task whose calls never run). A function without a
    readable schema is a one-line ValueError naming it (the check before training calls this first)."""
    if not getattr(task, "shows_tools", False):
        return None
    return named_schemas(task.tools, task.schemas)
