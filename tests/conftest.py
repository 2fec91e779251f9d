"""Shared fixtures: a random two-layer model with the tiny tokenizer, and a helper that runs `llm-pg fit`."""

import os
from pathlib import Path

import pytest
import torch

# No network, no W&B, quiet tokenizers: set before anything imports transformers or wandb.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


def make_random_llama(out: Path, hidden_size: int = 32) -> str:
    """Save a randomly initialised 2-layer, 2-head Llama with the tiny byte tokenizer into `out`."""
    from transformers import LlamaForCausalLM

    from llm_pg.tiny.pretrain import tiny_config
    from llm_pg.tiny.tokenizer import ENDOFTEXT, IM_END, build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tokenizer, hidden_size=hidden_size, num_layers=2, num_heads=2))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """A randomly initialised 2-layer Llama (hidden 32) with the tiny byte tokenizer: fast, and its
    samples are varied, so rewards differ within groups only by chance."""
    return make_random_llama(tmp_path_factory.mktemp("random-tiny"))


def prepared_model(name: str) -> str:
    """A model `llm-pg real-model NAME` prepared. Skips without it, unless LLM_PG_REQUIRE_REAL=1 (as `make test-real`,
    `make test-qwen` and `make test-vllm` set it): then a missing model fails instead of passing silently."""
    from llm_pg.models import real_model

    try:
        return str(real_model.prepared_dir(name))
    except real_model.RealModelMissing as err:
        if os.environ.get("LLM_PG_REQUIRE_REAL") == "1":
            pytest.fail(str(err))
        pytest.skip(f"{name} is not prepared (`{real_model.MODELS[name].command}`)")


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """SmolLM2-135M-Instruct as `make real-model` prepared it."""
    return prepared_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 with Qwen2.5-Math-Instruct's tokenizer, chat template and generation config
    (`tests/make_qwen_fixture.py`): what the real configs load, without a download."""
    from make_qwen_fixture import make_qwen_fixture

    return make_qwen_fixture(tmp_path_factory.mktemp("qwen-fixture"))


SMALL = [  # 2 prompts x 4 completions, 2 micro-batches of 2 per step, short completions
    "--data.prompts_per_step=2",
    "--model.init_args.group_size=4",
    "--model.init_args.minibatch_size=2",
    "--model.init_args.grad_accum_steps=2",
    "--model.init_args.max_new_tokens=8",
    "--model.init_args.evaluation.every=100",
    "--model.init_args.log_generations.every=1",
    "--data.task.init_args.eval_size=4",
    "--wandb_project=null",
    "--trainer.enable_progress_bar=false",
    # Test tasks are user code (not llm_pg's): score them in-process, as llm_pg's own tasks are, without spawning
    # reward workers for every fit; tests/test_user_modules.py runs the workers themselves.
    "--data.reward_workers=0",
]


@pytest.fixture(scope="session")
def eos_model_dir(random_model_dir, tmp_path_factory) -> str:
    """The random model with its EOS logits raised (P(EOS) about 0.2 per token), so completion lengths vary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.randint(0, 250, (8, 20))).last_hidden_state.mean((0, 1))  # [H]
        model.lm_head.weight[model.generation_config.eos_token_id] += 2.0 * hidden / hidden.norm() ** 2
    out = tmp_path_factory.mktemp("eos-tiny")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(random_model_dir).save_pretrained(out)
    return str(out)


# The environment of a test's `llm-pg fit` subprocess (DDP, FSDP2, two nodes): the test modules importable, offline.
SUBPROCESS_ENV = {
    "PYTHONPATH": str(ROOT / "tests"),
    "PATH": "/usr/bin:/bin",
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


def fit(tmp_path: Path, model_dir: str, *overrides: str, config: str = "configs/tiny/format_copy_grpo.yaml"):
    """Run `llm-pg fit` in-process on `model_dir` with small settings; returns the LightningCLI object."""
    from llm_pg.cli.fit import run_cli

    args = [
        "fit",
        f"--config={ROOT / config}",
        f"--model.init_args.model_name_or_path={model_dir}",
        f"--runs_root={tmp_path}",
        "--run_name=run",
        *SMALL,
        *overrides,
    ]
    return run_cli(args)


from llm_pg.data.tasks.base import Example, Score, Task  # noqa: E402


def stand_in_trainer(task: Task, examples: list[Example]):
    """A trainer for calling `RolloutCallback.on_train_batch_start` directly: one process, and a data stream whose
    next batch (position 0) is `examples`."""
    from types import SimpleNamespace

    from llm_pg.data.batches import PromptBatch

    stream = SimpleNamespace(task=task, next_batch=0, prompt_batch=lambda position: PromptBatch(position, examples))
    return SimpleNamespace(datamodule=stream, global_rank=0, world_size=1)


class DigitTask(Task):
    """A test task a random model earns varied rewards on: the share of digit characters in the completion."""

    name = "digits"
    components = ("digits",)

    def train_example(self, index: int, seed: int) -> Example:
        return Example(prompt=f"Say digits {seed}:{index}", answer="")

    def build_eval_set(self) -> list[Example]:
        return [Example(prompt=f"Say digits {i}", answer="") for i in range(self.eval_size)]

    def score(self, completion: str, example: Example) -> Score:
        share = sum(c.isdigit() for c in completion) / max(len(completion), 1)
        return Score(total=share, correct=share > 0.5, components={"digits": share})
