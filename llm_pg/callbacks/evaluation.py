"""Greedy evaluation on the task's held-out set: at iteration 0 (the pre-RL baseline), every
`evaluation.every` iterations and at the end of training. Under DDP every rank decodes a slice of the set
(`llm_pg.callbacks.sharded_eval.evaluate`); rank zero logs the metrics and writes every row."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from llm_pg.callbacks.sharded_eval import EvalContext, Evaluation, evaluate
from llm_pg.data.tasks.base import Example
from llm_pg.models.parallel import unsharded
from llm_pg.runs.directory import run_dir


def write_eval_rows(out: Path, examples: Sequence[Example], evaluation: Evaluation, append: bool = False) -> list[dict]:
    """One JSON line per eval completion (prompt, gold answer, completion, reward, correct) into `out`; the rows. A
    tool task's completion is its transcript: the model's turns and the observations, with the turn boundaries."""
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    shown = evaluation.transcripts or evaluation.completions
    with out.open("a" if append else "w") as f:
        for example, completion, score in zip(examples, shown, evaluation.scores, strict=True):
            row = {"prompt": example.prompt, "answer": example.answer, "completion": completion}
            rows.append(row | {"reward": score.total, "correct": score.correct})
            f.write(json.dumps(rows[-1]) + "\n")
    return rows


class EvalCallback(Callback):
    """Logs `eval/<metric>` (exact_match, format fractions, ...) and writes the eval completions to
    `<run dir>/eval/iter_XXXXX.jsonl` and, with a W&B logger, to the table `eval_completions` (iteration, prompt,
    gold answer, greedy completion, reward, correct): at the start, every `every` iterations (`evaluation.every`) and at
    the end."""

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self.last_evaluated: int | None = None
        self.context: EvalContext | None = None  # the fit's, built at its first evaluation

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.context = None  # a context is one fit's

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.iteration == 0:
            self._evaluate(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        if module.iteration % self.every == 0 and module.stop_reason is None:
            self._evaluate(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # Also when a resumed run was already complete: the resume dropped its final eval (`runs.logs.trim_logs`).
        if self.last_evaluated != module.iteration and module.stop_reason is None:  # a diverged policy: no eval
            self._evaluate(trainer, module)

    def _evaluate(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.last_evaluated = module.iteration
        task = trainer.datamodule.task
        start = time.perf_counter()
        if self.context is None:
            self.context = module.eval_context(trainer.datamodule)
        with unsharded(module.policy):  # FSDP2: one gather for the whole evaluation, whatever a rank's batch count
            evaluation = evaluate(self.context, module.engine, task.eval_examples, module.iteration)  # it gathers
        module.latest_eval = metrics = evaluation.metrics
        if not trainer.is_global_zero:
            return
        logged = {f"eval/{k}": v for k, v in metrics.items()} | {"time/eval": time.perf_counter() - start}
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=module.iteration)
            logger.save()
        out = run_dir(trainer) / "eval" / f"iter_{module.iteration:05d}.jsonl"
        rows = write_eval_rows(out, task.eval_examples, evaluation)
        for logger in trainer.loggers:  # every completion, as the file: the eval set is what EM is measured on
            if isinstance(logger, WandbLogger) and rows:
                data = [[module.iteration, *row.values()] for row in rows]
                logger.log_table("eval_completions", columns=["iteration", *rows[0]], data=data, step=module.iteration)
