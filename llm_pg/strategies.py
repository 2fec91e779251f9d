"""The path configs and checkpoints written before the layout change name: `llm_pg.strategies.FSDP2` is
`llm_pg.models.parallel.FSDP2` (a `trainer.strategy` class path in a saved config still resolves)."""

from llm_pg.models.parallel import FSDP2

__all__ = ["FSDP2"]
