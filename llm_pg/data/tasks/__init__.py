"""Verifiable-reward tasks: prompts, a deterministic eval set and a reward per task (see base.py)."""

from llm_pg.data.tasks.arith import ArithTask
from llm_pg.data.tasks.base import Example, RewardError, Score, Task
from llm_pg.data.tasks.calc_arith import CalcArithTask
from llm_pg.data.tasks.dataset import DatasetTask
from llm_pg.data.tasks.dataset_tools import DatasetToolTask
from llm_pg.data.tasks.format_copy import FormatCopyTask
from llm_pg.data.tasks.math_hard import MathHardTask
from llm_pg.data.tasks.reasoning_gym import BoxedReasoningGymTask, ReasoningGymTask
from llm_pg.data.tasks.tools import ToolEnvironment, ToolError, ToolTask

__all__ = [
    "ArithTask",
    "BoxedReasoningGymTask",
    "CalcArithTask",
    "DatasetTask",
    "DatasetToolTask",
    "Example",
    "FormatCopyTask",
    "MathHardTask",
    "ReasoningGymTask",
    "RewardError",
    "Score",
    "Task",
    "ToolEnvironment",
    "ToolError",
    "ToolTask",
]
