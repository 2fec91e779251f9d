"""The reserved KV cache of HF sampling (`llm_pg.models.decoding.ReservedLayer`): the keys and values of transformers'
concatenating `DynamicLayer`, written in place into buffers allocated once, so sampling draws the same tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

import llm_pg.models.generation as generation
from llm_pg.models.decoding import ReservedLayer
from llm_pg.models.generation import Sampling, generate
from llm_pg.models.loading import load_tokenizer

PROMPTS = ["Say 1", "Say digits, as many as you can: 0123456789", "Digits?"]  # three lengths: left padding


def _states(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=g), torch.randn(rows, 2, length, 4, generator=g)


def test_updates_hold_what_concatenation_holds_through_growth_crop_and_batch_changes():
    plain, reserved = DynamicLayer(), ReservedLayer(reserve=2)
    allocations = []
    original = reserved._reallocate
    reserved._reallocate = lambda *a: allocations.append(a[0]) or original(*a)

    def both(apply) -> None:
        apply(plain)
        apply(reserved)

    def check() -> None:
        assert torch.equal(plain.keys, reserved.keys) and torch.equal(plain.values, reserved.values)
        assert reserved.get_seq_length() == plain.get_seq_length()

    for step, length in enumerate([5, 1, 1, 1, 3, 1]):  # a prefill, decode steps, a chunk that outgrows the room
        keys, values = _states(3, length, seed=step)
        out_plain, out_reserved = plain.update(keys, values), reserved.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(out_plain, out_reserved, strict=True))
        check()
    assert allocations == [0, 7]  # once at the prefill, then only when the room ran out (5+1+1 held, 1 more)
    both(lambda layer: layer.crop(-2))  # replaces keys/values: the next update copies them into new buffers
    both(lambda layer: layer.update(*_states(3, 1, seed=10)))
    check()
    assert allocations == [0, 7, 10]
    both(lambda layer: layer.batch_repeat_interleave(2))  # [3, ...] -> [6, ...]
    both(lambda layer: layer.update(*_states(6, 1, seed=11)))
    check()
    both(lambda layer: layer.batch_select_indices(torch.tensor([0, 5])))
    both(lambda layer: layer.update(*_states(2, 2, seed=12)))
    check()


@pytest.fixture(params=["llama", "qwen2"])
def model_and_tokenizer(request, random_model_dir, qwen_model_dir):
    path = random_model_dir if request.param == "llama" else qwen_model_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("share_prompt", [True, False])
def test_sampling_with_the_reserved_cache_draws_the_tokens_of_the_concatenating_cache(
    model_and_tokenizer, monkeypatch, greedy, share_prompt
):
    model, tokenizer = model_and_tokenizer
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    settings = {"num_samples": 4, "seed": 5}
    sampling = Sampling(max_new_tokens=16, min_new_tokens=16, greedy=greedy)
    updates = []
    original_update = ReservedLayer.update
    monkeypatch.setattr(
        ReservedLayer, "update", lambda self, *a, **k: updates.append(1) or original_update(self, *a, **k)
    )
    reserved = generate(model, tokenizer, conversations, sampling, share_prompt=share_prompt, **settings)
    layers = model.config.num_hidden_layers
    assert len(updates) >= layers * 16  # every layer's cache was a reserved one, at every decoded token
    monkeypatch.setattr(generation, "reserved_cache", lambda model, cache, max_new_tokens: cache)
    plain = generate(model, tokenizer, conversations, sampling, share_prompt=share_prompt, **settings)
    assert torch.equal(reserved.completion_ids, plain.completion_ids) and reserved.texts == plain.texts
    assert greedy or len(set(plain.texts)) > 1  # sampling drew different completions


def test_decoding_allocates_each_layer_once(random_model_dir, monkeypatch):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(random_model_dir), load_tokenizer(random_model_dir)
    allocations = []
    original = ReservedLayer._reallocate
    monkeypatch.setattr(ReservedLayer, "_reallocate", lambda self, *a: allocations.append(1) or original(self, *a))
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    generate(model, tokenizer, conversations, Sampling(max_new_tokens=24, min_new_tokens=24), num_samples=4, seed=0)
    assert len(allocations) == model.config.num_hidden_layers  # the shared prefill adopted once, no growth after
