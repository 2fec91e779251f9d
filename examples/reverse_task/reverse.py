"""A Task subclass for examples/reverse_task: reverse a word from words.txt into <answer>...</answer>.

Way 3 of docs/tasks.md, for what a dataset cannot express: prompts made by code, an eval set of your own and a
reward that sees the whole `Example`. `class_path: reverse.ReverseTask` in config.yaml finds this file
because it sits beside the config.
"""

import random
from pathlib import Path

from llm_pg.data.tasks import Example, Score, Task
from llm_pg.data.tasks.answers import xml_answer

WORDS = Path(__file__).with_name("words.txt")


class ReverseTask(Task):
    """`Reverse: level` -> `<answer>level</answer>`, `Reverse: cat` -> `<answer>tac</answer>`.

    Reward = tag 0.2 (an `<answer>` tag closes) + placed 1.0 x the share of the reversed word's characters
    in their place; correct when the tag holds exactly the reversed word. Max 1.2.
    """

    name = "reverse"
    components = ("tag", "placed")  # logged as train/reward_tag, train/reward_placed

    def __init__(self, words_file: str = str(WORDS), eval_size: int = 8, system_prompt: str | None = None) -> None:
        super().__init__(system_prompt=system_prompt, eval_size=eval_size)
        self.words = Path(words_file).read_text(encoding="utf-8").split()
        if not self.words:
            raise ValueError(f"{words_file} holds no words: write one word per line")

    def _example(self, word: str) -> Example:
        return Example(prompt=f"Reverse: {word}", answer=word[::-1])

    def train_example(self, index: int, seed: int) -> Example:
        # a pure function of (seed, index): a resumed run sees the same prompts
        return self._example(random.Random(f"reverse:{seed}:{index}").choice(self.words))

    def build_eval_set(self) -> list[Example]:
        rng = random.Random(f"reverse-eval:{self.run_seed}")  # the run's seed (bind_seed)
        return [self._example(rng.choice(self.words)) for _ in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        content = xml_answer(completion)  # None when no <answer>...</answer> closes; linear time
        tag = 0.2 if content is not None else 0.0
        target = example.answer
        hits = sum(a == b for a, b in zip(content or "", target, strict=False))  # to the shorter text
        placed = hits / max(len(target), len(content or ""))
        return Score(total=tag + placed, correct=content == target, components={"tag": tag, "placed": placed})
