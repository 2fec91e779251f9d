"""Greedy (and optionally sampled) evaluation of a task's eval set, sharded across DDP ranks.

Rank `r` of `w` decodes examples `r, r + w, r + 2w, ...`; the per-metric sums and the completions are
gathered, so every rank returns the metrics of the whole set (sum of per-example values / set size, as a
single process computes them) and the completions in the set's order. Greedy metrics equal a single process's
up to the float effects of different left padding; sampled pass@k draws its seeds per rank and batch, so its
samples (not its expectation) depend on the number of ranks.

With `eval_samples: k > 0` each prompt also gets k completions sampled at `eval_temperature` (top-p as in
training), and with c of them correct, `pass_at_1 = c / k` and `pass_at_k = pass_at_k(k, c, k)` (1 when any is
correct), averaged over prompts: the unbiased estimators of Chen et al. (2021) with n = k samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning as L
import torch

from llm_pg.core.rollout import derive_seed
from llm_pg.data.tasks.base import Example, Task
from llm_pg.runs.guards import RunStopped, checked_scores, stop_together


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Chance that k of the n samples, drawn without replacement, include a correct one (Chen et al., 2021):
    `1 - C(n-c, k) / C(n, k)`, unbiased for pass@k when the n samples are drawn independently."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={num_samples}, c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def prompts_per_call(module: L.LightningModule, num_prompts: int, samples: int = 1) -> int:
    """Prompts per generate call of an evaluation: `eval_batch_size` rows (`samples` per prompt) when set; else all
    `num_prompts` with vLLM, which schedules its own batches (one call for the whole set), and `logprob_batch_size`
    rows with HF, whose memory grows with the rows of a call."""
    hp = module.hparams
    rows = hp.eval_batch_size
    if rows is None:
        if hp.rollout_engine == "vllm":
            return max(num_prompts, 1)
        rows = hp.logprob_batch_size
    return max(1, rows // samples)


def _sampled_sums(module: L.LightningModule, task: Task, examples: Sequence[Example], rank: int) -> dict[str, float]:
    """Sums over `examples` of per-prompt pass@1 and pass@k from `eval_samples` completions each."""
    hp = module.hparams
    k = hp.eval_samples
    per_call = prompts_per_call(module, len(examples), k)
    sums = {"pass_at_1": 0.0, "pass_at_k": 0.0}
    for start in range(0, len(examples), per_call):
        batch = list(examples[start : start + per_call])
        texts = module.engine.generate(
            [task.messages(e) for e in batch],
            num_samples=k,
            temperature=hp.eval_temperature,
            top_p=hp.top_p,
            max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens,
            max_prompt_tokens=hp.max_prompt_tokens,
            chat_template=hp.chat_template,
            seed=derive_seed(hp.seed, module.iteration, rank, start, "eval_samples"),
        ).texts
        for row, example in enumerate(batch):  # rows row*k .. row*k+k-1 answer this example
            correct = sum(task.score(text, example).correct for text in texts[row * k : (row + 1) * k])
            sums["pass_at_1"] += pass_at_k(k, correct, 1)
            sums["pass_at_k"] += pass_at_k(k, correct, k)
    return sums


def _evaluate_shard(
    module: L.LightningModule, task: Task, examples: Sequence[Example], rank: int = 0
) -> tuple[dict[str, float], list[str]]:
    """Per-metric sums over `examples` (each batch's mean times its size) and their greedy completions."""
    hp = module.hparams
    sums: dict[str, float] = {}
    completions: list[str] = []
    per_call = prompts_per_call(module, len(examples))
    failure = None  # a reward that raises or is not finite: the run stops, on every rank, after the loop
    for start in range(0, len(examples), per_call):
        batch = list(examples[start : start + per_call])
        texts = module.engine.generate(  # the rollout engine (HF or vLLM), greedy
            [task.messages(e) for e in batch],
            greedy=True,
            max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens,
            max_prompt_tokens=hp.max_prompt_tokens,
            chat_template=hp.chat_template,
        ).texts
        completions.extend(texts)
        try:
            checked_scores(task, texts, batch, module.iteration, "evaluation at")
        except RunStopped as stop:
            failure = stop
            break
        for name, value in task.eval_metrics(texts, batch).items():
            sums[name] = sums.get(name, 0.0) + value * len(batch)
    stop_together(module, failure, f"evaluation at iteration {module.iteration}")  # ranks' shards differ in size
    if hp.eval_samples > 0 and examples:
        sums.update(_sampled_sums(module, task, examples, rank))
    return sums, completions


def evaluate(module: L.LightningModule, task: Task, examples: Sequence[Example]) -> tuple[dict[str, float], list[str]]:
    """Greedy completions for `examples` and the task's eval metrics averaged over them.

    Under DDP every rank must call this (it gathers); each decodes its slice and all return the same result.
    """
    rank, world = _rank_and_world_size()
    shard = _evaluate_shard(module, task, list(examples)[rank::world], rank)
    parts = [shard]
    if world > 1:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, shard)
    totals: dict[str, float] = {}
    completions: list[str] = [""] * len(examples)
    for part_rank, (sums, texts) in enumerate(parts):
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + value
        completions[part_rank::world] = texts
    return {name: value / max(len(examples), 1) for name, value in totals.items()}, completions
