"""End-to-end behaviour of `llm-pg fit` on a random two-layer model (seconds per run)."""

import csv
import json
import logging

import pytest
import torch
from conftest import fit
from test_logprobs import alone_logprobs
from transformers import AutoModelForCausalLM

from llm_pg.core.losses import grpo_loss
from llm_pg.core.objectives import Objective

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


def test_first_grpo_micro_batch_has_ratio_one(tmp_path, random_model_dir, monkeypatch):
    # One pass, one micro-batch of all 8 rows, sampled at T 0.8 and scored at logprob_temperature 1.0. pi_old is
    # recomputed here another way (each row alone, unpadded, from the initial weights): rho = 1, nothing clipped.
    calls = []
    original_loss = Objective.__call__

    def recording_loss(self, logp, entropy, micro):
        calls.append((logp.detach().clone(), micro.rows))
        return original_loss(self, logp, entropy, micro)

    monkeypatch.setattr(Objective, "__call__", recording_loss)
    cli = fit(
        tmp_path,
        random_model_dir,
        "--model.init_args.iterations=1",
        "--model.init_args.ppo_epochs=1",
        "--model.init_args.minibatch_size=8",
        "--model.init_args.grad_accum_steps=1",
        "--model.init_args.temperature=0.8",
        *DIGITS,
    )
    assert cli.model.optimizer_steps == 1 and len(calls) == 1
    logp, part = calls[0]
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).eval()
    old_logp = torch.zeros_like(logp)
    for row in range(len(part)):
        old_logp[row][part.completion_mask[row]] = alone_logprobs(initial, part, row, temperature=1.0)
    mask = part.completion_mask
    ratio = torch.exp(logp - old_logp)[mask]
    assert (ratio - 1).abs().max() < 1e-5
    _, stats = grpo_loss(logp, old_logp, mask, part.advantages, clip_eps=0.2)
    assert float(stats["clip_fraction"]) == 0.0
    assert part.advantages.abs().sum() > 0  # a real policy gradient, not an all-zero group
    (row,) = [r for r in _metrics(tmp_path / "run") if "train/ratio_max" in r]
    assert row["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert row["train/clip_fraction"] == 0.0


def _generations(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


@pytest.mark.slow
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
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]  # noqa: E731
    assert strip(runs["a"]) == strip(runs["b"])
    assert strip(runs["a"]) != strip(runs["c"])


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


def test_resume_after_the_final_iteration_trains_nothing(tmp_path, random_model_dir, caplog):
    common = ["--model.init_args.iterations=2", *DIGITS, "--checkpoint.every_n_iterations=1"]
    first = fit(tmp_path, random_model_dir, *common).model
    weights = {name: weight.clone() for name, weight in first.policy.state_dict().items()}
    with caplog.at_level(logging.INFO):
        again = fit(tmp_path, random_model_dir, *common, "--ckpt_path=last").model
    assert again.iteration == 2 and again.optimizer_steps == first.optimizer_steps
    assert all(torch.equal(weight, weights[name]) for name, weight in again.policy.state_dict().items())
    (line,) = [r.getMessage() for r in caplog.records if "run complete" in r.getMessage()]
    assert line.startswith("run complete: 2 of model.iterations=2 iterations are done; nothing to train")
    rows = _metrics(tmp_path / "run")
    assert sorted(r["step"] for r in rows if "train/reward" in r) == [1.0, 2.0]  # no third iteration
    # The resume re-runs the final eval (a kill may have cut the first one short) in place of the first one's row.
    assert sorted(r["step"] for r in rows if "eval/exact_match" in r) == [0.0, 2.0]
