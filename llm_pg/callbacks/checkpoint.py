"""Checkpoints per RL iteration: Lightning's `global_step` counts optimizer steps, users count iterations."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class IterationCheckpoint(ModelCheckpoint):
    """Saves `iter_XXXXX.ckpt` every `every_n_iterations` iterations and at the last one, and keeps
    `last.ckpt` current, so `--ckpt_path last` resumes the newest iteration."""

    def __init__(self, every_n_iterations: int = 10, dirpath: str | None = None, save_top_k: int = -1) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        super().__init__(
            dirpath=dirpath,
            filename="iter_{iteration:05d}",
            auto_insert_metric_name=False,
            save_last=True,
            save_top_k=save_top_k,
            every_n_train_steps=0,
            every_n_epochs=0,
            save_on_train_epoch_end=False,
        )
        self.every_n_iterations = every_n_iterations

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        if module.iteration % self.every_n_iterations == 0 or trainer.should_stop:
            candidates = self._monitor_candidates(trainer)
            candidates["iteration"] = torch.tensor(module.iteration)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
