"""JSON tool calls on the real Qwen2.5-Coder-0.5B-Instruct (`make test-qwen`): the model calls the calculator from
Qwen2.5's own tool block, its episodes are the template's rendering of what it sampled, a JSON tool run stopped and
resumed equals one never stopped, and two DDP ranks run their own episodes and end with equal weights."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SUBPROCESS_ENV, fit, prepared_model
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_pg.data.tasks import CalcArithTask, Example
from llm_pg.engines.episodes import KINDS, run_episodes
from llm_pg.engines.hf import HFEngine
from llm_pg.models.chat import task_tool_schemas
from llm_pg.models.generation import Sampling, eos_token_ids
from llm_pg.modules import GRPOModule

pytestmark = [pytest.mark.real, pytest.mark.qwen]

CONFIG = "configs/qwen_cpu/calc_tools_grpo.yaml"
SHORT = [  # 2 prompts x 4 episodes of at most 64 tokens, LoRA as the config has it
    "--model.init_args.max_new_tokens=64",
    "--model.init_args.minibatch_size=4",
    "--model.init_args.grad_accum_steps=2",
    "--model.init_args.speed.logprob_batch_size=8",
    "--model.init_args.evaluation.generate_batch_size=4",
    "--torch_threads=2",
]


@pytest.fixture(scope="module")
def qwen():
    return prepared_model("qwen2.5-coder-0.5b-instruct")


def test_qwen_calls_the_calculator_and_its_episodes_are_the_templates_rendering(qwen):
    tokenizer = AutoTokenizer.from_pretrained(qwen)
    model = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.float32)
    task = CalcArithTask(call_format="json", max_turns=2)
    examples = [Example("37*48=?", "1776"), Example("53*56=?", "2968")]
    eos = eos_token_ids(model, tokenizer)
    out = run_episodes(
        HFEngine(model, tokenizer), tokenizer, task, examples, Sampling(max_new_tokens=96, greedy=True), eos=eos
    )
    assert out.tool_calls.tolist() == [1, 1]  # both call the calculator from the tools= block, greedily
    assert [call[0]["name"] for call in out.calls] == ["calculator", "calculator"]
    assert out.calls[0][0]["arguments"] == {"expression": "37*48"} and out.calls[0][0]["observation"] == "1776"
    assert int(out.tool_error_kinds.sum()) == 0 and out.tool_error_kinds.shape == (2, len(KINDS))
    schemas = list(task_tool_schemas(task).values())
    for r, example in enumerate(examples):
        messages = task.messages(example)
        for k, turn in enumerate(out.transcripts[r].split("<|im_start|>assistant\n")):
            text = turn.split("<|im_end|>")[0]
            messages.append({"role": "assistant", "content": text})
            messages += [{"role": "tool", "content": c["observation"]} for c in out.calls[r] if c["turn"] == k + 1]
        whole = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
        prompt = tokenizer.decode(out.prompt_ids[r][out.prompt_mask[r].bool()])
        assert whole.startswith(prompt + out.transcripts[r])  # the ids decode to the template's own rendering
        assert "# Tools" in prompt and '"name": "calculator"' in prompt


def test_a_json_tool_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path, qwen):
    from test_run_safety import generations, rows

    from llm_pg.cli.fit import RunInterrupted

    common = [*SHORT, "--model.init_args.iterations=3", "--checkpoint.every_n_iterations=10"]
    straight = fit(tmp_path / "straight", qwen, *common, config=CONFIG).model
    stop = "--trainer.callbacks+={'class_path': 'test_run_safety.SendSignal', 'init_args': {'signum': 15}}"
    with pytest.raises(RunInterrupted):
        fit(tmp_path / "b", qwen, *common, stop, config=CONFIG)
    resumed = fit(tmp_path / "b", qwen, *common, "--ckpt_path=last", config=CONFIG).model
    trained = [name for name, p in straight.policy.named_parameters() if p.requires_grad]
    after = dict(resumed.policy.named_parameters())
    for name, weight in straight.policy.named_parameters():
        if weight.requires_grad:
            assert torch.equal(weight, after[name]), name
    assert trained  # the adapter
    run, reference = tmp_path / "b" / "run", tmp_path / "straight" / "run"
    assert rows(run) == rows(reference)
    assert generations(run) == generations(reference)
    logged = generations(reference)
    assert any(row["tool_calls"] > 0 for row in logged) and any(row["calls"] for row in logged)
    train = [row for row in rows(reference) if "train/tool_calls" in row]
    assert len(train) == 3 and all(f"train/tool_errors_{kind}" in train[0] for kind in KINDS)


class AdapterRecorder(Callback):
    """Each rank's trainable weights at the end, and how many tool calls its rollouts made."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        calls = int(batch.rollout.rows.tool_calls.sum())
        out = Path(trainer.default_root_dir) / f"calls_iter{batch.index}_rank{trainer.global_rank}.txt"
        out.write_text(str(calls))

    def on_train_end(self, trainer, module) -> None:
        weights = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
        torch.save(weights, Path(trainer.default_root_dir) / f"adapter_rank{trainer.global_rank}.pt")


class RecordingGRPO(GRPOModule):
    def configure_callbacks(self):
        callbacks = super().configure_callbacks()
        return [callbacks[0], AdapterRecorder(), *callbacks[1:]]


@pytest.mark.distributed
def test_json_tool_episodes_under_ddp_keep_the_ranks_in_step(tmp_path, qwen):
    command = [
        sys.executable, "-m", "llm_pg.cli.fit", "fit",
        f"--config={ROOT / CONFIG}",
        "--model.class_path=test_qwen_tools.RecordingGRPO",
        f"--model.init_args.model_name_or_path={qwen}",
        f"--runs_root={tmp_path}", "--run_name=ddp",
        "--data.prompts_per_step=1", "--model.init_args.group_size=4", "--model.init_args.iterations=2",
        "--model.init_args.evaluation.every=100", "--data.task.init_args.eval_size=3",
        "--trainer.devices=2", "--trainer.strategy=ddp", "--wandb_project=null", "--trainer.enable_progress_bar=false",
        *SHORT[:-1], "--torch_threads=1",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "ddp"
    weights = [torch.load(run / f"adapter_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name
    calls = [int((run / f"calls_iter{i}_rank{r}.txt").read_text()) for i in (0, 1) for r in (0, 1)]
    assert sum(calls) > 0  # each rank ran its own episodes, and they called the tool
    assert len((run / "eval" / "iter_00000.jsonl").read_text().splitlines()) == 3  # the eval's episodes, sharded
