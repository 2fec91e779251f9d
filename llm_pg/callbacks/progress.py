"""The progress of `llm-pg fit`: RL iterations done of `model.iterations`, elapsed, ETA, reward and eval EM.

In a terminal a rich bar (`IterationProgressBar`); where stdout is not a terminal (Modal's logs, CI, `| tee`: a bar
would be drawn once, at the end), plain lines (`IterationLines`), one at most every `LINE_EVERY_S` seconds.
`progress_bar()` picks the one that fits.

Both show `eval_em` from the latest evaluation (`latest_eval`), and both show their last values once the fit has
ended (`on_fit_end`, after every callback's `on_train_end`): the evaluation that ends the last iteration runs after
the bar's own end-of-iteration hook, and the final one, when the last iteration is not an `evaluation.every` multiple,
at the end of training. So the last figures are the ones the summary below them prints.
"""

from __future__ import annotations

import time
from datetime import timedelta

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from rich.console import Console

LINE_EVERY_S = 30.0  # seconds between two progress lines outside a terminal


def progress_bar() -> ProgressBar:
    """The rich bar when stdout is a terminal (rich's test: TTY_COMPATIBLE and FORCE_COLOR count), else lines."""
    return IterationProgressBar() if Console().is_terminal else IterationLines()


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
        return self.trainer.lightning_module.total_iterations

    def _get_train_description(self, current_epoch: int) -> str:
        return "iteration"

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, module)
        if self.progress is not None and self.train_progress_bar_id is not None and module.iteration > 0:
            # A resumed run starts at its checkpoint's iteration; `reset` (not `update`) so the ETA does not count
            # those iterations as done in no time.
            self.progress.reset(
                self.train_progress_bar_id,
                total=self.total_train_batches,
                completed=min(module.iteration, module.total_iterations),
            )
            self.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        # Lightning's bar shows `batch_idx + 1`; the iteration is what counts here (the same, except after a resume).
        super().on_train_batch_end(trainer, module, outputs, batch, min(module.iteration, module.total_iterations) - 1)

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)  # the W&B run id's tail: says nothing while training
        return with_latest_eval(metrics, module.latest_eval)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._update_metrics(trainer, module)  # the final evaluation ran after the last iteration's update
        self.refresh()


class IterationLines(ProgressBar):
    """Progress as plain lines, for logs that are not a terminal: after an iteration when `every_s` seconds have
    passed since the last line, and after the last iteration:

        iteration 12/501 (2%)  41.2 s/it  elapsed 0:08:14  ETA 5:35:50  reward 0.612  eval_em 0.402

    s/it and the ETA count the iterations of this attempt only (a resumed run starts at its checkpoint). Only rank
    zero prints (Lightning disables the progress bar of the other ranks).
    """

    def __init__(self, every_s: float | None = None) -> None:
        super().__init__()
        self.every_s = LINE_EVERY_S if every_s is None else every_s
        self.enabled = True
        self._start, self._last, self._first = 0.0, 0.0, 0
        self._final_pending = False  # the last iteration's line waits for the final evaluation (`on_fit_end`)

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start = self._last = time.monotonic()
        self._first = module.iteration

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        now, total = time.monotonic(), module.total_iterations
        done = min(module.iteration, total)
        self._final_pending = self.enabled and done >= total
        if not self.enabled or self._final_pending or now - self._last < self.every_s:
            return
        self._print(trainer, module)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._final_pending:
            self._final_pending = False
            self._print(trainer, module)

    def _print(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        now, total = time.monotonic(), module.total_iterations
        done = min(module.iteration, total)
        self._last = now
        per_iteration = (now - self._start) / max(done - self._first, 1)
        metrics = {k: v for k, v in self.get_metrics(trainer, module).items() if k != "v_num"}
        shown = with_latest_eval(metrics, module.latest_eval)
        values = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        line = f"iteration {done}/{total} ({100 * done // max(total, 1)}%)  {per_iteration:.2f} s/it  "
        line += f"elapsed {_clock(now - self._start)}  ETA {_clock(per_iteration * (total - done))}  {values}"
        print(line.rstrip(), flush=True)


def with_latest_eval(metrics: dict, latest_eval: dict[str, float]) -> dict:
    """`metrics` with `eval_em` = the latest evaluation's exact match (the module's `latest_eval`), when there is one:
    `training_step` logs `eval_em` before the evaluation that ends its iteration, so that value lags by one."""
    if "exact_match" in latest_eval:
        metrics["eval_em"] = float(latest_eval["exact_match"])
    return metrics


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
