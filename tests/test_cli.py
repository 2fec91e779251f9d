"""Every shipped config instantiates, and bad settings fail early with a message naming the key."""

from pathlib import Path

import pytest
from conftest import ROOT, fit

from llm_pg.cli import LLMPGCLI, run_cli
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.modules import PolicyGradientModule

CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


def test_there_are_configs_for_every_task_and_algorithm():
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS}
    for required in [
        "format_copy/grpo.yaml",
        "format_copy/reinforce.yaml",
        "math_hard/grpo.yaml",
        "math_hard/reinforce.yaml",
        "tiny/format_copy_grpo.yaml",
        "tiny/format_copy_reinforce.yaml",
        "tiny/arith_grpo.yaml",
        "tiny/arith_reinforce.yaml",
    ]:
        assert required in names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_config_instantiates_without_loading_weights(tmp_path, config):
    assert config.read_text().startswith("# llm-pg fit --config"), "a config opens with the command that runs it"
    cli = LLMPGCLI(
        PolicyGradientModule,
        PromptGroupDataModule,
        subclass_mode_model=True,
        seed_everything_default=False,
        run=False,
        args=[f"--config={config}", "--trainer.accelerator=cpu", f"--runs_root={tmp_path}", "--wandb_project=null"],
    )
    assert cli.model.policy is None  # weights load in configure_model, not at parse time
    assert cli.model.hparams.prompts_per_step == cli.datamodule.prompts_per_step  # linked once
    assert cli.model.hparams.seed == cli.datamodule.seed


def test_real_configs_match_the_reference_table():
    import yaml

    expected = {  # design.md: iterations, G, max_new_tokens, ppo_epochs, minibatch, accum
        "format_copy/grpo.yaml": (51, 6, 24, 2, 8, 6),
        "format_copy/reinforce.yaml": (51, 6, 24, None, 8, 6),
        "math_hard/reinforce.yaml": (201, 8, 512, None, 8, 8),
        "math_hard/grpo.yaml": (501, 8, 512, 2, 8, 8),
    }
    for name, (iterations, group, tokens, epochs, minibatch, accum) in expected.items():
        config = yaml.safe_load((ROOT / "configs" / name).read_text())
        args = config["model"]["init_args"]
        assert args["model_name_or_path"] == "Qwen/Qwen2.5-Math-1.5B-Instruct"
        assert (args["lora"]["r"], args["lora"]["alpha"]) == (16, 32)
        assert (args["iterations"], args["group_size"], args["max_new_tokens"]) == (iterations, group, tokens)
        assert args.get("ppo_epochs") == epochs
        assert (args["minibatch_size"], args["grad_accum_steps"]) == (minibatch, accum)
        assert (args["lr"], args["kl_coef"], args["max_grad_norm"]) == (3e-5, 0.05, 0.5)
        assert config["data"]["prompts_per_step"] == 8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.init_args.minibatch_size=0", "model.minibatch_size must be >= 1"),
        ("--model.init_args.grad_accum_steps=0", "model.grad_accum_steps must be >= 1"),
        ("--model.init_args.minibatch_size=64", "larger than one iteration's 8 rows"),
        ("--model.init_args.group_size=1", "model.group_size must be >= 2"),
        ("--model.init_args.model_name_or_path=./no/such/model", "no model directory at './no/such/model'"),
        ("--model.init_args.kl_coef=-1", "model.kl_coef must be >= 0"),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, "tiny", override)


def test_reinforce_rejects_ppo_epochs(tmp_path):
    with pytest.raises(ValueError, match=r"model.ppo_epochs=2: REINFORCE makes one on-policy pass"):
        fit(tmp_path, "tiny", "--model.init_args.ppo_epochs=2", config="configs/tiny/format_copy_reinforce.yaml")


def test_unknown_task_is_a_config_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, "tiny", "--data.task=llm_pg.data.tasks.NoSuchTask")
    assert "data.task" in capsys.readouterr().err


def test_validate_reports_the_baseline(tmp_path, random_model_dir):
    cli = run_cli(
        [
            "validate",
            f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
            f"--model.init_args.model_name_or_path={random_model_dir}",
            "--data.task.init_args.eval_size=4",
            f"--runs_root={tmp_path}",
            "--wandb_project=null",
        ]
    )
    assert cli.trainer.callback_metrics["eval/exact_match"] == 0.0  # a random model copies nothing
    assert Path(cli.trainer.default_root_dir).name == "tiny_format_copy_grpo"
