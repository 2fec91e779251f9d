"""What stops a run that went bad, in one line: rewards that are not finite (or a task that raises), and divergence.

A run must never end "complete" after training on garbage. `checked_scores` scores a rollout and stops the run at
the first completion whose reward (total or a component) is not a finite number, naming the task, the row and the
value; a task that raises stops it with the task's own traceback frames and the row. `DivergenceGuard` stops the run
after `max_skipped_iterations` consecutive iterations in which every optimizer step was skipped as non-finite, or at
once when the loss or a trainable weight is not finite. Either way the run ends with `RunStopped`: no `final/`, no
`COMPLETE`, exit 1 from the CLI.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from llm_pg.data.tasks.base import Example, RewardError, Score, Task

OUR_CODE = str(Path(__file__).resolve().parent)


class RunStopped(RuntimeError):
    """The run cannot go on (non-finite rewards, divergence); the message is what the user reads."""

    exit_code = 1


def _row_text(row: int, iteration: int, example: Example, completion: str, where: str) -> str:
    def short(text: str) -> str:
        text = " ".join(str(text).split())
        return repr(text if len(text) <= 80 else text[:77] + "...")

    return (
        f"row {row} of {where} iteration {iteration} (prompt {short(example.prompt)}, completion {short(completion)})"
    )


def _task_frames(error: BaseException) -> str:
    """The traceback of `error` from the first frame outside this package (the task's or a user's own code)."""
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [f for f in frames if not f.filename.startswith(OUR_CODE)] or frames[-1:]
    start = frames.index(theirs[0])
    lines = traceback.format_list(frames[start:]) + traceback.format_exception_only(type(error), error)
    return "".join(lines).rstrip()


def checked_scores(
    task: Task, texts: Sequence[str], examples: Sequence[Example], iteration: int, where: str = "the rollout of"
) -> list[Score]:
    """`task.score(texts[i], examples[i])` for every row; RunStopped at the first that raises or is not finite.
    `where` names the phase in the message ("the rollout of" iteration k, "evaluation at" iteration k)."""
    name = type(task).__name__
    scores = []
    for row, (text, example) in enumerate(zip(texts, examples, strict=True)):

        def what_row() -> str:
            return _row_text(row, iteration, example, text, where)  # noqa: B023 (called within this iteration)

        try:
            score = task.score(text, example)
        except RewardError as error:
            raise RunStopped(f"{error}; {what_row()}") from error  # the cause shows under --debug only
        except Exception as error:
            raise RunStopped(
                f"task {name} raised while scoring {what_row()}; rewards must never raise:\n{_task_frames(error)}"
            ) from error
        values = {"total": score.total, **{f"component {k!r}": v for k, v in score.components.items()}}
        for what, value in values.items():
            if not (isinstance(value, numbers.Real) and math.isfinite(value)):  # numpy scalars are Real too
                raise RunStopped(
                    f"task {name} gave a reward {what} of {value!r} for {what_row()}; "
                    "rewards must be finite numbers: fix the task's score (or the reward function that computes it)"
                )
        scores.append(score)
    return scores


def scores_or_stop(
    module, task: Task, texts: Sequence[str], examples: Sequence[Example], iteration: int, where: str = "the rollout of"
) -> list[Score]:
    """`checked_scores` on every rank, the stop agreed across ranks (`stop_together`)."""
    try:
        scores = checked_scores(task, texts, examples, iteration, where)
    except RunStopped as stop:
        stop_together(module, stop, f"{where} iteration {iteration}")
    stop_together(module, None, f"{where} iteration {iteration}")
    return scores


def stop_together(module, failure: RunStopped | None, where: str) -> None:
    """Raise `failure` here, and on every other rank too: under DDP a rank whose rows were fine learns (one
    all-reduce, which every rank makes) that another's were not, instead of waiting for it in the next collective."""
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and trainer.world_size > 1:
        flag = torch.tensor(float(failure is not None), device=module.device)
        torch.distributed.all_reduce(flag)
        if flag.item() and failure is None:
            failure = RunStopped(f"another rank's rewards stopped the run at {where} (its line names the row)")
    if failure is not None:
        raise failure


def weights_finite(policy: torch.nn.Module) -> bool:
    """Whether every trainable weight is finite: one flag per tensor, summed on the device, one host sync (and,
    under FSDP2, one all-reduce of the shards' flags, which every rank makes)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    if not params:
        return True
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    bad = torch.stack([(~torch.isfinite(t)).any() for t in local]).sum().float()
    if any(isinstance(p, DTensor) for p in params):
        torch.distributed.all_reduce(bad)
    return not bool(bad.item())


class DivergenceGuard:
    """Counts consecutive iterations whose optimizer steps were all skipped; says when the run must stop.

    `healthy_iteration` is the last iteration before the current streak of bad ones (checkpoint rotation keeps the
    newest copy written at or before it)."""

    def __init__(self, max_skipped_iterations: int) -> None:
        self.max_skipped_iterations = max_skipped_iterations
        self.streak = 0
        self.healthy_iteration = 0

    def check(self, iteration: int, grad_norms: Sequence[float], loss: float, weights_ok: bool, lr: float) -> None:
        """After iteration `iteration` (1-based) made steps with `grad_norms`: RunStopped if the run diverged."""
        knobs = f"lower model.init_args.lr (now {lr:g}) or check the rewards and max_grad_norm"
        if not weights_ok:
            raise RunStopped(f"iteration {iteration}: a trainable weight is not finite (inf or NaN); {knobs}")
        # Decided on what every rank shares (the averaged gradient's norms, the weights), never on a rank's own
        # loss: under DDP every rank must stop at the same iteration. A non-finite loss makes a non-finite gradient.
        all_skipped = bool(grad_norms) and not any(math.isfinite(g) for g in grad_norms)
        if all_skipped:
            self.streak += 1
        else:
            self.streak = 0
            self.healthy_iteration = iteration
        if self.streak >= self.max_skipped_iterations:
            first = iteration - self.streak + 1
            span = f"iteration {iteration}" if first == iteration else f"iterations {first}-{iteration}"
            what = f"the loss is {loss}" if not math.isfinite(loss) else "every gradient was non-finite"
            raise RunStopped(
                f"{span}: every optimizer step was skipped ({what}); the run stopped after {self.streak} such "
                f"iterations (model.init_args.max_skipped_iterations={self.max_skipped_iterations}); the newest "
                f"iter_*.ckpt of iteration {self.healthy_iteration} or earlier (the last healthy one) is kept, if one "
                f"was written; {knobs}, in a new --run_name"
            )
