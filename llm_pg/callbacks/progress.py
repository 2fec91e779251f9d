"""The progress bar of `llm-pg fit`: RL iterations done of `model.iterations`, elapsed, ETA, reward and eval EM."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class IterationProgressBar(RichProgressBar):
    """Lightning's rich bar counting RL iterations: `iteration ━━━━ 12/30 0:00:10 • 0:00:15 1.2it/s reward: 1.2
    eval_em: 0.9`.

    Lightning's own bar counts batches of an epoch, and the prompt stream has no epochs (`max_epochs: -1`), so it
    reads `Epoch 0/-2 ... 12/--`. Here the total is `model.iterations`, and the count is `module.iteration`, so a
    resumed run starts at the iteration of its checkpoint. `reward` (this iteration's mean) and `eval_em` (the
    latest evaluation) are what `training_step` logs with `prog_bar=True`.
    """

    @property
    def total_train_batches(self) -> int:
        """`model.iterations`: Lightning's hook for the bar's total (a finite total is what gives an ETA)."""
        return self.trainer.lightning_module.hparams.iterations

    def _get_train_description(self, current_epoch: int) -> str:
        return "iteration"

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, module)
        if self.progress is not None and self.train_progress_bar_id is not None and module.iteration > 0:
            # A resumed run starts at its checkpoint's iteration; `reset` (not `update`) so the ETA does not count
            # those iterations as done in no time.
            self.progress.reset(
                self.train_progress_bar_id, total=self.total_train_batches, completed=self._done(module)
            )
            self.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        # Lightning's bar shows `batch_idx + 1`; the iteration is what counts here (the same, except after a resume).
        super().on_train_batch_end(trainer, module, outputs, batch, self._done(module) - 1)

    @staticmethod
    def _done(module: L.LightningModule) -> int:
        return min(module.iteration, module.hparams.iterations)

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)  # the W&B run id's tail: says nothing while training
        return metrics
