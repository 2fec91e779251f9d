"""The token ids of a tool turn, taken from the tokenizer's chat template (`ChatObservations`), and the check that
refuses a template that rewrites earlier turns (multi-turn episodes: `llm_pg.engines.episodes`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Reasoning blocks, which some templates drop from earlier turns: one with text, and an empty one.
PROBE_THINKING = ("<think>\nfirst thought\n</think>\n\n", "<think>\n\n</think>\n\n")
PROBE_CALL = "<calc>1+1</calc>"


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
    echoes `<|im_end|>` cannot write turn boundaries of its own into the context."""

    def __init__(self, tokenizer, role: str, eos: Sequence[int], name: str = "the model") -> None:
        self.tokenizer, self.role = tokenizer, role
        self.name = f"the chat template of {name}"
        self.ends = [end for end in (tokenizer.decode([token]) for token in eos) if end]  # the end-of-turn texts
        self.specials = sorted({t for t in tokenizer.all_special_tokens if t} | set(self._added()), key=len)[::-1]

    def _added(self) -> list[str]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return [token.content for token in decoder.values() if getattr(token, "special", False) and token.content]

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
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

    def observation_text(self, messages: list[dict[str, str]], content: str) -> str:
        """The text of the tool turn `content` after `messages` (which end with the model's turn)."""
        before = self.render(messages, generation_prompt=False)
        cut = max((before.rfind(end) + len(end) for end in self.ends if before.rfind(end) >= 0), default=-1)
        if cut < 0:
            raise TemplateError(
                f"{self.name} writes none of the end-of-turn tokens {self.ends} after an assistant turn; tool episodes "
                "need the turn's end token in the template"
            )
        after = self.render([*messages, {"role": self.role, "content": self.clean(content)}], generation_prompt=True)
        if not after.startswith(before[:cut]):
            raise TemplateError(
                f"{self.name} rewrites earlier turns when a {self.role!r} turn follows (the rendering with the tool "
                "turn does not start with the rendering without it), so the sampled tokens would not be the context "
                "of the next turn; use a prefix-preserving template (tokenizer chat_template) for tool tasks"
            )
        return after[cut:]

    def observation_ids(self, messages: list[dict[str, str]], content: str) -> list[int]:
        return self.tokenizer(self.observation_text(messages, content), add_special_tokens=False)["input_ids"]

    def check(self, conversation: list[dict[str, str]]) -> None:
        """Refuse (`TemplateError`) a template that is not prefix-preserving on probe episodes after `conversation`
        (two model turns, each with a reasoning block, and a tool turn between), or whose end-of-turn token does not
        follow the model's turn."""
        for thinking in PROBE_THINKING:
            messages = [*conversation, {"role": "assistant", "content": thinking + PROBE_CALL}]
            if PROBE_CALL in self.observation_text(messages, "2"):
                raise TemplateError(
                    f"{self.name} writes no end-of-turn token {self.ends} after the model's last turn, so a turn "
                    "could not end where the template ends it; use a template that closes every assistant turn"
                )
            history = [*messages, {"role": self.role, "content": "2"}]
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
