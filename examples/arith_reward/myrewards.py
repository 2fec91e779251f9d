"""A reward function for examples/arith_reward: full credit within the row's tolerance, partial credit near it.

`rewards: ["myrewards:close_enough", ...]` in config.yaml finds this file because it sits beside the config.
"""

from llm_pg.data.tasks import Example, Score
from llm_pg.data.tasks.answers import boxed_number


def close_enough(completion: str, example: Example) -> Score:
    """1.0 when the last `\\boxed{}` number is within the row's `tolerance` of the gold, falling linearly to 0
    at 5 away; correct (eval exact match) only within the tolerance. `example.fields` holds the row's other
    columns (`expr`, `tolerance`)."""
    value = boxed_number(completion)  # llm_pg's linear-time parser: None without a closed, numeric box
    if value is None:
        return Score(total=0.0, correct=False)
    error = abs(value - float(example.answer))
    within = error <= example.fields["tolerance"]
    return Score(total=1.0 if within else max(0.0, 1.0 - error / 5.0), correct=within)
