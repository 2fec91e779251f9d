"""Plain pip works: requirements.lock gives every Python that requires-python allows one pin per package, pins every
dependency inside pyproject's ranges, and the transformers names that changed within the range are used quietly."""

import warnings

import pytest
import torch
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10: pytest brings the backport
    import tomli as tomllib

from llm_pg.models.cache import CACHE_NAME, activation_checkpointing, enable_activation_checkpointing, kv_cache
from llm_pg.models.loading import load_policy

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
NOT_LOCKED = {"torch"}  # pinned by the Makefile and the README's install lines: CPU or CUDA build
OWN_VENV_EXTRAS = {"vllm"}  # vLLM pins its own versions: `make test-vllm` builds .venv-vllm
NEEDS_311 = {"trl"}  # the bench extra: trl 1.16.0 requires Python >= 3.11


def lock_pins(python: str) -> dict[str, str]:
    """name -> pinned version of requirements.lock's lines whose marker holds on `python`; ValueError on a package
    pinned twice for it."""
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line.split(" #")[0])
        if req.marker is not None and not req.marker.evaluate({"python_version": python}):
            continue
        (spec,) = req.specifier
        assert spec.operator == "==", line
        name = canonicalize_name(req.name)
        if name in pins:
            raise ValueError(f"{req.name} is pinned twice for Python {python}")
        pins[name] = spec.version
    return pins


def dependencies() -> list[Requirement]:
    extras = PYPROJECT["optional-dependencies"]
    names = PYPROJECT["dependencies"] + [
        d for extra, deps in extras.items() if extra not in OWN_VENV_EXTRAS for d in deps
    ]
    return [Requirement(d) for d in names]


def test_requires_python_and_classifiers_name_the_pythons_the_lock_serves():
    assert PYPROJECT["requires-python"] == ">=3.10"
    listed = [c.rsplit(" :: ", 1)[1] for c in PYPROJECT["classifiers"] if c.count("::") == 2 and "." in c]
    assert listed == PYTHONS
    assert all(p in SpecifierSet(PYPROJECT["requires-python"]) for p in PYTHONS)


@pytest.mark.parametrize("python", PYTHONS)
def test_the_lock_pins_every_dependency_once_inside_its_range(python):
    pins = lock_pins(python)
    for req in dependencies():
        name = canonicalize_name(req.name)
        if name in NOT_LOCKED or (python == "3.10" and name in NEEDS_311):
            assert name not in pins, f"{req.name} is pinned for {python}"
            continue
        assert name in pins, f"requirements.lock pins no {req.name} for Python {python}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"


def test_python_310_gets_its_own_pins_where_the_311_release_needs_311():
    old, new = lock_pins("3.10"), lock_pins("3.11")
    assert (old["numpy"], new["numpy"]) == ("2.2.6", "2.3.5")  # numpy 2.3 requires Python >= 3.11
    assert (old["pandas"], new["pandas"]) == ("2.3.3", "3.1.1")
    assert {"exceptiongroup", "tomli"} <= set(old) - set(new)  # backports only 3.10 needs
    assert lock_pins("3.12") == lock_pins("3.13") == new


def test_the_transformers_names_that_changed_are_used_without_a_warning(tmp_path):
    """On whichever transformers is installed (the lock's 5.19, or the newest by `make test-latest`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        policy = load_policy("tiny", torch.float32)
        assert not activation_checkpointing(policy)
        output = policy(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
        cache = kv_cache(output)
        assert cache is not None and cache.get_seq_length() == 3
        assert kv_cache(policy(input_ids=torch.tensor([[3]]), use_cache=False)) is None
        enable_activation_checkpointing(policy)
        assert activation_checkpointing(policy)
    assert CACHE_NAME in type(output).__dataclass_fields__  # the field this transformers names
