from llm_pg.callbacks.checkpoint import IterationCheckpoint
from llm_pg.callbacks.evaluation import EvalCallback, evaluate
from llm_pg.callbacks.generations import GenerationsCallback

__all__ = ["EvalCallback", "GenerationsCallback", "IterationCheckpoint", "evaluate"]
