from llm_pg.callbacks.checkpoint import IterationCheckpoint
from llm_pg.callbacks.evaluation import EvalCallback, evaluate
from llm_pg.callbacks.generations import GenerationsCallback
from llm_pg.callbacks.progress import IterationProgressBar

__all__ = ["EvalCallback", "GenerationsCallback", "IterationCheckpoint", "IterationProgressBar", "evaluate"]
