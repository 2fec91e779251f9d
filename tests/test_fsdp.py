"""FSDP2 (`--trainer.strategy fsdp2`, `llm_pg.models.parallel.FSDP2`) on two CPU processes (gloo) against one process.

As in tests/test_ddp.py, each rank samples 2 prompts x 4 completions of a fixed length, and one process replays the
16 rows both ranks sampled (`test_ddp.ReplayGRPO`, one micro-batch of 16): the same mean gradient, so the weights
and every step's gradient norm must agree. Here each rank accumulates 2 micro-batches of 4 rows per step, so FSDP2
reduce-scatters after every backward and the clip sees DTensor gradients. Evaluation has 5 prompts in batches of 2:
rank 0 decodes 2 batches and rank 1 one, with greedy completions of different lengths, which hangs (and the
timeout fails the test) unless an evaluation gathers the weights once, outside its batches.
"""

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SUBPROCESS_ENV, fit
from test_ddp import COMMON, RolloutRecorder, _eval_rows, _train_rows
from transformers import AutoModelForCausalLM

import llm_pg.modules.update as update
from llm_pg.modules import GRPOModule

TIMEOUT_S = 240  # a hang fails the test instead of stalling CI
FSDP_RUN = [  # on top of test_ddp.COMMON: 2 micro-batches of 4 rows per optimizer step on each rank
    "--data.prompts_per_step=2",
    "--model.init_args.minibatch_size=4",
    "--model.init_args.grad_accum_steps=2",
    "--model.init_args.speed.logprob_batch_size=2",
    "--trainer.strategy=fsdp2",
]
GEN_TOKENS = 12


def fit_command(tmp_path: Path, model_dir: str, run_name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llm_pg.cli.fit",
        "fit",
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        "--model.class_path=test_fsdp.RecordingFSDP",
        f"--model.init_args.model_name_or_path={model_dir}",
        f"--runs_root={tmp_path}",
        f"--run_name={run_name}",
        *COMMON,
        *FSDP_RUN,
        *extra,
    ]


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float = TIMEOUT_S) -> None:
    """Start every (command, extra env) at once, each in its own process group, and wait for all; on a timeout kill
    every group (Lightning's launcher starts the other ranks as children) and fail."""
    base = dict(SUBPROCESS_ENV)
    children = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=base | env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command, env in commands
    ]
    try:
        outputs = [child.communicate(timeout=timeout)[0] for child in children]
    except subprocess.TimeoutExpired:
        tails = []
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            tails.append(child.communicate()[0][-2000:])
        pytest.fail(f"distributed run did not finish within {timeout} s (a hang?): {tails}")
    for child, output in zip(children, outputs, strict=True):
        assert child.returncode == 0, output[-4000:]


class RecordingFSDP(GRPOModule):
    """GRPO that records its rollouts, the gradient norm of every step, and the collectives it makes: FSDP2's
    all-gathers and reduce-scatters, all-reduces of the flat gradient size (DDP's manual averaging) and others."""

    def configure_callbacks(self):
        callbacks = super().configure_callbacks()
        return [callbacks[0], RolloutRecorder(), *callbacks[1:]]

    def setup(self, stage: str) -> None:
        self.counts, self.norms, self.numel = Counter(), [], -1
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
            original = getattr(torch.distributed, name)

            def counting(*args, _original=original, _name=name, **kwargs):
                tensor = args[0] if args else kwargs.get("tensor")
                gradient = _name == "all_reduce" and tensor.numel() == self.numel
                self.counts["gradient_all_reduce" if gradient else _name] += 1
                return _original(*args, **kwargs)

            setattr(torch.distributed, name, counting)
        step = update.clipped_step

        def recording_step(context, optimizer):
            norm = step(context, optimizer)
            self.norms.append(norm)
            return norm

        update.clipped_step = recording_step

    def on_train_start(self) -> None:
        super().on_train_start()
        self.numel = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        self.generation = self.measure_generation()
        self.counts.clear()

    def measure_generation(self) -> dict:
        """All-gathers of one greedy generation of GEN_TOKENS tokens: through HFEngine, and HF generate alone."""
        from torch.distributed.fsdp import FSDPModule

        from llm_pg.engines import HFEngine
        from llm_pg.models.generation import Sampling, generate

        prompt = [[{"role": "user", "content": f"Say digits {self.global_rank}"}]]
        sampling = Sampling(max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, greedy=True)
        start = self.counts["all_gather_single"]
        engine = HFEngine(self.policy, self.tokenizer).generate(prompt, sampling)
        middle = self.counts["all_gather_single"]
        plain = generate(self.policy, self.tokenizer, prompt, sampling)
        # Ranks stop at their own EOS here (no minimum): one gather for the call, so nothing waits for the other rank.
        HFEngine(self.policy, self.tokenizer).generate(
            prompt * (1 + self.global_rank), Sampling(max_new_tokens=20, greedy=True)
        )
        return {
            "units": sum(isinstance(m, FSDPModule) for m in self.policy.modules()),
            "engine_gathers": middle - start,
            "plain_gathers": self.counts["all_gather_single"] - middle,
            "same_tokens": torch.equal(engine.completion_ids, plain.completion_ids),
        }

    def on_train_end(self) -> None:
        super().on_train_end()  # writes final/: a collective gather of the full weights
        from llm_pg.models.parallel import full_state_dict

        weights = full_state_dict(self.policy)  # collective: every rank
        out = Path(self.trainer.default_root_dir)
        record = {
            "counts": dict(self.counts),
            "norms": self.norms,
            "generation": self.generation,
            "optimizer_steps": self.optimizer_steps,
            "rank": self.global_rank,
            "node_rank": self.trainer.node_rank,
        }
        (out / f"record_rank{self.global_rank}.json").write_text(json.dumps(record))
        if self.global_rank == 0:
            torch.save(weights, out / "weights.pt")


def replay_one_process(
    tmp_path: Path, model_dir: str, rollouts: Path, monkeypatch, *extra: str
) -> tuple[GRPOModule, list[float]]:
    """One process over the ranks' 16 rows per iteration in one micro-batch; returns the module and step norms."""
    norms, step = [], update.clipped_step

    def recording_step(context, optimizer):
        norms.append(step(context, optimizer))
        return norms[-1]

    monkeypatch.setattr(update, "clipped_step", recording_step)
    monkeypatch.setenv("LLM_PG_REPLAY", str(rollouts))
    single = fit(
        tmp_path / "one",
        model_dir,
        "--model.class_path=test_ddp.ReplayGRPO",
        *COMMON,
        "--data.prompts_per_step=4",
        "--model.init_args.minibatch_size=16",
        "--model.init_args.speed.logprob_batch_size=2",
        *extra,
    ).model
    return single, norms


def assert_matches_one_process(
    run: Path, single: GRPOModule, single_norms: list[float], model_dir: str, iterations: int = 2
) -> None:
    records = [json.loads((run / f"record_rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert record["optimizer_steps"] == iterations * 2  # 2 epochs x 1 step per iteration
        assert record["norms"] == pytest.approx(single_norms, rel=1e-5)  # the global norm, the same on both ranks
    weights = torch.load(run / "weights.pt", weights_only=True)
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    state = single.policy.state_dict()
    assert set(weights) == set(state)
    for name, weight in state.items():
        assert (weight - initial[name]).abs().max() > 1e-4, name  # training moved it, by far more than the tolerance
        torch.testing.assert_close(weights[name], weight, atol=1e-6, rtol=1e-5)
    final = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()  # written by every rank together
    for name, weight in final.items():
        torch.testing.assert_close(weight, weights[name], atol=0, rtol=0)
    assert _eval_rows(run) == _eval_rows(Path(single.trainer.default_root_dir))  # sharded eval, rank zero wrote all


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_equals_one_process_gathers_once_per_generation(tmp_path, random_model_dir, monkeypatch):
    run_processes([(fit_command(tmp_path, random_model_dir, "fsdp", "--trainer.devices=2"), {})])
    run = tmp_path / "fsdp"
    records = [json.loads((run / f"record_rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        counts = record["counts"]
        assert counts.get("gradient_all_reduce", 0) == 0  # no DDP-style averaging on top of FSDP's reduce-scatter
        units = record["generation"]["units"]
        assert units == 3  # 2 decoder layers and the root (embeddings, norm, head)
        # Every backward reduce-scatters each unit's gradient: 2 micro-batches per step, no sync skipped.
        assert counts["reduce_scatter_single"] == 4 * 2 * units
        generation = record["generation"]
        assert generation["same_tokens"]
        assert generation["engine_gathers"] == units  # each unit once for the whole generation
        assert generation["plain_gathers"] >= GEN_TOKENS  # HF generate alone gathers the layers for every token
    single, norms = replay_one_process(tmp_path, random_model_dir, run / "rollouts", monkeypatch)
    assert_matches_one_process(run, single, norms, random_model_dir)
    rows = _train_rows(run)
    assert [r["train/grad_norm"] for r in rows] == pytest.approx(
        [sum(norms[0:2]) / 2, sum(norms[2:4]) / 2], rel=1e-5
    )  # logged per iteration: the mean of its steps' norms


def test_fsdp2_rejects_lora_in_one_line(tmp_path, random_model_dir):
    command = fit_command(tmp_path, random_model_dir, "lora", "--model.init_args.lora.r=4", "--trainer.devices=1")
    env = {"PYTHONPATH": str(ROOT / "tests"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ValueError: model.lora.r=4 with trainer.strategy FSDP2: FSDP2 here shards full fine-tuning only" in (
        result.stderr
    )


def plain_fit_command(tmp_path: Path, model_dir: str, run_name: str, *extra: str) -> list[str]:
    command = fit_command(tmp_path, model_dir, run_name, "--trainer.devices=2", *extra)
    return [part for part in command if part != "--model.class_path=test_fsdp.RecordingFSDP"]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_resume_continues_exactly(tmp_path, random_model_dir):
    # A run stopped after 2 of 3 iterations and resumed from its last.ckpt (gathered on rank zero, loaded into the
    # shards) ends as the run that was never stopped: the same metrics every iteration and the same final weights.
    three = "--model.init_args.iterations=3"
    run_processes(
        [
            (plain_fit_command(tmp_path, random_model_dir, "straight", three), {}),
            (plain_fit_command(tmp_path, random_model_dir, "stopped", "--model.init_args.iterations=2"), {}),
        ]
    )
    run_processes([(plain_fit_command(tmp_path, random_model_dir, "stopped", three, "--ckpt_path=last"), {})])
    straight, resumed = tmp_path / "straight", tmp_path / "stopped"

    def rows(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in _train_rows(run)]

    assert [r["step"] for r in rows(resumed)] == [1.0, 2.0, 3.0]
    assert rows(resumed) == rows(straight)
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    ends = [AutoModelForCausalLM.from_pretrained(run / "final").state_dict() for run in (straight, resumed)]
    for name, weight in ends[0].items():
        assert (weight - initial[name]).abs().max() > 1e-4, name
        torch.testing.assert_close(ends[1][name], weight, atol=0, rtol=0)
