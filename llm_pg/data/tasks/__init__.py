"""Verifiable-reward tasks: prompts, a deterministic eval set and a reward per task (see base.py)."""

from llm_pg.data.tasks.arith import ArithTask
from llm_pg.data.tasks.base import Example, Score, Task
from llm_pg.data.tasks.format_copy import FormatCopyTask
from llm_pg.data.tasks.math_hard import MathHardTask

__all__ = ["ArithTask", "Example", "FormatCopyTask", "MathHardTask", "Score", "Task"]
