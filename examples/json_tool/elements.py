"""A tool of your own for examples/json_tool: a typed function the model calls with JSON.

With `call_format: json` the chat template shows the model this function's JSON schema, built from its type hints
and its docstring (the summary line and `Args:`), so the docstring is what the model reads. The model calls it as
`<tool_call>{"name": "atomic_number", "arguments": {"element": "neon"}}</tool_call>`; llm_pg checks the arguments
against the schema (a missing or extra argument, or a number for `element`, is answered with an error the model
reads) and calls `atomic_number(element="neon")`. Input it cannot serve raises `ToolError`: the message becomes the
observation. Since this file is your code, the tool runs in the reward workers under `data.reward_timeout`.
"""

from llm_pg.data.tasks import ToolError

NUMBERS = {
    "hydrogen": 1, "helium": 2, "lithium": 3, "beryllium": 4, "boron": 5, "carbon": 6, "nitrogen": 7, "oxygen": 8,
    "fluorine": 9, "neon": 10, "sodium": 11, "magnesium": 12, "aluminium": 13, "silicon": 14, "phosphorus": 15,
    "sulfur": 16, "chlorine": 17, "argon": 18, "potassium": 19, "calcium": 20,
}  # fmt: skip


def atomic_number(element: str) -> str:
    """Look up the atomic number of a chemical element.

    Args:
        element: the element's English name, e.g. neon
    """
    number = NUMBERS.get(element.strip().lower())
    if number is None:
        raise ToolError(f"no element named {element.strip()[:40]!r}; the table has the first 20 elements")
    return str(number)
