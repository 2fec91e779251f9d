"""The learning-rate schedule: a factor of the peak rate per RL iteration, stepped once per iteration.

    warmup (step < warmup_steps):   (step + 1) / warmup_steps              (the course's ramp)
    constant:                        1                                     (the course)
    linear:                          floor + (1 - floor) (1 - p)
    cosine:                          floor + (1 - floor) (1 + cos(pi p)) / 2
    p = (step - warmup_steps) / (iterations - warmup_steps), clamped to [0, 1]

`step` counts the iterations already trained (0 for the first), `floor` is `min_lr_ratio`. After warmup these are
transformers' `get_linear_schedule_with_warmup` (floor 0) and `get_cosine_with_min_lr_schedule_with_warmup`
(`min_lr_rate = floor`). Core math: imports nothing of ours.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

LrSchedule = Literal["constant", "linear", "cosine"]
LR_SCHEDULES = get_args(LrSchedule)


def lr_factor(step: int, warmup_steps: int, iterations: int, schedule: str = "constant", floor: float = 0.0) -> float:
    """The factor of the peak learning rate for the iteration after `step` trained ones (module docstring)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(max((step - warmup_steps) / max(iterations - warmup_steps, 1), 0.0), 1.0)
    if schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
