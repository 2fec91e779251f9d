"""What stops a run that went bad, in one line: rewards that are not finite (or a task that raises), and divergence.

A run must never end "complete" after training on garbage. `checked_scores` scores a rollout and stops the run at
the first completion whose reward (total or a component) is not a finite number, naming the task, the row and the
value; a task that raises stops it with the task's own traceback frames and the row, and one that hangs, exits or
crashes its process (scored in reward workers when it runs user code: `llm_pg.data.isolation`) with what happened.
`DivergenceGuard` stops the run after `max_skipped_iterations` consecutive iterations in which every optimizer step
was skipped as non-finite, or at once when the loss or a trainable weight is not finite. Either way the run ends
with `RunStopped`: no `final/`, no `COMPLETE`, exit 1 from the CLI. `FlatRollouts` only warns: rollouts in a row
that carry no advantage at all on a task the policy has not solved train nothing, but are not an error.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from llm_pg.data.isolation import Failure, FailureKind, TaskScorer
from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.data.tasks.tools import ToolEnvironment, ToolInput, ToolOutcome
from llm_pg.models.generation import PromptTooLong


class RunStopped(RuntimeError):
    """The run cannot go on (non-finite rewards, divergence); the message is what the user reads."""

    exit_code = 1


def quoted(text: str, limit: int = 80) -> str:
    """`text` for a one-line message: whitespace runs as one space, at most `limit` characters, quoted."""
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def prompt_stop(error: PromptTooLong, examples: Sequence[Example], where: str) -> RunStopped:
    """The run's stop for a prompt the model's context cannot hold (`PromptTooLong`), naming the example."""
    return RunStopped(f"the prompt {quoted(examples[error.row].prompt)} ({where}) has {error}")


def _row_text(row: int, iteration: int, example: Example, completion: str, where: str) -> str:
    return (
        f"row {row} of {where} iteration {iteration} (prompt {quoted(example.prompt)}, completion {quoted(completion)})"
    )


def checked_scores(
    task: Task | TaskScorer,
    texts: Sequence[str],
    examples: Sequence[Example],
    iteration: int,
    where: str = "the rollout of",
) -> list[Score]:
    """A score for every row (`TaskScorer.score`: in reward worker processes when the task runs user code, else
    in-process); RunStopped, in one line naming the row, at the first that raised, ended its process, outran the
    time limit or is not finite. `where` names the phase ("the rollout of" iteration k, "evaluation at" iteration k)."""
    scorer = task if isinstance(task, TaskScorer) else TaskScorer(task, workers=0)
    name = type(scorer.task).__name__
    results = scorer.score(texts, examples)
    failed = [
        row for row, result in enumerate(results) if isinstance(result, Failure) and result.kind != FailureKind.SKIPPED
    ]
    if failed:  # the first row that failed (rows after it may not have been scored at all)
        row = failed[0]
        what_row = _row_text(row, iteration, examples[row], texts[row], where)
        raise RunStopped(_failure_text(name, results[row], what_row, scorer.timeout))
    scores = []
    for row, (text, example, result) in enumerate(zip(texts, examples, results, strict=True)):
        values = {"total": result.total, **{f"component {k!r}": v for k, v in result.components.items()}}
        for what, value in values.items():
            if not (isinstance(value, numbers.Real) and math.isfinite(value)):  # numpy scalars are Real too
                what_row = _row_text(row, iteration, example, text, where)
                raise RunStopped(
                    f"task {name} gave a reward {what} of {value!r} for {what_row}; "
                    "rewards must be finite numbers: fix the task's score (or the reward function that computes it)"
                )
        scores.append(result)
    return scores


def checked_outcomes(
    scorer: TaskScorer, calls: Sequence[tuple[ToolEnvironment, str, ToolInput]], rows: Sequence[str], where: str
) -> list[ToolOutcome]:
    """Every call's `ToolOutcome` (`TaskScorer.call_tools`); RunStopped, in one line naming the row and the call, at
    the first that raised (other than `ToolError`), returned a non-string, exited, hung past the time limit or took
    its worker down. `rows` names each call's row for the message."""
    if not calls:
        return []
    results = scorer.call_tools(calls)
    for (_, name, given), row, result in zip(calls, rows, results, strict=True):
        if isinstance(result, Failure) and result.kind != FailureKind.SKIPPED:
            text = given if isinstance(given, str) else json.dumps(given, ensure_ascii=False)
            what = f"tool {name!r} of task {type(scorer.task).__name__} on {row} of {where} (input {quoted(text, 60)})"
            if result.kind == FailureKind.TIMEOUT:
                raise RunStopped(
                    f"{what} did not return within data.reward_timeout={scorer.timeout:g} s, stuck at "
                    f"{result.detail}; give the tool a time limit of its own, or raise data.reward_timeout"
                )
            if result.kind == FailureKind.RAISED:
                raise RunStopped(
                    f"{what} raised; a tool raises ToolError for input it cannot serve (its message becomes the "
                    f"observation), anything else stops the run:\n{result.detail}"
                )
            how = result.detail if result.kind == FailureKind.EXIT else f"ended its worker: {result.detail}"
            raise RunStopped(f"{what} {how}; a tool must return a string, not end its process")
    return results


def _failure_text(name: str, failure: Failure, what_row: str, timeout: float) -> str:
    if failure.kind == FailureKind.REWARD_ERROR:
        return f"{failure.detail}; {what_row}"
    if failure.kind == FailureKind.RAISED:
        return f"task {name} raised while scoring {what_row}; rewards must never raise:\n{failure.detail}"
    if failure.kind == FailureKind.EXIT:
        return (
            f"task {name} {failure.detail} while scoring {what_row}; a reward must return a number, not end the process"
        )
    if failure.kind == FailureKind.TIMEOUT:
        return (
            f"task {name} did not return within data.reward_timeout={timeout:g} s while scoring {what_row}, stuck at "
            f"{failure.detail}; give the checker a time limit of its own (a regex, sympy or a loop can run for ever "
            "on some text), or raise data.reward_timeout"
        )
    return f"task {name}'s reward worker failed while scoring {what_row}: {failure.detail}"


@dataclass(frozen=True)
class Ranks:
    """The data-parallel ranks: this process's `rank`, how many there are (`world_size`), and this rank's device,
    where the one all-reduce of `stop_together` runs."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"


def scorer_of(datamodule, task: Task) -> Task | TaskScorer:
    """The data module's `TaskScorer` of `task` (its reward workers) when there is one, else `task` itself (scored
    in-process)."""
    scorer = getattr(datamodule, "scorer", None)
    return scorer if isinstance(scorer, TaskScorer) and scorer.task is task else task


def scores_or_stop(
    ranks: Ranks,
    task: Task | TaskScorer,
    texts: Sequence[str],
    examples: Sequence[Example],
    iteration: int,
    where: str = "the rollout of",
) -> list[Score]:
    """`checked_scores` on every rank, the stop agreed across ranks (`stop_together`)."""
    try:
        scores = checked_scores(task, texts, examples, iteration, where)
    except RunStopped as stop:
        stop_together(ranks, stop, f"{where} iteration {iteration}")
    stop_together(ranks, None, f"{where} iteration {iteration}")
    return scores


def stop_together(ranks: Ranks, failure: RunStopped | None, where: str) -> None:
    """Raise `failure` here, and on every other rank too: under DDP a rank whose rows were fine learns (one
    all-reduce, which every rank makes) that another's were not, instead of waiting for it in the next collective."""
    if ranks.world_size > 1:
        flag = torch.tensor(float(failure is not None), device=ranks.device)
        torch.distributed.all_reduce(flag)
        if flag.item() and failure is None:
            failure = RunStopped(f"another rank's rewards or tools stopped the run at {where} (its line names the row)")
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


FLAT_PATIENCE = 3  # rollouts in a row with every group settled before `FlatRollouts` warns


class FlatRollouts:
    """Says when a run learns nothing: `patience` rollouts in a row in which every group's rewards were equal
    (`train/frac_zero_std_groups` 1.0), so every advantage was 0 and only the KL term moved the policy, while the
    task is not solved (`train/accuracy` below 1: a solved task's flat groups are success, as at the end of the tiny
    main job). It warns once per such streak (a rollout with spread ends it). The streak is not checkpointed: after
    a resume it counts again."""

    def __init__(self, patience: int = FLAT_PATIENCE) -> None:
        self.patience = patience
        self.streak = 0

    def update(self, iteration: int, settled_frac: float, reward: float, accuracy: float) -> str | None:
        """Record iteration `iteration`'s rollout (1-based): its share of settled groups, mean reward and share of
        correct completions; returns the warning's text when the streak reaches `patience`, else None."""
        flat = settled_frac >= 1.0 and accuracy < 1.0  # a solved task's flat groups are no cause for a warning
        self.streak = self.streak + 1 if flat else 0
        if self.streak != self.patience:
            return None
        return (
            f"iterations {iteration - self.patience + 1}-{iteration}: every group's rewards were equal "
            f"(train/frac_zero_std_groups 1.0, train/reward {reward:.3g}, train/accuracy {accuracy:.3g}), so every "
            "advantage was 0 and nothing was learnt from these rollouts (only the KL term moves the policy): on each "
            "prompt every sample does as well as the others. Read the rollouts (generations.jsonl): give the reward "
            "partial credit, raise temperature or group_size, or start from a model that sometimes succeeds "
            "(docs/metrics.md)"
        )
