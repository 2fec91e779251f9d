"""`rollout_engine: vllm` under DDP on two CPU processes (gloo): one vLLM engine per rank, in the trainer's group.

`llm-pg fit --trainer.devices 2 --model.init_args.rollout_engine vllm` runs in a subprocess (Lightning starts the
second rank itself) on a random Llama with head dim 32 (vLLM's CPU attention needs it). Every prompt is the same
text, so two ranks that sampled with the same seeds from the same weights would return the same completions: that
they differ shows each rank seeds its own requests. A high learning rate moves the policy far from its start within
three iterations, so vLLM's log-probs equal the trainer's only if each rank's engine received the updated weights.

Runs in `.venv-vllm` (`make test-vllm`); skipped where vLLM is not installed. A hang fails the test after
`TIMEOUT_S` (the process group it started is killed) instead of stalling CI.
"""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: run `make test-vllm`")

from conftest import ROOT, DigitTask, make_random_llama
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM

from llm_pg.data.tasks.base import Example
from llm_pg.engines import EngineSettings, build_engine
from llm_pg.modules import GRPOModule

pytestmark = pytest.mark.vllm

ITERATIONS = 3
TIMEOUT_S = 300  # about 40 s here, mostly the two engines starting on two shared cores


class SamePromptTask(DigitTask):
    """DigitTask whose training prompts are all one text, on every rank: completions differ only by their seeds."""

    def train_example(self, index: int, seed: int) -> Example:
        return Example(prompt="Say digits", answer="")


class RolloutRecorder(Callback):
    """Saves each rank's rollout before its update, with the trainer's log-probs of the sampled tokens under the
    weights vLLM sampled with (a no-grad pass of the policy; the update's own pi_old lives on a copy)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        out = Path(trainer.default_root_dir) / "rollouts" / f"iter{batch.index}_rank{trainer.global_rank}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        rollout = batch.rollout.rows
        trainer_logp = module.old_logprobs(rollout)  # [N, C]
        torch.save({"rollout": rollout.to("cpu"), "trainer_logp": trainer_logp.cpu()}, out)


class RecordingGRPO(GRPOModule):
    """GRPO that records its rollouts, the class of its engine and its final weights, per rank."""

    def configure_callbacks(self):
        return [*super().configure_callbacks(), RolloutRecorder()]

    def on_train_end(self) -> None:
        super().on_train_end()
        out = Path(self.trainer.default_root_dir)
        torch.save(self.policy.state_dict(), out / f"weights_rank{self.global_rank}.pt")
        (out / f"engine_rank{self.global_rank}.txt").write_text(type(self._engine).__name__)


def run_fit(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m llm_pg.cli.fit fit ARGS` in a session of its own, killed whole (both ranks) after `TIMEOUT_S`."""
    env = {
        "PYTHONPATH": str(ROOT / "tests"),
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "llm_pg.cli.fit", "fit", *args]
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher's rank-1 child is in the same session
        output, _ = process.communicate()
        pytest.fail(f"DDP + vLLM run did not finish in {TIMEOUT_S} s (a hang?); last output:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _train_rows(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]
    return sorted((r for r in rows if "train/kl" in r), key=lambda r: r["step"])


def test_ddp_one_vllm_engine_per_rank(tmp_path):
    model_dir = make_random_llama(tmp_path / "model", hidden_size=64)
    args = [
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        "--model.class_path=test_vllm_ddp.RecordingGRPO",
        f"--model.init_args.model_name_or_path={model_dir}",
        f"--runs_root={tmp_path}",
        "--run_name=ddp",
        "--data.task=test_vllm_ddp.SamePromptTask",
        "--data.task.init_args.eval_size=3",  # odd: ranks evaluate 2 and 1 prompts, so engines never step in lockstep
        "--data.prompts_per_step=2",
        "--model.init_args.group_size=4",
        "--model.init_args.minibatch_size=8",  # every row of the rank: one step per pass, pi_old from the first
        "--model.init_args.grad_accum_steps=1",
        "--model.init_args.max_new_tokens=8",
        f"--model.init_args.iterations={ITERATIONS}",
        "--model.init_args.lr=1e-2",  # far from the start within the run: stale engine weights would show
        "--model.init_args.evaluation.every=100",
        "--model.init_args.log_generations.every=0",
        "--model.init_args.rollout_engine=vllm",
        f"--model.init_args.vllm.kv_cache_memory_bytes={64 * 2**20}",
        "--wandb_project=null",
        "--trainer.enable_progress_bar=false",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
    ]
    result = run_fit(args, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "ddp"
    assert (run / "COMPLETE").exists()
    assert [(run / f"engine_rank{r}.txt").read_text() for r in (0, 1)] == ["VLLMEngine", "VLLMEngine"]

    # The run's own health figure, logged every iteration (the largest over the ranks).
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    assert max(r["rollout/logprob_mismatch_max"] for r in rows) < 1e-4
    assert rows[-1]["train/kl"] > 1e-3  # the policy moved: engines holding the initial weights would mismatch

    for iteration in range(ITERATIONS):
        saved = [torch.load(run / "rollouts" / f"iter{iteration}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        rollouts = [part["rollout"] for part in saved]
        for rollout, trainer_logp in zip(rollouts, (part["trainer_logp"] for part in saved), strict=True):
            mask = rollout.completion_mask  # [8, C]
            # Each rank's vLLM log-probs equal its trainer's under the same weights ...
            assert (rollout.sampled_logp - trainer_logp)[mask].abs().max() < 1e-4
            if iteration == ITERATIONS - 1:
                # ... and not the reference's (the initial weights vLLM loaded from disk): the push reached it.
                assert (rollout.sampled_logp - rollout.ref_logp)[mask].abs().max() > 1e-2
        # One prompt text everywhere: the ranks' completions differ because their seeds do (same seeds and weights
        # would give the same tokens: tests/test_vllm.py), as do the rows of a group.
        assert all(len(set(rollout.texts)) > 4 for rollout in rollouts)
        shared = set(rollouts[0].texts) & set(rollouts[1].texts)
        assert not shared, f"iteration {iteration}: both ranks sampled {len(shared)} equal completions"

    # DDP: the ranks hold equal weights after the updates, far from where they started.
    weights = [torch.load(run / f"weights_rank{r}.pt", weights_only=True) for r in (0, 1)]
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
        assert (weight - initial[name]).abs().max() > 1e-3, name


def test_several_ranks_under_another_strategy_are_refused(monkeypatch):
    """Only DDP gets one engine per rank; FSDP2 (also refused in `configure_model`) or any other strategy: one line."""
    strategy = type("FSDP2", (), {})()
    settings = EngineSettings("unused", (0,), torch.float32, torch.device("cpu"), world_size=2, strategy=strategy)
    with pytest.raises(ValueError, match=r"^model\.rollout_engine=vllm with trainer\.strategy FSDP2: .* set trainer"):
        build_engine("vllm", None, None, settings)
