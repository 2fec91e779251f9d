"""A tool task of your own for examples/lookup_tool: look an element's atomic number up, then answer it boxed.

Way 4 of docs/tasks.md ("Tools"): a `ToolTask` subclass with a named tool. The model writes
`<lookup>neon</lookup>` and ends its turn; `lookup` answers `10` (or raises `ToolError` for a name it does not
know: the message becomes the observation), and the model answers `\\boxed{10}`. Since this file is your code,
the tool runs in the reward workers under `data.reward_timeout`, as a reward function of yours would.
"""

import random
from pathlib import Path

from llm_pg.data.tasks import Example, ToolError, ToolTask
from llm_pg.data.tasks.math_hard import score

TABLE = Path(__file__).with_name("elements.txt")
SYSTEM_PROMPT = (
    "To look up an element, write <lookup>NAME</lookup> and end your message; the atomic number comes back in the "
    "next message. Answer as \\boxed{NUMBER}."
)


def read_table(path: Path = TABLE) -> dict[str, str]:
    return dict(line.split() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def lookup(name: str) -> str:
    """The atomic number of the element `name` (case and spaces ignored)."""
    number = read_table().get(name.strip().lower())
    if number is None:
        raise ToolError(f"no element named {name.strip()[:40]!r}")
    return number


class LookupTask(ToolTask):
    """`What is the atomic number of neon?` -> `\\boxed{10}`, with the tool `lookup`. Scored as math_hard is."""

    name = "lookup"
    components = ("correct", "boxed", "relaxed")
    tools = {"lookup": lookup}  # noqa: RUF012 (the class's tools: name -> function)

    def __init__(self, max_turns: int = 3, eval_size: int = 8, system_prompt: str | None = SYSTEM_PROMPT) -> None:
        super().__init__(max_turns=max_turns, max_tool_tokens=16, system_prompt=system_prompt, eval_size=eval_size)
        self.table = read_table()

    def _example(self, rng: random.Random) -> Example:
        name = rng.choice(sorted(self.table))
        return Example(prompt=f"What is the atomic number of {name}?", answer=self.table[name])

    def train_example(self, index: int, seed: int) -> Example:
        return self._example(random.Random(f"lookup:{seed}:{index}"))

    def build_eval_set(self) -> list[Example]:
        rng = random.Random(f"lookup-eval:{self.run_seed}")
        return [self._example(rng) for _ in range(self.eval_size)]

    def score(self, completion: str, example: Example):
        return score(completion, example.answer)
