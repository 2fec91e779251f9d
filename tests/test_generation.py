import torch
from transformers import AutoModelForCausalLM

from llm_pg.models.generation import Sampling, encode_prompts, generate
from llm_pg.models.loading import TINY_MODEL, load_tokenizer

PROMPTS = [[{"role": "user", "content": text}] for text in ["Copy: 7", "Copy: -123456", "12+7=?", "Copy: 999"]]


def _model(path):
    model = AutoModelForCausalLM.from_pretrained(path).double()  # float64: no argmax flips from padding noise
    return model, load_tokenizer(path)


def test_prompts_are_left_padded(random_model_dir):
    tokenizer = load_tokenizer(random_model_dir)
    encoded = encode_prompts(tokenizer, PROMPTS)
    mask = encoded["attention_mask"]
    assert (mask[:, -1] == 1).all()  # every prompt ends at the right edge
    assert mask.sum(1).tolist() == [
        len(tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"]) for p in PROMPTS
    ]


def test_batched_greedy_equals_one_by_one():
    model, tokenizer = _model(TINY_MODEL)  # the trained tiny model: prompts lead to different completions
    batched = generate(model, tokenizer, PROMPTS, Sampling(greedy=True, max_new_tokens=12)).texts
    single = [generate(model, tokenizer, [p], Sampling(greedy=True, max_new_tokens=12)).texts[0] for p in PROMPTS]
    assert batched == single
    assert len(set(batched)) > 1  # the prompts really lead to different completions


def test_sampling_is_seeded_and_group_contiguous(random_model_dir):
    model, tokenizer = _model(random_model_dir)
    before = torch.random.get_rng_state()
    a = generate(model, tokenizer, PROMPTS[:2], Sampling(max_new_tokens=8), num_samples=3, seed=5)
    b = generate(model, tokenizer, PROMPTS[:2], Sampling(max_new_tokens=8), num_samples=3, seed=5)
    c = generate(model, tokenizer, PROMPTS[:2], Sampling(max_new_tokens=8), num_samples=3, seed=6)
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
    assert a.texts == b.texts and a.texts != c.texts
    assert a.completion_ids.shape[0] == 6
    # Rows 0-2 share prompt 0, rows 3-5 prompt 1.
    assert torch.equal(a.prompt_ids[0], a.prompt_ids[2]) and not torch.equal(a.prompt_ids[2], a.prompt_ids[3])
