"""Greedy (and optionally sampled) evaluation of a task's eval set, sharded across DDP ranks.

Rank `r` of `w` decodes examples `r, r + w, r + 2w, ...`; the per-metric sums and the completions are
gathered, so every rank returns the metrics of the whole set (sum of per-example values / set size, as a
single process computes them) and the completions in the set's order. Greedy metrics equal a single process's
up to the float effects of different left padding; sampled pass@k draws its seeds per rank and batch, so its
samples (not its expectation) depend on the number of ranks.

With `evaluation.samples: k > 0` each prompt also gets k completions sampled at `evaluation.temperature` (top-p as in
training), and with c of them correct, `pass_at_1 = c / k` and `pass_at_k = pass_at_k(k, c, k)` (1 when any is
correct), averaged over prompts: the unbiased estimators of Chen et al. (2021) with n = k samples.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llm_pg.core.rollout import derive_seed
from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.engines.episodes import Sampler, episode_sums
from llm_pg.models.generation import PromptTooLong, Sampling
from llm_pg.runs.guards import Ranks, RunStopped, checked_scores, prompt_stop, stop_together


@dataclass
class Evaluation:
    """One evaluation: the metrics (averaged over the set once gathered), and per example its greedy completion and
    that completion's score, in the set's order."""

    metrics: dict[str, float]
    completions: list[str]
    scores: list[Score]
    transcripts: list[str] = field(default_factory=list)  # a tool task's: turns and observations, as decoded


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Chance that k of the n samples, drawn without replacement, include a correct one (Chen et al., 2021):
    `1 - C(n-c, k) / C(n, k)`, unbiased for pass@k when the n samples are drawn independently."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={num_samples}, c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


@dataclass(frozen=True)
class EvalContext:
    """What every evaluation of a fit needs, built by the module (`PolicyGradientModule.eval_context`).

    Args:
        sampler: prompts to completions, and the task's scorer.
        sampling: the evaluation's sampling settings (`evaluation.max_new_tokens`, `evaluation.temperature`); the
            greedy pass decodes them greedily.
        samples: `evaluation.samples`, completions sampled per prompt for pass@k (0: greedy only).
        batch_rows: rows per generate call (`evaluation.generate_batch_size`; None: the engine's own choice,
            `whole_set`).
        whole_set: the engine schedules its own batches (vLLM): without `batch_rows`, one call for the whole set.
        fallback_rows: rows per call otherwise (`speed.logprob_batch_size`).
        seed: the run's seed (pass@k's samples are seeded from it, with this rank).
        ranks: this process's rank, and the ranks the evaluation is sharded over.
    """

    sampler: Sampler
    sampling: Sampling
    samples: int = 0
    batch_rows: int | None = None
    whole_set: bool = False
    fallback_rows: int = 32
    seed: int = 0
    ranks: Ranks = field(default_factory=Ranks)

    def prompts_per_call(self, num_prompts: int, samples: int = 1) -> int:
        """Prompts per generate call: `batch_rows` rows (`samples` per prompt) when set; else all `num_prompts`
        with an engine that schedules its own batches (one call for the whole set), and `fallback_rows` rows
        otherwise (HF, whose memory grows with the rows of a call)."""
        rows = self.batch_rows
        if rows is None:
            if self.whole_set:
                return max(num_prompts, 1)
            rows = self.fallback_rows
        return max(1, rows // samples)


def _sampled_sums(context: EvalContext, engine, examples: Sequence[Example], iteration: int) -> dict[str, float]:
    """Sums over `examples` of per-prompt pass@1 and pass@k from `samples` completions each (RunStopped when a
    reward raises or is not finite)."""
    k = context.samples
    per_call = context.prompts_per_call(len(examples), k)
    sums = {"pass_at_1": 0.0, "pass_at_k": 0.0}
    for start in range(0, len(examples), per_call):
        batch = list(examples[start : start + per_call])
        try:
            texts = context.sampler(
                engine,
                batch,
                context.sampling,
                num_samples=k,
                seed=derive_seed(context.seed, iteration, context.ranks.rank, start, "eval_samples"),
                where=f"the evaluation at iteration {iteration}",
            ).texts
        except PromptTooLong as error:
            raise prompt_stop(error, batch, f"evaluation at iteration {iteration}") from None
        rows = [e for e in batch for _ in range(k)]
        scores = checked_scores(context.sampler.scorer, texts, rows, iteration, "evaluation at")
        for row in range(len(batch)):  # rows row*k .. row*k+k-1 answer this example
            correct = sum(score.correct for score in scores[row * k : (row + 1) * k])
            sums["pass_at_1"] += pass_at_k(k, correct, 1)
            sums["pass_at_k"] += pass_at_k(k, correct, k)
    return sums


def task_eval_metrics(task: Task, completions: Sequence[str], examples: Sequence[Example], scores: list[Score]):
    """`task.eval_metrics` given the scores already computed; a task whose override predates the `scores` argument
    is called without them (and scores again)."""
    if "scores" in inspect.signature(task.eval_metrics).parameters:
        return task.eval_metrics(completions, examples, scores=scores)
    return task.eval_metrics(completions, examples)


def _evaluate_shard(context: EvalContext, engine, examples: Sequence[Example], iteration: int) -> Evaluation:
    """Per-metric sums over `examples` (each batch's mean times its size), their greedy completions and scores."""
    task = context.sampler.task
    shard = Evaluation({}, [], [])
    per_call = context.prompts_per_call(len(examples))
    failure = None  # a reward that raises or is not finite: the run stops, on every rank, after the loop
    try:
        for start in range(0, len(examples), per_call):
            batch = list(examples[start : start + per_call])
            try:
                generation = context.sampler(  # the rollout engine (HF or vLLM), greedy; a tool task's episodes
                    engine, batch, context.sampling.greedy_version(), where=f"the evaluation at iteration {iteration}"
                )
            except PromptTooLong as error:
                raise prompt_stop(error, batch, f"evaluation at iteration {iteration}") from None
            texts = generation.texts
            if generation.episodes:
                shard.transcripts.extend(generation.transcripts)
                sums = episode_sums(
                    generation.turns, generation.tool_calls, generation.tool_errors, generation.tool_error_kinds
                )
                for name, value in sums.items():
                    shard.metrics[name] = shard.metrics.get(name, 0.0) + value
            scores = checked_scores(context.sampler.scorer, texts, batch, iteration, "evaluation at")  # once each
            shard.completions.extend(texts)
            shard.scores.extend(scores)
            for name, value in task_eval_metrics(task, texts, batch, scores).items():
                shard.metrics[name] = shard.metrics.get(name, 0.0) + value * len(batch)
        if context.samples > 0 and examples:
            shard.metrics.update(_sampled_sums(context, engine, examples, iteration))
    except RunStopped as stop:
        failure = stop
    stop_together(context.ranks, failure, f"evaluation at iteration {iteration}")  # ranks' shards differ in size
    return shard


def evaluate(context: EvalContext, engine, examples: Sequence[Example], iteration: int) -> Evaluation:
    """Greedy completions of `engine` for `examples`, their scores and the task's eval metrics averaged over them,
    at `iteration` (for seeds and messages).

    Under DDP every rank must call this (it gathers); each decodes its slice and all return the same result.
    """
    rank, world = context.ranks.rank, context.ranks.world_size
    shard = _evaluate_shard(context, engine, list(examples)[rank::world], iteration)
    parts = [shard]
    if world > 1:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, shard)
    episodes = any(part.transcripts for part in parts)
    whole = Evaluation({}, [""] * len(examples), [None] * len(examples), [""] * len(examples) if episodes else [])
    for part_rank, part in enumerate(parts):
        for name, value in part.metrics.items():
            whole.metrics[name] = whole.metrics.get(name, 0.0) + value
        whole.completions[part_rank::world] = part.completions
        whole.scores[part_rank::world] = part.scores
        if episodes:
            whole.transcripts[part_rank::world] = part.transcripts
    whole.metrics = {name: value / max(len(examples), 1) for name, value in whole.metrics.items()}
    return whole
