"""The tiny chat model: tokenizer, demonstrations, pretraining script, committed checkpoint and its metrics."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from llm_pg.assets import TINY_CHAT_DIR
from llm_pg.data.tasks import ArithTask, Example, FormatCopyTask
from llm_pg.models.generation import Sampling, generate
from llm_pg.tiny.demonstrations import demonstration, demonstration_rng, ideal_completion
from llm_pg.tiny.evaluate import evaluate_base, pass_at_k, target_failures, tiny_tasks
from llm_pg.tiny.pretrain import main as pretrain_main
from llm_pg.tiny.pretrain import make_batch, tiny_config
from llm_pg.tiny.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

TEXTS = ["", "Copy: -999", "héllo wörld", "数学 🙂 ∑x²", "tab\tnew\nline\r\x00\x7f", "<answer>7</answer>", " " * 5]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny matrices: one thread is nearly as fast as two, and far faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_any_text_one_token_per_byte(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte b is token b: no merges, no normalisation
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_after_the_bytes(tokenizer):
    assert len(tokenizer) == 260
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "<|pad|>", "left")
    ids = tokenizer("<|im_start|>user\nhi<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids == [258, *b"user\nhi", 259, 256]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_has_qwen_chatml_shape(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Copy: -5"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCopy: -5<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nCopy: -5<|im_end|>\n"  # no default system turn, unlike Qwen


def _assert_same_tokenizer(reloaded, tokenizer):
    assert type(reloaded) is type(tokenizer)
    text = "Copy: -12 ü 🙂<|im_start|>x<|im_end|><|pad|><|endoftext|>"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template == CHAT_TEMPLATE
    assert reloaded.get_added_vocab() == tokenizer.get_added_vocab()
    assert (reloaded.eos_token_id, reloaded.pad_token_id, reloaded.padding_side) == (259, 257, "left")
    batch = reloaded(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][:2] == [257, 257]  # left padding


def test_auto_tokenizer_reloads_exactly_next_to_a_llama_config(tokenizer, tmp_path):
    LlamaForCausalLM(tiny_config(tokenizer, hidden_size=16, num_layers=1, num_heads=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(tmp_path), tokenizer)


def test_committed_tokenizer_is_the_built_one(tokenizer):
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(TINY_CHAT_DIR), tokenizer)


def test_committed_checkpoint_loads_and_generates():
    size = sum(path.stat().st_size for path in TINY_CHAT_DIR.iterdir())
    assert size < 20 * 2**20
    model = AutoModelForCausalLM.from_pretrained(TINY_CHAT_DIR)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHAT_DIR)
    assert set(model.generation_config.eos_token_id) == {256, 259}
    out = generate(
        model, tokenizer, [[{"role": "user", "content": "Copy: 123"}]], Sampling(greedy=True, max_new_tokens=24)
    )
    assert out.texts == ["<answer>123</answer>"]


@pytest.mark.parametrize("task", [FormatCopyTask(low=-999, high=999, system_prompt=None), ArithTask()])
def test_ideal_completion_earns_the_most_reward(task):
    example = task.train_example(0, seed=0)
    best = task.score(ideal_completion(task.name, example), example)
    noisy = [task.score(demonstration(task.name, example, random.Random(i)), example) for i in range(200)]
    assert best.correct and all(score.total <= best.total for score in noisy)
    assert any(score.total < best.total for score in noisy)


def test_demonstrations_are_seeded_and_noisy_as_documented():
    copy_task = tiny_tasks()["format_copy"]
    negative = Example(prompt="Copy: -42", answer="-42")
    drawn = [demonstration("format_copy", negative, demonstration_rng(0, "format_copy", i)) for i in range(4000)]
    assert drawn[:50] == [
        demonstration("format_copy", negative, demonstration_rng(0, "format_copy", i)) for i in range(50)
    ]
    signed = sum(copy_task.score(d, negative).correct for d in drawn) / len(drawn)
    assert 0.28 < signed < 0.38  # the sign survives in 35 % minus the few format slips
    product = Example(prompt="6*7=?", answer="42")
    arith = tiny_tasks()["arith"]
    drawn = [demonstration("arith", product, random.Random(i)) for i in range(4000)]
    assert 0.41 < sum(arith.score(d, product).correct for d in drawn) / len(drawn) < 0.49
    assert 0.12 < drawn.count("\\boxed{13}") / len(drawn) < 0.18  # a+b for a*b


def test_pretraining_batch_is_prompt_then_demonstration_with_loss_on_the_demonstration(tokenizer):
    task = tiny_tasks()["arith"]
    batch = make_batch(tokenizer, task, start=24, count=8, seed=0)
    for index, ids, labels in zip(range(24, 32), batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True):
        example = task.train_example(index, 0)
        prompt = tokenizer.apply_chat_template(task.messages(example), tokenize=False, add_generation_prompt=True)
        completion = demonstration(task.name, example, demonstration_rng(0, task.name, index)) + "<|im_end|>"
        prompt_ids, completion_ids = tokenizer(prompt)["input_ids"], tokenizer(completion)["input_ids"]
        padding = len(ids) - len(prompt_ids) - len(completion_ids)
        assert ids == prompt_ids + completion_ids + [tokenizer.pad_token_id] * padding
        assert labels == [-100] * len(prompt_ids) + completion_ids + [-100] * padding


def test_pretraining_few_steps_lowers_the_loss(tokenizer, tmp_path):
    small = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--batch-size", "32", "--seed", "0"]
    rc = pretrain_main([*small, "--steps", "40", "--warmup-steps", "5", "--lr", "1e-2", "--eval-every", "0",
                        "--out", str(tmp_path / "m"), "--minutes", "1"])  # fmt: skip
    assert rc == 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    initial = LlamaForCausalLM(tiny_config(tokenizer, hidden_size=32, num_layers=2, num_heads=2))
    batches = [make_batch(tokenizer, task, start=10_000, count=32, seed=1) for task in tiny_tasks().values()]
    with torch.no_grad():
        before = sum(initial(**b).loss.item() for b in batches)
        after = sum(trained(**b).loss.item() for b in batches)
    assert after < 0.5 * before, (before, after)


def test_pretraining_stops_at_the_time_budget(tmp_path):
    small = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--batch-size", "8", "--eval-every", "0"]
    start = time.monotonic()
    assert pretrain_main([*small, "--steps", "1000000", "--minutes", "0.001", "--out", str(tmp_path)]) == 0
    assert time.monotonic() - start < 20
    assert (tmp_path / "model.safetensors").exists()


def test_pass_at_k_matches_hand_counts():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # both draws from the 2 wrong ones: 1 of C(4,2)=6 pairs


@pytest.mark.slow
def test_committed_checkpoint_meets_the_base_policy_targets():
    model = AutoModelForCausalLM.from_pretrained(TINY_CHAT_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHAT_DIR)
    metrics = evaluate_base(model, tokenizer)
    assert target_failures(metrics) == []
    assert (
        metrics["format_copy"]["greedy_exact_match_pos"] > 0.9 > 0.2 > metrics["format_copy"]["greedy_exact_match_neg"]
    )
