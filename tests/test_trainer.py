"""End-to-end behaviour of `llm-pg fit` on a random two-layer model (seconds per run)."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, fit
from transformers import AutoModelForCausalLM

DIGITS = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]

EXPECTED_METRICS = [
    "train/reward",
    "train/reward_digits",
    "train/reward_std",
    "train/frac_zero_std_groups",
    "train/completion_len",
    "train/truncated_frac",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/ratio_max",
    "train/grad_norm",
    "train/lr",
    "train/optimizer_steps",
    "train/skipped_steps",
    "time/rollout",
    "time/update",
    "eval/exact_match",
]


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


@pytest.mark.parametrize(
    ("config", "extra"),
    [("configs/tiny/format_copy_grpo.yaml", ["train/clip_fraction"]), ("configs/tiny/format_copy_reinforce.yaml", [])],
)
def test_fit_trains_policy_and_leaves_reference_alone(tmp_path, random_model_dir, config, extra):
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    cli = fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", *DIGITS, config=config)
    module = cli.model
    assert module.iteration == 3
    changed = [n for n, p in module.policy.state_dict().items() if not torch.equal(p, initial[n])]
    assert len(changed) > 0.5 * len(initial), "most policy weights should move in 3 iterations"
    reference = module.reference
    assert reference is not None and not reference.training
    assert all(not p.requires_grad for p in reference.parameters())
    assert all(torch.equal(p, initial[n]) for n, p in reference.state_dict().items())
    assert not any(k.startswith("_reference") for k in module.state_dict())  # not a submodule
    rows = _metrics(tmp_path / "run")
    logged = set().union(*rows)
    for name in EXPECTED_METRICS + extra:
        assert name in logged, name
    train_steps = sorted(r["step"] for r in rows if "train/reward" in r)
    assert train_steps == [1.0, 2.0, 3.0]  # the x-axis is the RL iteration
    eval_steps = sorted(r["step"] for r in rows if "eval/exact_match" in r)
    assert eval_steps == [0.0, 3.0]  # baseline and end
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["llm_pg"]["iteration"] == 3
    assert all(k.startswith("policy.") for k in checkpoint["state_dict"])
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert (tmp_path / "run" / "config.yaml").exists()


def test_first_grpo_micro_batch_has_ratio_one(tmp_path, random_model_dir):
    # One pass, one micro-batch of all 8 rows: the policy has not moved, so rho = 1 and nothing is clipped.
    cli = fit(
        tmp_path,
        random_model_dir,
        "--model.init_args.iterations=1",
        "--model.init_args.ppo_epochs=1",
        "--model.init_args.minibatch_size=8",
        "--model.init_args.grad_accum_steps=1",
        *DIGITS,
    )
    (row,) = [r for r in _metrics(tmp_path / "run") if "train/ratio_max" in r]
    assert row["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert row["train/clip_fraction"] == 0.0
    assert cli.model.optimizer_steps == 1


def _generations(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


def test_resume_continues_exactly(tmp_path, random_model_dir):
    common = [*DIGITS, "--checkpoint.every_n_iterations=1"]
    straight = fit(tmp_path / "a", random_model_dir, "--model.init_args.iterations=4", *common).model
    fit(tmp_path / "b", random_model_dir, "--model.init_args.iterations=2", *common)
    resumed = fit(tmp_path / "b", random_model_dir, "--model.init_args.iterations=4", "--ckpt_path=last", *common)
    assert resumed.model.iteration == 4
    resumed_weights = resumed.model.policy.state_dict()
    for name, weight in straight.policy.state_dict().items():
        assert torch.equal(weight, resumed_weights[name]), name
    assert _generations(tmp_path / "a" / "run") == _generations(tmp_path / "b" / "run")
    # metrics.csv keeps the first attempt's rows: the resumed run appends.
    steps = sorted({r["step"] for r in _metrics(tmp_path / "b" / "run") if "train/reward" in r})
    assert steps == [1.0, 2.0, 3.0, 4.0]


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path, random_model_dir):
    runs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        fit(tmp_path / name, random_model_dir, "--model.init_args.iterations=2", f"--seed={seed}", *DIGITS)
        runs[name] = [r for r in _metrics(tmp_path / name / "run") if "train/loss" in r]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(runs["a"]) == strip(runs["b"])
    assert strip(runs["a"]) != strip(runs["c"])


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path, random_model_dir):
    from conftest import SMALL

    command = [
        sys.executable,
        "-m",
        "llm_pg.cli",
        "fit",
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        f"--model.init_args.model_name_or_path={random_model_dir}",
        f"--runs_root={tmp_path}",
        "--run_name=ddp",
        "--model.init_args.iterations=2",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        *SMALL,
    ]
    env = {"PYTHONPATH": str(ROOT / "tests"), "PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "ddp")
    assert sorted(r["step"] for r in rows if "train/reward" in r) == [1.0, 2.0]
    assert (tmp_path / "ddp" / "checkpoints" / "last.ckpt").exists()


def test_lora_trains_only_the_adapter_and_uses_the_base_as_reference(tmp_path, random_model_dir):
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    cli = fit(
        tmp_path,
        random_model_dir,
        "--model.init_args.iterations=2",
        "--model.init_args.lora.r=4",
        "--model.init_args.lora.alpha=8",
        *DIGITS,
    )
    module = cli.model
    assert module.reference is None  # no second copy: the reference is the base with the adapter disabled
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base = module.policy.get_base_model().state_dict()
    frozen = {n.replace(".base_layer", ""): p for n, p in base.items() if "lora_" not in n}
    assert all(torch.equal(p, initial[n]) for n, p in frozen.items())  # base weights untouched
    rows = [r for r in _metrics(tmp_path / "run") if "train/kl" in r]
    assert rows[-1]["train/kl"] > 0  # the adapter moved the policy away from the (adapter-disabled) reference
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["state_dict"] and all("lora_" in k for k in checkpoint["state_dict"])
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").exists()
