"""Every `llm_pg.` dotted name a user reads or holds resolves: in configs/, examples/, docs/, the README, the package's
own docstrings and comments, the benchmarks and launch.py, and the class paths that configs and checkpoints saved
before the layout change (issue 28) still name."""

import importlib
import re

import pytest
from conftest import ROOT

DOTTED = re.compile(r"\bllm_pg(?:\.[A-Za-z_]\w*)+")
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "configs").rglob("*.yaml")),
    *sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in {".py", ".yaml", ".md"}),
    *sorted((ROOT / "llm_pg").rglob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
    ROOT / "launch.py",
]
# What saved configs and checkpoints name (run directories' config.yaml, `hyper_parameters`, `trainer.strategy`).
SAVED_BEFORE_THE_MOVE = [
    "llm_pg.modules.GRPOModule",
    "llm_pg.modules.ReinforceModule",
    "llm_pg.data.tasks.FormatCopyTask",
    "llm_pg.data.tasks.MathHardTask",
    "llm_pg.data.tasks.ArithTask",
    "llm_pg.data.tasks.DatasetTask",
    "llm_pg.data.tasks.ReasoningGymTask",
    "llm_pg.strategies.FSDP2",
]


def resolve(name: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name is None or not ".".join(parts[:cut]).startswith(error.name):
                raise  # the module exists but imports something missing: a real error, not a shorter prefix
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(name)


def names_in_sources() -> dict[str, str]:
    """`{dotted name: the first file naming it}` over SOURCES."""
    found: dict[str, str] = {}
    for path in SOURCES:
        for name in DOTTED.findall(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_sources_name_enough_to_mean_something():
    names = names_in_sources()
    assert len(names) >= 20 and "llm_pg.modules.GRPOModule" in names, sorted(names)


@pytest.mark.parametrize("name", sorted(names_in_sources()))
def test_every_dotted_name_in_docs_configs_and_examples_resolves(name: str):
    try:
        resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{name} (named in {names_in_sources()[name]}) does not resolve: {error}")


@pytest.mark.parametrize("name", SAVED_BEFORE_THE_MOVE)
def test_class_paths_saved_before_the_layout_change_resolve(name: str):
    assert isinstance(resolve(name), type)


def test_the_resolver_refuses_what_does_not_exist():
    with pytest.raises(AttributeError):
        resolve("llm_pg.modules.GRPOModul")
    with pytest.raises(AttributeError):
        resolve("llm_pg.losses.grpo_loss")  # the path before the move: the module is llm_pg.core.losses now
