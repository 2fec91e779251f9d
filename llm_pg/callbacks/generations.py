"""Sampled rollout completions with their rewards and advantages: a W&B table and a JSONL file."""

from __future__ import annotations

import json

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from llm_pg.runs import run_dir

COLUMNS = ["iteration", "prompt", "completion", "reward", "advantage", "components"]


class GenerationsCallback(Callback):
    """Every `log_generations_every` iterations, logs the first `rows` completions of the rollout (whole
    groups, so advantages can be read against their group) to `<run dir>/generations.jsonl` and, with a
    W&B logger, as the table `generations`."""

    def __init__(self, rows: int = 12) -> None:
        self.rows = rows

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        every = module.hparams.log_generations_every
        iteration = module.iteration - 1  # the iteration this batch was sampled for
        if every <= 0 or iteration % every != 0:
            return
        rollout, scores, examples = batch["rollout"], batch["scores"], batch["examples"]
        table = [
            [
                iteration,
                examples[rollout.prompt_index[i]].prompt,
                rollout.texts[i],
                float(rollout.rewards[i]),
                float(rollout.advantages[i]),
                json.dumps(dict(scores[i].components)),
            ]
            for i in range(min(self.rows, len(rollout)))
        ]
        path = run_dir(trainer) / "generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in table:
                f.write(json.dumps(dict(zip(COLUMNS, row, strict=True))) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table("generations", columns=COLUMNS, data=table, step=module.iteration)
