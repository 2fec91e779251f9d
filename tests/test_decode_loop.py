"""The HF engine's decode loop (`llm_pg.models.decoding.decode`): rows that have ended leave the batch, and every
row draws the tokens HF `generate` draws from the same seed."""

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm_pg.models.decoding import decode, kept_rows, reserved_cache
from llm_pg.models.generation import (
    Sampling,
    encode_prompts,
    eos_token_ids,
    hf_generate,
    prompt_cache,
    unused_token_ids,
)
from llm_pg.models.loading import load_tokenizer

PROMPTS = ["Say 1", "Say digits, as many as you can: 0123456789", "Digits?"]  # three lengths: left padding
SAMPLES = 6  # rows per prompt: 18 rows, so an eighth of the batch is 3 rows
DRAWS = {
    "greedy": Sampling(max_new_tokens=24, min_new_tokens=2, greedy=True),
    "nucleus": Sampling(max_new_tokens=24, min_new_tokens=2, temperature=0.8, top_p=0.9),
    "multinomial": Sampling(max_new_tokens=24, min_new_tokens=2, temperature=0.7),
}


@pytest.fixture(params=["llama", "qwen2"])
def model_and_tokenizer(request, eos_model_dir, qwen_model_dir):
    """The random Llama whose EOS is likely (completions of many lengths), and the random Qwen2 (pad apart from EOS,
    head rows past the tokenizer)."""
    path = eos_model_dir if request.param == "llama" else qwen_model_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), load_tokenizer(path)


def _sample_both(model, tokenizer, sampling: Sampling, share_prompt: bool, seed: int = 3):
    """(ours `[N, C]`, HF generate's `[N, C]`, the batch size of each of our forwards) from the same seed and the
    same starting cache."""
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS])
    ids = encoded["input_ids"].repeat_interleave(SAMPLES, 0)
    mask = encoded["attention_mask"].repeat_interleave(SAMPLES, 0)
    eos, unused = eos_token_ids(model, tokenizer), unused_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id

    def cache():
        return reserved_cache(model, prompt_cache(model, encoded, SAMPLES) if share_prompt else None, 24)

    rows = []
    with torch.no_grad():
        ours_cache, hf_cache = cache(), cache()
        hook = model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]), with_kwargs=True)
        torch.manual_seed(seed)
        ours = decode(model, ids, mask, ours_cache, sampling, eos, pad, unused)
        hook.remove()
        torch.manual_seed(seed)
        hf = hf_generate(model, ids, mask, sampling, eos, pad, unused, cache=hf_cache)
    return ours, hf, rows


@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("share_prompt", [True, False])
def test_each_row_draws_hf_generates_tokens_while_ended_rows_leave_the_batch(model_and_tokenizer, draw, share_prompt):
    model, tokenizer = model_and_tokenizer
    ours, hf, rows = _sample_both(model, tokenizer, DRAWS[draw], share_prompt)
    assert torch.equal(ours, hf)
    if model.config.model_type == "llama" and draw != "greedy":
        eos = eos_token_ids(model, tokenizer)
        lengths = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in ours.tolist()]
        assert len(set(lengths)) >= 5 and min(lengths) >= 3  # many lengths; EOS blocked for the first 2 tokens
        assert rows[0] == len(ours) and rows[-1] < len(ours) / 2  # the last steps ran on the rows still going
        assert rows == sorted(rows, reverse=True) and min(rows) >= 2  # never one row: see kept_rows
        # each step that shrank the batch dropped at least an eighth of it
        assert all(b * 8 <= a * 7 for a, b in itertools.pairwise(rows) if b < a)


def test_a_seed_draws_the_same_tokens_and_another_seed_others(eos_model_dir):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(eos_model_dir).eval(), load_tokenizer(eos_model_dir)
    first, _, _ = _sample_both(model, tokenizer, DRAWS["multinomial"], True, seed=3)
    again, _, _ = _sample_both(model, tokenizer, DRAWS["multinomial"], True, seed=3)
    other, _, _ = _sample_both(model, tokenizer, DRAWS["multinomial"], True, seed=4)
    assert torch.equal(first, again) and not torch.equal(first[:, :3], other[:, :3])


def test_the_output_is_as_long_as_the_longest_row_and_pads_after_each_eos(eos_model_dir):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(eos_model_dir).eval(), load_tokenizer(eos_model_dir)
    ours, _, _ = _sample_both(model, tokenizer, DRAWS["nucleus"], False)
    eos, pad = eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    ended = [next((i for i, t in enumerate(row) if t in eos), None) for row in ours.tolist()]
    assert ours.shape[1] == max(24 if end is None else end + 1 for end in ended)
    for row, end in zip(ours.tolist(), ended, strict=True):
        if end is not None:
            assert all(t == pad for t in row[end + 1 :])


def test_compaction_keeps_the_running_rows_and_an_ended_one_beside_a_last_running_row():
    assert kept_rows(torch.tensor([True, False, True, True, False])).tolist() == [0, 2, 3]
    assert kept_rows(torch.tensor([False, False, True, False])).tolist() == [0, 2]  # a compiled step: not 1 row
    assert kept_rows(torch.tensor([True])).tolist() == [0]
