"""What one training iteration hands from stage to stage, as types: the prompts the dataloader yields
(`PromptBatch`) and the scored rollout the update trains on (`ScoredRollout`), which the rollout callback attaches
to the batch (`PromptBatch.rollout`) before `training_step` receives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.tasks.base import Example, Score


@dataclass(frozen=True)
class ScoredRollout:
    """One iteration's rollout as `training_step` receives it: the rows the update trains on (`rows`, after the
    rollout-side variants), the task's score of each of them (`scores`, same order), the rollout's metrics
    (`metrics`: `train/reward...`, lengths, the variants' counts, `time/rollout`), logged with the update's, the
    prompts sampled (`examples`, indexed by `rows.prompt_index`; several batches with dynamic sampling's refill) and
    the last stream batch they came from (`last_batch`: the data stream's position is `last_batch + 1` once the
    iteration is done)."""

    rows: RolloutBatch
    scores: list[Score]
    metrics: dict[str, float] = field(default_factory=dict)
    examples: list[Example] = field(default_factory=list)
    last_batch: int = 0


@dataclass
class PromptBatch:
    """Batch `index` of this rank's prompt stream (`PromptGroupDataModule`): `examples`, the prompts of one
    iteration. `rollout` is empty when the dataloader yields it; the rollout callback sets it, once, to the
    `ScoredRollout` sampled from these prompts (and, with dynamic sampling's refill, the stream's next batches)."""

    index: int
    examples: list[Example]
    rollout: ScoredRollout | None = None
