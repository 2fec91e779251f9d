"""Import layers: every module of `llm_pg` imports only its own layer or the layers below, as the contracts in
pyproject.toml (`[tool.importlinter]`, checked by `lint-imports` in `make lint` and CI) say; here the same layers are
read from pyproject.toml and checked on the source with `ast`, so `make test` catches an upward import too."""

import ast
import sys
from pathlib import Path

import pytest
from conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PACKAGE = ROOT / "llm_pg"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def layers() -> list[list[str]]:
    """The layers contract's packages, top first; `a | b` and `a : b` are siblings of one layer."""
    [contract] = [c for c in CONFIG["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.replace(":", "|").split("|")] for layer in contract["layers"]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The llm_pg modules a file imports anywhere in it (functions included), relative imports resolved."""
    names = set()
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from llm_pg.x import module`
    return {n for n in names if n == "llm_pg" or n.startswith("llm_pg.")}


def rank_of(name: str, table: list[list[str]]) -> int | None:
    """The layer index (0 = top) of the package holding `name`, or None outside every layer."""
    for rank, siblings in enumerate(table):
        if any(name == p or name.startswith(p + ".") for p in siblings):
            return rank
    return None


def upward_imports() -> list[str]:
    table = layers()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = rank_of(module_name(path), table)
        if own is None:
            continue
        for name in sorted(imports(path)):
            other = rank_of(name, table)
            if other is not None and other < own:
                found.append(f"{module_name(path)} imports {name}")
    return found


def test_every_module_of_the_package_is_in_a_layer():
    table = layers()
    outside = {module_name(p) for p in PACKAGE.rglob("*.py") if rank_of(module_name(p), table) is None}
    # The package root (its version) and the alias saved configs name (docs/architecture.md) sit outside.
    assert outside == {"llm_pg", "llm_pg.strategies"}


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports() == []


def test_the_layer_check_sees_imports():
    # The checker itself must find what it looks for: the rollout callback imports the task layer, and an import
    # of the modules layer from a callback would be upward.
    assert "llm_pg.data.tasks.base" in imports(PACKAGE / "callbacks" / "rollout.py")
    table = layers()
    assert rank_of("llm_pg.modules.base", table) < rank_of("llm_pg.callbacks.rollout", table)
    assert rank_of("llm_pg.core.losses", table) == len(table) - 1
