"""The fast variants of the course's four runs (`configs/*/*_vllm.yaml`): the course config plus the vLLM engine,
its memory share, one-call evaluation and truncated importance sampling (`correction`), and nothing else; each opens
with its commands, and docs/runs.md gives the Modal command of each."""

import importlib.util
import sys

import pytest
import yaml
from conftest import ROOT

from llm_pg.cli.fit import LLMPGCLI
from llm_pg.core.correction import SamplerCorrection
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.modules import PolicyGradientModule

COURSE_RUNS = ["format_copy/grpo", "format_copy/reinforce", "math_hard/grpo", "math_hard/reinforce"]
ADDED = {
    "rollout_engine": "vllm",
    "vllm.gpu_memory_utilization": 0.3,
    "evaluation.generate_batch_size": None,
    "correction.mode": "token_truncate",
    "correction.max": 2.0,
}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _pop(args: dict, dotted: str, default=None):
    """`args[dotted]` removed, a group's key given as `group.key` (and the group with it once empty)."""
    group, _, key = dotted.rpartition(".")
    node = args.get(group, {}) if group else args
    value = node.pop(key, default)
    if group and not node:
        args.pop(group, None)
    return value


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("run", COURSE_RUNS)
def test_variant_is_the_course_config_plus_the_engine_keys(run):
    course, fast = _load(run), _load(f"{run}_vllm")
    assert {key: _pop(fast["model"]["init_args"], key) for key in ADDED} == ADDED
    missing = object()
    assert all(_pop(course["model"]["init_args"], key, missing) is missing for key in ADDED)  # left at the defaults
    assert fast == course  # every other key, the model class, data, checkpoint and trainer sections alike


@pytest.mark.parametrize("run", COURSE_RUNS)
def test_variant_opens_with_its_commands_and_docs_give_the_modal_one(run):
    lines = (ROOT / "configs" / f"{run}_vllm.yaml").read_text().splitlines()
    assert lines[0] == f"# llm-pg fit --config configs/{run}_vllm.yaml"
    assert lines[1] == f"# (on Modal: modal run --detach launch.py --config configs/{run}_vllm.yaml)"
    assert f"modal run --detach launch.py --config configs/{run}_vllm.yaml" in (ROOT / "docs/runs.md").read_text()


def _instantiate(run: str, tmp_path):
    return LLMPGCLI(
        PolicyGradientModule,
        PromptGroupDataModule,
        subclass_mode_model=True,
        seed_everything_default=False,
        run=False,
        args=[
            f"--config={ROOT / 'configs' / f'{run}_vllm.yaml'}",
            "--trainer.accelerator=cpu",
            f"--runs_root={tmp_path}",
            "--wandb_project=null",
        ],
    )


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its absence is tested below)")
@pytest.mark.parametrize("run", COURSE_RUNS)
def test_variant_instantiates_with_vllm(tmp_path, run):
    module = _instantiate(run, tmp_path).model
    assert module.policy is None and module.hparams.rollout_engine == "vllm"
    assert module.sampler_correction == SamplerCorrection("token_truncate", 2.0)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed (the variants instantiate above)")
def test_variant_without_vllm_fails_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    from llm_pg.cli.fit import main

    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    config = f"--config={ROOT / 'configs' / 'math_hard' / 'grpo_vllm.yaml'}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", config, f"--runs_root={tmp_path}", "--wandb_project=null"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg")]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert "model.rollout_engine=vllm but vLLM is not installed" in lines[0]
    assert not list(tmp_path.iterdir())  # refused before the run dir was made
