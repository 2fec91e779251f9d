"""Sampled rollout completions with their gold answer, rewards and advantages: a W&B table and a JSONL file."""

from __future__ import annotations

import json

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from llm_pg.core.losses import completion_mask
from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.tasks.base import Example, Score
from llm_pg.models.generation import eos_token_ids
from llm_pg.runs.directory import run_dir

# `iteration` first: `llm_pg.runs.logs.trim_logs` reads it to drop the rows a resume replays.
LEADING = ["iteration", "prompt", "answer", "completion", "reward"]
TRAILING = ["correct", "advantage", "length", "truncated"]
EPISODE = ["turns", "tool_calls", "calls"]  # a tool task's rows


def table_rows(
    iteration: int,
    rollout: RolloutBatch,
    scores: list[Score],
    examples: list[Example],
    eos: list[int],
    group_size: int,
    max_rows: int,
) -> tuple[list[str], list[list]]:
    """The columns and rows of one iteration's table: the first whole groups of the rollout, as many as fit in
    `max_rows` (at least one group).

    Per completion: the prompt and its gold answer, the completion text, its reward and one `reward_<component>`
    column per reward term, `correct`, the advantage the update used, `length` (completion tokens up to and
    including the first EOS, whatever `mask_truncated` did to the mask) and `truncated` (no EOS: it reached
    `max_new_tokens`).

    A tool task's rows (episodes) show the transcript as the completion (the model's turns and the observations,
    with the chat template's turn boundaries), `length` counts the whole region (turns and observations), and three
    more columns give the model's `turns`, the `tool_calls` made and the `calls` themselves (a list, each with its
    turn, tool name, arguments, observation and, when it was answered with one, its error kind; in the W&B table as
    JSON text)."""
    count = min(len(rollout), max(group_size, max_rows // group_size * group_size))
    ids = rollout.completion_ids[:count]  # [n, C]
    episodes = rollout.turns is not None
    if episodes:
        lengths = rollout.attention_mask[:count, rollout.prompt_len :].sum(1).tolist()  # [n]
        truncated = rollout.truncated[:count].tolist()
    else:
        lengths = completion_mask(ids, eos).sum(1).tolist()  # [n]
        truncated = [not any(token in eos for token in row) for row in ids.tolist()]
    components = list(scores[0].components) if scores else []
    columns = LEADING + [f"reward_{name}" for name in components] + TRAILING + (EPISODE if episodes else [])
    shown = rollout.transcripts if episodes else rollout.texts
    calls = rollout.calls or [[] for _ in range(count)]
    rows = []
    for i in range(count):
        example = examples[rollout.prompt_index[i]]
        score = scores[i]
        rows.append(
            [iteration, example.prompt, example.answer, shown[i], float(score.total)]  # the task's value
            + [float(score.components.get(name, 0.0)) for name in components]
            + [bool(score.correct), float(rollout.advantages[i]), int(lengths[i]), bool(truncated[i])]
            + ([int(rollout.turns[i]), int(rollout.tool_calls[i]), calls[i]] if episodes else [])
        )
    return columns, rows


class GenerationsCallback(Callback):
    """Every `log_generations.every` iterations (iterations 1, 1 + every, ...: the base policy's samples first), logs
    whole groups of the rollout, at most `log_generations.rows` rows (so advantages can be read against their group),
    to `<run dir>/generations.jsonl` and, with a W&B logger, as the table `generations` (`table_rows` gives the
    columns). A row's `iteration` is the 1-based iteration that sampled it, the `step` of its metrics row.
    The module builds it with its settings (`every`: `log_generations.every`, 0: never; `rows`:
    `log_generations.rows`; `group_size`)."""

    def __init__(self, every: int = 10, rows: int = 24, group_size: int = 6) -> None:
        self.every, self.rows, self.group_size = every, rows, group_size

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        iteration = module.iteration  # 1-based: the iteration that sampled this batch, the `step` it is logged at
        scored = batch.rollout  # the RolloutCallback's ScoredRollout
        due = self.every > 0 and (iteration - 1) % self.every == 0  # 1, 1 + every, ...
        if not due or not len(scored.rows):
            return
        columns, table = table_rows(
            iteration,
            scored.rows,
            scored.scores,
            scored.examples,
            eos_token_ids(module.policy, module.tokenizer),
            self.group_size,
            self.rows,
        )
        path = run_dir(trainer) / "generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in table:
                f.write(json.dumps(dict(zip(columns, row, strict=True))) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                cells = [[json.dumps(v) if isinstance(v, list) else v for v in row] for row in table]  # text cells
                logger.log_table("generations", columns=columns, data=cells, step=module.iteration)
