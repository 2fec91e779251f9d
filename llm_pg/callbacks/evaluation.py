"""Greedy evaluation on the task's held-out set: at iteration 0 (the pre-RL baseline), every
`eval_every` iterations and at the end of training."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from torchmetrics.aggregation import MeanMetric

from llm_pg.data.tasks.base import Example, Task
from llm_pg.generation import generate


def run_dir(trainer: L.Trainer) -> Path:
    """Where a run writes its files: the first logger's directory, else the trainer's root dir.

    Not `trainer.log_dir`: that broadcasts, and rank-zero-only callers would deadlock under DDP.
    """
    log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
    return Path(log_dir or trainer.default_root_dir)


def evaluate(module: L.LightningModule, task: Task, examples: Sequence[Example]) -> tuple[dict[str, float], list[str]]:
    """Greedy completions for `examples` and the task's eval metrics, averaged over batches by size.

    Rank-local: under DDP rank zero evaluates alone, so the metrics must not sync across ranks.
    """
    hp = module.hparams
    means: dict[str, MeanMetric] = {}
    completions: list[str] = []
    for start in range(0, len(examples), hp.logprob_batch_size):
        batch = list(examples[start : start + hp.logprob_batch_size])
        texts = generate(
            module.policy,
            module.tokenizer,
            [task.messages(e) for e in batch],
            greedy=True,
            max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens,
            max_prompt_tokens=hp.max_prompt_tokens,
            chat_template=hp.chat_template,
        ).texts
        completions.extend(texts)
        for name, value in task.eval_metrics(texts, batch).items():
            means.setdefault(name, MeanMetric(sync_on_compute=False)).update(value, weight=len(batch))
    return {name: float(metric.compute()) for name, metric in means.items()}, completions


class EvalCallback(Callback):
    """Logs `eval/<metric>` (exact_match, format fractions, ...) on rank zero and writes the eval
    completions to `<run dir>/eval/iter_XXXXX.jsonl`."""

    def __init__(self) -> None:
        self.last_evaluated: int | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.iteration == 0:
            self._evaluate(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        if module.iteration % module.hparams.eval_every == 0:
            self._evaluate(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.last_evaluated != module.iteration:
            self._evaluate(trainer, module)

    @rank_zero_only
    def _evaluate(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.last_evaluated = module.iteration
        task = trainer.datamodule.task
        start = time.perf_counter()
        metrics, completions = evaluate(module, task, task.eval_examples)
        module.latest_eval = metrics
        logged = {f"eval/{k}": v for k, v in metrics.items()} | {"time/eval": time.perf_counter() - start}
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=module.iteration)
            logger.save()
        out = run_dir(trainer) / "eval" / f"iter_{module.iteration:05d}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for example, completion in zip(task.eval_examples, completions, strict=True):
                score = task.score(completion, example)
                row = {"prompt": example.prompt, "answer": example.answer, "completion": completion}
                f.write(json.dumps(row | {"reward": score.total, "correct": score.correct}) + "\n")
