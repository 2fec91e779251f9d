"""Every `llm_pg.` dotted name a user reads or holds resolves: in configs/, examples/, docs/, the README, the package's
own docstrings and comments, the benchmarks and launch.py, and the class paths that configs and checkpoints saved
before the layout change (issue 28) still name. And every bare backticked name in the docs that looks like code
(`UpdateState`, `apply_variants`, `update.forward_rows`) is a name the code uses, so a renamed function cannot
leave the docs naming it."""

import ast
import importlib
import io
import re
import tokenize

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


# ---- bare backticked names in the docs ------------------------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BACKTICKED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(\))?`")
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
FILE_NAME = re.compile(r"\.(py|ya?ml|md|json|jsonl|png|toml|ckpt|txt|csv|lock)$")
# Names the docs cite from outside the code: other libraries' settings and methods, file-format keys, notation and
# a run name given as an example. Each is checked to occur in the docs, so the list cannot outgrow them.
EXTERNAL = {
    "bernoulli_",  # torch's in-place dropout draw, named in a profile
    "embed_tokens",  # the decoder's embedding module, as transformers names it
    "general.name",  # a GGUF metadata key
    "sympy.sympify",
    "max_num_gen_batches",  # verl's DAPO setting
    "penalty_factor",  # verl's overlong-buffer setting
    "rollout_is",  # verl's rollout correction
    "seq_mask_tis",  # verl's presets
    "seq_truncate",
    "eps_high",  # notation: the upper clip
    "reward_overlong",  # the column `reward_<component>` of the overlong punishment
    "tiny_grpo",  # an example run name
}


def code_names() -> set[str]:
    """Every name the project's code uses (Python NAME tokens, and string literals that are one identifier: Literal
    values and dict keys) and every key its configs set."""
    names: set[str] = set()
    sources = [*(ROOT / "llm_pg").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    for path in [*sources, ROOT / "launch.py", *(ROOT / "examples").rglob("*.py")]:
        if path.name == "test_names_resolve.py":  # this file names stale names on purpose
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.NAME:
                names.add(token.string)
            elif token.type == tokenize.STRING:
                try:
                    value = ast.literal_eval(token.string)
                except (ValueError, SyntaxError):
                    continue
                if isinstance(value, str) and IDENTIFIER.match(value):
                    names.add(value)
    for path in [*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "examples").rglob("*.yaml")]:
        names.update(re.findall(r"^\s*-?\s*([A-Za-z_]\w*):", path.read_text(), re.M))
    return names


def looks_like_code(name: str) -> bool:
    """A backticked token that names code: snake_case, CamelCase or dotted; not a file, an environment variable, a
    fragment (`_std`), math notation (`A_i`) or a plain word."""
    if name.startswith(("llm_pg.", "_")) or FILE_NAME.search(name) or name.isupper():
        return False
    if re.match(r"^[A-Za-z]_\w+$", name):
        return False
    return "_" in name or "." in name or re.search(r"[a-z][A-Z]", name) is not None


def bare_names_in_docs() -> dict[str, str]:
    """`{bare backticked name: the first doc naming it}` for the names that look like code."""
    found: dict[str, str] = {}
    for path in DOCS:
        for name in BACKTICKED.findall(path.read_text()):
            if looks_like_code(name):
                found.setdefault(name, path.name)
    return found


def test_every_bare_code_name_in_the_docs_is_one_the_code_uses():
    known, names = code_names(), bare_names_in_docs()
    assert len(names) > 200 and "UpdateState" in names  # the check sees the docs' names
    stale = {n: doc for n, doc in names.items() if n not in EXTERNAL and not all(p in known for p in n.split("."))}
    assert not stale, f"names in the docs that no code uses (renamed or removed?): {stale}"
    assert set(names) >= EXTERNAL, f"EXTERNAL lists names no doc cites any more: {EXTERNAL - set(names)}"


def test_the_bare_name_check_catches_a_stale_name():
    known = code_names()
    assert "forward_rows" in known and "length_sorted" not in known  # the function the docs once named
    assert looks_like_code("length_sorted") and looks_like_code("update.length_sorted")
    assert not looks_like_code("A_i") and not looks_like_code("configs.yaml") and not looks_like_code("WANDB_API_KEY")
