"""Import layers: the core math and data containers never import orchestration, and the algorithms never
import the callbacks at module level (only `configure_callbacks` may, inside the method)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llm_pg"


def _imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("core", ["losses.py", "rollout.py"])
def test_core_imports_no_task_callback_or_lightning(core):
    forbidden = ("llm_pg.data", "llm_pg.callbacks", "llm_pg.modules", "lightning", "pytorch_lightning")
    bad = {name for name in _imports(PACKAGE / core, module_level_only=False) if _under(name, forbidden)}
    assert not bad, f"llm_pg/{core} imports {sorted(bad)}"


def test_modules_do_not_import_callbacks_at_module_level():
    for path in sorted((PACKAGE / "modules").glob("*.py")):
        bad = {n for n in _imports(path, module_level_only=True) if _under(n, ("llm_pg.callbacks",))}
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)} at module level"


def test_the_layer_test_sees_imports():
    # The checker itself must find what it looks for: callbacks/rollout.py imports the task layer.
    assert "llm_pg.data.tasks.base" in _imports(PACKAGE / "callbacks" / "rollout.py", module_level_only=True)
