"""The packed forward (`llm_pg.modules.packing`): the rows' real tokens concatenated under a block-diagonal causal
mask give the padded forward's log-probs, entropy and gradients to float rounding, with and without prefix sharing,
under SDPA and eager attention, with LoRA. On SmolLM2 and the Qwen, tests/test_real_model.py compares the packed path
(`HEADS["packed"]`) with each row's plain forward."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_prefix_sharing import grouped_rollout
from transformers import AutoModelForCausalLM

from llm_pg.models.loading import load_tokenizer
from llm_pg.modules import packing
from llm_pg.modules.logprobs import LogProbs, distinct_prompts
from llm_pg.modules.packing import kept_tokens, pack_rows, packed_mask


@pytest.fixture(autouse=True)
def always_pack(monkeypatch):
    """These rollouts waste 12-30 % of their positions: pack them whatever `LogProbs.packs` would say."""
    monkeypatch.setattr(packing, "MIN_PADDING", 0.0)


def log_probs(model, pack: bool, share: bool, chunk_size: int = 5) -> LogProbs:
    return LogProbs(model, None, False, 1.0, chunk_size, share, True, 64, pack=pack)


def logp_and_gradient(model, rollout, pack: bool, share: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked log-probs `[N, C]`, masked entropy and the flat gradient of a weighted log-prob sum."""
    model.zero_grad()
    mask = rollout.completion_mask
    logp, entropy = log_probs(model, pack, share)(model, rollout, with_entropy=True)
    (logp * mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return logp.detach() * mask, entropy * mask, grad


def assert_packed_equals_padded(model, tokenizer, share: bool) -> None:
    model.train()
    rollout = grouped_rollout(model, tokenizer)
    padded = logp_and_gradient(model, rollout, pack=False, share=share)
    packed = logp_and_gradient(model, rollout, pack=True, share=share)
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed[1], padded[1], rtol=1e-5, atol=1e-4)
    assert float(padded[0].abs().sum()) > 1.0 and padded[2].norm() > 1e-3  # values that mean something
    assert float((packed[2] - padded[2]).norm() / padded[2].norm()) < 1e-5


@pytest.fixture(params=["llama-sdpa", "qwen2-sdpa", "qwen2-eager", "qwen2-lora"])
def policy(request, random_model_dir, qwen_model_dir):
    arch, variant = request.param.split("-")
    path = random_model_dir if arch == "llama" else qwen_model_dir
    attention = "eager" if variant == "eager" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    if variant == "lora":
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(model, config)
    return model, load_tokenizer(path)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "whole-rows"])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_forward(policy, share):
    # Three prompts of different lengths (left padding) x 4 rows whose completions end at 2, 4, 6 and 7 tokens.
    model, tokenizer = policy
    assert_packed_equals_padded(model, tokenizer, share)


def test_packing_keeps_only_tokens_that_are_context_or_score_something():
    # Row 0: 2 prompt tokens (1 pad) and 3 completion tokens; row 1: 3 prompt tokens and 1 completion token.
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    ids = torch.arange(12).view(2, 6)
    keep = kept_tokens(mask, start=3)  # the completions from column 3, each row's last real token left out
    assert keep.tolist() == [[False] * 3 + [True, True, False], [False] * 6]
    whole = kept_tokens(mask, start=0)
    assert whole.tolist() == [[False, True, True, True, True, False], [True, True, True, False, False, False]]
    packed = pack_rows(ids, mask, whole, budget=4)  # 4 + 3 tokens: two sequences of width 4
    assert packed.ids.tolist() == [[1, 2, 3, 4], [6, 7, 8, 0]]
    assert packed.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]  # row 0's left pad takes no position
    assert packed.owner.tolist() == [[0, 0, 0, 0], [1, 1, 1, -1]]
    assert packed.slot.tolist() == [0, 1, 2, 3, 4, 5, 6]
    allowed = packed_mask(packed)[:, 0]  # [k, S, S]
    assert allowed[0].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    # The second sequence: row 1's three tokens causally, the padding slot only itself (no fully masked query).
    assert allowed[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


def test_a_packed_token_sees_only_its_own_prompts_real_tokens():
    # Two distinct prompts of width 3 (the second left-padded by one); rows 0 and 1 answer prompt 0, row 2 prompt 1.
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    packed = pack_rows(torch.zeros(3, 6, dtype=torch.long), mask, kept_tokens(mask, start=3))
    inverse = torch.tensor([0, 0, 1])
    allowed = packed_mask(packed, (inverse, mask[[0, 2], :3]))[0, 0]  # [S, 6 + S]
    assert packed.owner.tolist() == [[0, 0, 1, 2, 2]]
    prompt_keys = allowed[:, :6].int().tolist()
    assert prompt_keys == [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 0, 1, 1]] * 2
    assert allowed[:, 6:].int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]
    ]  # fmt: skip


def test_rows_longer_than_the_budget_get_a_sequence_of_their_own(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    rollout = grouped_rollout(model, load_tokenizer(random_model_dir))
    keep = kept_tokens(rollout.attention_mask, 0)
    packed = pack_rows(rollout.input_ids, rollout.attention_mask, keep, budget=8)
    longest = int(keep.sum(1).max())
    assert longest > 8 and packed.ids.shape == (len(rollout), longest)  # every row alone, none cut
    assert torch.equal(packed.owner.max(1).values, torch.arange(len(rollout)))


def test_a_forward_packs_when_a_fifth_of_its_positions_is_padding(monkeypatch, random_model_dir):
    monkeypatch.setattr(packing, "MIN_PADDING", 0.2)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    rollout = grouped_rollout(model, load_tokenizer(random_model_dir))  # 12 rows of 3, 5, 7 and 7 real tokens
    width, prompt = rollout.completion_mask.shape[1], rollout.prompt_len
    per_row = rollout.attention_mask.sum(1)  # own prompts: rows moved left run 12 x the longest row's tokens
    assert 1 - int(per_row.sum()) / (12 * int(per_row.max())) >= 0.2 and LogProbs.packs(model, rollout, None)
    padding = 12 * width - 66  # shared: 3 prompts once, then 84 completion positions of which 66 are real
    assert padding / (3 * prompt + 12 * width) < 0.2 and not LogProbs.packs(model, rollout, 3)


def test_only_sdpa_and_eager_attention_pack(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    rollout = grouped_rollout(model, load_tokenizer(random_model_dir))
    assert LogProbs.packs(model, rollout, None)
    model.config._attn_implementation = "flash_attention_2"  # a mask it would not read: the padded forward runs
    assert not LogProbs.packs(model, rollout, None)


def test_the_packed_forward_touches_only_real_tokens(qwen_model_dir):
    # The decoder's positions with prefix sharing: the prompts once (u x P), then every completion token but each
    # row's last, in one sequence, against u x P + N x C today.
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    seen = []
    model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    with torch.no_grad():
        log_probs(model, pack=True, share=True)(model, rollout)
    unique = len(distinct_prompts(rollout)[0])
    real = int(rollout.attention_mask[:, rollout.prompt_len :].sum())
    assert seen == [unique * rollout.prompt_len, real - len(rollout)]
