"""DDP on two CPU processes (gloo) against one process doing the same work.

Two ranks with 2 prompts x 4 completions each run one micro-batch per optimizer step, so each step's gradient is
the mean over the rank's 8 rows and the all-reduced one the mean over 16. The single-process run replays the 16
rows the ranks sampled (`ReplayGRPO`) in one micro-batch of 16: the same mean, so the weights must agree to float
tolerance. Completions have a fixed length (min = max new tokens), so the KL token mean splits over ranks too.
"""

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SUBPROCESS_ENV, fit
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM

from llm_pg.core.rollout import concat_rollouts
from llm_pg.data.batches import ScoredRollout
from llm_pg.modules import GRPOModule

pytestmark = pytest.mark.distributed

TOKENS = 6
COMMON = [
    "--data.task=conftest.DigitTask",
    "--data.task.init_args.eval_size=5",  # odd: the ranks' eval slices differ in size (3 and 2)
    "--model.init_args.group_size=4",
    "--model.init_args.grad_accum_steps=1",
    "--model.init_args.ppo_epochs=2",
    f"--model.init_args.min_new_tokens={TOKENS}",
    f"--model.init_args.max_new_tokens={TOKENS}",
    "--model.init_args.iterations=2",
    "--model.init_args.evaluation.every=100",
    "--model.init_args.log_generations.every=0",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
]


class RolloutRecorder(Callback):
    """Saves each rank's rollout and prompts per iteration (runs right after the RolloutCallback)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        out = Path(trainer.default_root_dir) / "rollouts" / f"iter{batch.index}_rank{trainer.global_rank}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        scored = batch.rollout
        torch.save({"rollout": scored.rows.to("cpu"), "examples": scored.examples}, out)


class RecordingGRPO(GRPOModule):
    """GRPO that records its rollouts and counts all-reduces: DDP reducer buckets (a comm hook), the flat
    gradient buffer of `llm_pg.modules.distributed.average_gradients`, and the rest (metric sync)."""

    def configure_callbacks(self):
        callbacks = super().configure_callbacks()
        return [callbacks[0], RolloutRecorder(), *callbacks[1:]]

    def on_train_start(self) -> None:
        super().on_train_start()
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.counts = {"reducer_buckets": 0, "gradient": 0, "other": 0}
        numel = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)

        def counting_hook(state, bucket):
            self.counts["reducer_buckets"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        self.trainer.strategy.model.register_comm_hook(None, counting_hook)
        all_reduce = torch.distributed.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            self.counts["gradient" if tensor.numel() == numel else "other"] += 1
            return all_reduce(tensor, *args, **kwargs)

        torch.distributed.all_reduce = counting_all_reduce

    def on_train_end(self) -> None:
        super().on_train_end()
        out = Path(self.trainer.default_root_dir)
        counts = self.counts | {"optimizer_steps": self.optimizer_steps}
        (out / f"counts_rank{self.global_rank}.json").write_text(json.dumps(counts))
        torch.save(self.policy.state_dict(), out / f"weights_rank{self.global_rank}.pt")


def merge(parts: list) -> tuple:
    """One rollout from the ranks' rollouts (`concat_rollouts`: prompts left-padded and completions right-padded to
    common widths), rank 1's prompts numbered after rank 0's."""
    first, second = (p["rollout"] for p in parts)
    offset = len(parts[0]["examples"])
    second = dataclasses.replace(second, prompt_index=[i + offset for i in second.prompt_index])
    return concat_rollouts([first, second], pad_id=0), [e for p in parts for e in p["examples"]]


class ReplayRollouts(Callback):
    """Instead of sampling, hands the module the rows both DDP ranks sampled for this iteration."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        folder = Path(os.environ["LLM_PG_REPLAY"])
        parts = [torch.load(folder / f"iter{batch.index}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        rollout, examples = merge(parts)
        assert [e.prompt for e in batch.examples] == [e.prompt for e in examples]  # rank 0's then rank 1's
        old, ref = module.old_logprobs(rollout), module.reference_logprobs(rollout)
        rollout = dataclasses.replace(rollout, old_logp=old, ref_logp=ref)
        batch.rollout = ScoredRollout(rollout, [], {"train/reward": float(rollout.rewards.mean())})


class ReplayGRPO(GRPOModule):
    def configure_callbacks(self):
        return [ReplayRollouts(), *super().configure_callbacks()[1:]]


def _train_rows(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]
    return sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])


def _eval_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval" / "iter_00000.jsonl").read_text().splitlines()]


ENV = SUBPROCESS_ENV


def ddp_command(tmp_path: Path, model_dir: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llm_pg.cli.fit",
        "fit",
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        "--model.class_path=test_ddp.RecordingGRPO",
        f"--model.init_args.model_name_or_path={model_dir}",
        f"--runs_root={tmp_path}",
        "--run_name=ddp",
        "--data.prompts_per_step=2",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        *COMMON,
        *extra,
    ]


@pytest.mark.slow
def test_ddp_equals_one_process_over_the_same_rows(tmp_path, random_model_dir, monkeypatch):
    every_row = "--model.init_args.minibatch_size=8"  # every row of the rank: one micro-batch per step
    command = ddp_command(tmp_path, random_model_dir, every_row)
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = tmp_path / "ddp"

    # Communication: no DDP reducer bucket at all, one flat gradient all-reduce per optimizer step.
    counts = [json.loads((ddp / f"counts_rank{r}.json").read_text()) for r in (0, 1)]
    for count in counts:
        assert count["optimizer_steps"] == 4  # 2 iterations x 2 epochs x 1 step
        assert count["reducer_buckets"] == 0
        assert count["gradient"] == 4
    weights = [torch.load(ddp / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
    final = AutoModelForCausalLM.from_pretrained(ddp / "final").state_dict()  # rank zero saved the trained policy
    assert final.keys() == weights[0].keys()
    for name, weight in final.items():
        assert torch.equal(weight, weights[0][name]), name

    # Each rank sampled its own prompts.
    for iteration in (0, 1):
        prompts = [
            {
                e.prompt
                for e in torch.load(ddp / "rollouts" / f"iter{iteration}_rank{r}.pt", weights_only=False)["examples"]
            }
            for r in (0, 1)
        ]
        assert len(prompts[0]) == len(prompts[1]) == 2 and not prompts[0] & prompts[1]

    # One process over the same 16 rows per iteration, in one micro-batch of 16.
    monkeypatch.setenv("LLM_PG_REPLAY", str(ddp / "rollouts"))
    single = fit(
        tmp_path / "one",
        random_model_dir,
        "--model.class_path=test_ddp.ReplayGRPO",
        "--data.prompts_per_step=4",
        "--model.init_args.minibatch_size=16",
        *COMMON,
    ).model
    assert single.optimizer_steps == 4
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    for name, weight in single.policy.state_dict().items():
        assert (weight - initial[name]).abs().max() > 1e-4, name  # training moved it, by far more than the tolerance
        torch.testing.assert_close(weight, weights[0][name], atol=1e-6, rtol=1e-5)

    # Logged training metrics: means over ranks equal the 16-row values (equal rows and tokens per rank), the
    # gradient norm is that of the mean gradient (a sum over ranks would double it), ratio_max is the max over ranks.
    ddp_rows, single_rows = _train_rows(ddp), _train_rows(tmp_path / "one" / "run")
    assert len(ddp_rows) == len(single_rows) == 2
    for ddp_row, single_row in zip(ddp_rows, single_rows, strict=True):
        for name in ("train/grad_norm", "train/loss", "train/kl", "train/ratio_max", "train/clip_fraction"):
            assert ddp_row[name] == pytest.approx(single_row[name], rel=1e-4, abs=1e-7), name
    assert ddp_rows[1]["train/ratio_max"] > 1.0  # the second pass ran on moved weights: the max means something

    # Sharded greedy eval: rank zero wrote every row, equal to the single process's eval.
    assert _eval_rows(ddp) == _eval_rows(tmp_path / "one" / "run")


@pytest.mark.slow
def test_filtered_and_refilled_groups_are_as_many_on_every_rank(tmp_path, random_model_dir):
    # Only stream indices 0, 3, 6, ... have reward spread (test_variants.VariedTask, settle=third), and rank r's batch
    # b holds indices (2b + r) * 2 + {0, 1}. Iteration 1 samples batches 0 and 1 (the round limit): rank 0 finds one
    # group with spread (index 0), rank 1 two (3 and 6). Iteration 2, batches 2 and 3: rank 0 finds two (9, 12),
    # rank 1 one (15). Every rank keeps the fewest any rank has, so both train on one group a step.
    refill = [
        "--data.task=test_variants.VariedTask",
        "--data.task.init_args.settle=third",
        "--model.init_args.filter_zero_std_groups=true",
        "--model.init_args.max_sampling_rounds=2",
        "--model.init_args.minibatch_size=2",
    ]
    result = subprocess.run(
        ddp_command(tmp_path, random_model_dir, *refill), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = tmp_path / "ddp"
    kept = {}
    for iteration in (0, 1):
        for rank in (0, 1):
            part = torch.load(ddp / "rollouts" / f"iter{iteration}_rank{rank}.pt", weights_only=False)
            prompts = {part["examples"][i].prompt for i in part["rollout"].prompt_index}
            kept[iteration, rank] = sorted(int(p.rsplit(":", 1)[1]) for p in prompts)
            assert len(part["rollout"]) == 4  # one group of 4
    assert kept == {(0, 0): [0], (0, 1): [3], (1, 0): [9], (1, 1): [15]}
    counts = [json.loads((ddp / f"counts_rank{r}.json").read_text()) for r in (0, 1)]
    for count in counts:  # 4 rows in micro-batches of 2, one step each, 2 epochs, 2 iterations
        assert count["optimizer_steps"] == count["gradient"] == 8
    weights = [torch.load(ddp / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
    rows = _train_rows(ddp)
    assert [r["train/groups_kept"] for r in rows] == [1.0, 1.0]
    assert [r["train/sampling_rounds"] for r in rows] == [2.0, 2.0]
    assert [r["train/filtered_groups"] for r in rows] == [2.5, 2.5]  # means over ranks: (3 + 2) / 2 and (2 + 3) / 2


@pytest.mark.slow
def test_tool_episodes_under_ddp_keep_the_ranks_in_step(tmp_path):
    """calc_arith on the tool-aware tiny model with 2 ranks: each rank runs its own episodes (as many turns as its
    rows need, no collective among them), the eval's episodes are sharded, and both ranks end with equal weights."""
    tools = [
        "--data.task=llm_pg.data.tasks.CalcArithTask",
        "--data.task.init_args.system_prompt=null",
        "--model.init_args.min_new_tokens=0",
        "--model.init_args.max_new_tokens=64",
    ]
    result = subprocess.run(
        ddp_command(tmp_path, "tiny-tools", *tools), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = tmp_path / "ddp"
    weights = [torch.load(ddp / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
    calls = []
    for iteration in (0, 1):
        for rank in (0, 1):
            part = torch.load(ddp / "rollouts" / f"iter{iteration}_rank{rank}.pt", weights_only=False)
            calls.append(int(part["rollout"].tool_calls.sum()))
    assert sum(calls) > 0  # the episodes called the calculator
    rows = [r for r in _train_rows(ddp)]
    assert len(rows) == 2 and all("train/tool_call_rate" in r for r in rows)
    evaluated = _eval_rows(ddp)
    assert len(evaluated) == 5 and all("<|im_end|>" in row["completion"] for row in evaluated)  # transcripts
