from llm_pg.callbacks.checkpoint import IterationCheckpoint
from llm_pg.callbacks.evaluation import EvalCallback, evaluate
from llm_pg.callbacks.generations import GenerationsCallback
from llm_pg.callbacks.progress import IterationLines, IterationProgressBar, progress_bar

__all__ = [
    "EvalCallback",
    "GenerationsCallback",
    "IterationCheckpoint",
    "IterationLines",
    "IterationProgressBar",
    "evaluate",
    "progress_bar",
]
