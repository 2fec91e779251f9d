"""The token ids of a tool turn, taken from the tokenizer's chat template (`ChatObservations`), and the check that
refuses a template that rewrites earlier turns (multi-turn episodes: `llm_pg.engines.episodes`)."""

from __future__ import annotations

from collections.abc import Sequence

PROBE_THINKING = "<think>\nfirst thought\n</think>\n\n"  # a reasoning block, which some templates drop from history


class TemplateError(ValueError):
    """The tokenizer's chat template cannot frame tool turns token for token (it rewrites earlier turns)."""


class ChatObservations:
    """The token ids of a tool turn, from the tokenizer's chat template: render the conversation up to the model's
    last turn, and again with the tool turn and the next generation prompt; the observation is what the second
    rendering adds after the first one's end-of-turn token (so the separator after it, `\\n` in ChatML, is the
    observation's). The observation starts after a special token, so its tokens are those of the whole rendering.
    A template whose second rendering does not start with the first (one that rewrites earlier turns) is a
    `TemplateError`."""

    def __init__(self, tokenizer, role: str, eos: Sequence[int], name: str = "the model") -> None:
        self.tokenizer, self.role, self.name = tokenizer, role, name
        self.ends = [tokenizer.decode([token]) for token in eos]  # the end-of-turn texts
        self.ends = [end for end in self.ends if end]

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def observation_text(self, messages: list[dict[str, str]], content: str) -> str:
        """The text of the tool turn `content` after `messages` (which end with the model's turn)."""
        before = self.render(messages, generation_prompt=False)
        cut = max((before.rfind(end) + len(end) for end in self.ends if before.rfind(end) >= 0), default=-1)
        if cut < 0:
            raise TemplateError(
                f"{self.name}'s chat template writes none of the end-of-turn tokens {self.ends} after an assistant "
                "turn; tool episodes need the turn's end token in the template"
            )
        after = self.render([*messages, {"role": self.role, "content": content}], generation_prompt=True)
        if not after.startswith(before[:cut]):
            raise TemplateError(
                f"{self.name}'s chat template rewrites earlier turns when a {self.role!r} turn follows (the rendering "
                "with the tool turn does not start with the rendering without it), so the sampled tokens would not "
                "be the context of the next turn; use a prefix-preserving template (tokenizer chat_template) for "
                "tool tasks"
            )
        return after[cut:]

    def observation_ids(self, messages: list[dict[str, str]], content: str) -> list[int]:
        return self.tokenizer(self.observation_text(messages, content), add_special_tokens=False)["input_ids"]

    def check(self, conversation: list[dict[str, str]]) -> None:
        """Refuse (`TemplateError`) a template that is not prefix-preserving on a probe episode after
        `conversation` (two model turns, each with a reasoning block, and a tool turn between)."""
        first = {"role": "assistant", "content": PROBE_THINKING + "<calc>1+1</calc>"}
        messages = [*conversation, first]
        self.observation_text(messages, "2")
        history = [*messages, {"role": self.role, "content": "2"}]
        prompt = self.render(history, generation_prompt=True)
        whole = self.render([*history, {"role": "assistant", "content": PROBE_THINKING + "\\boxed{2}"}], False)
        if not whole.startswith(prompt):
            raise TemplateError(
                f"{self.name}'s chat template renders a finished episode otherwise than the turns it was sampled "
                "from (it rewrites earlier turns or the generation prompt); use a prefix-preserving template "
                "(tokenizer chat_template) for tool tasks"
            )
