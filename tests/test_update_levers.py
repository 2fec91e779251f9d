"""The update's speed levers (issue 22) are exact: the chunked LM head (`llm_pg.core.chunked_logprobs`), forwards over
rows packed to the left (`logprobs.packed_layout`) and length-sorted grouped passes (`update.forward_rows` by
length) give the plain path's log-probs, entropy, gradients and optimizer steps to float rounding.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_prefix_sharing import _train_rows, assert_moved, assert_trained_alike, grouped_rollout
from transformers import AutoModelForCausalLM

from llm_pg.core.chunked_logprobs import chunked_target_logprobs
from llm_pg.models.loading import load_tokenizer
from llm_pg.modules import update
from llm_pg.modules.logprobs import completion_hidden, completion_logits, packed_layout


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_log_softmax_of_the_full_logits(temperature):
    # 10 positions in chunks of 3 (the last chunk short), V = 50: value, entropy and both gradients against the
    # textbook log_softmax of one [10, V] logits tensor, with an upstream gradient that is not all ones.
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = (0.7 * torch.randn(50, 8)).requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    upstream = torch.randn(2, 5)
    logp, entropy = chunked_target_logprobs(hidden, weight, targets, temperature, chunk_size=3, with_entropy=True)
    (logp * upstream).sum().backward()
    got = logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    log_probs = torch.log_softmax(hidden @ weight.t() / temperature, -1)  # [2, 5, 50]
    expected_logp = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    (expected_logp * upstream).sum().backward()
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    for value, reference in zip(got, (expected_logp.detach(), expected_entropy, hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
    assert float(entropy.min()) > 0.1 and float(hidden.grad.abs().max()) > 1e-2  # values that mean something
    assert not entropy.requires_grad


def test_chunked_head_rejects_bad_settings():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_target_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), 1.0, 0)


@pytest.fixture(params=["plain", "lora"])
def qwen_policy(request, qwen_model_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)
    if request.param == "lora":
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(model, config)
    return model, load_tokenizer(qwen_model_dir)


def test_packed_hidden_states_through_the_chunked_head_equal_the_plain_logits(qwen_policy):
    # Three prompts of different lengths (left padding) and completions ending at 2, 4, 6 and 7 tokens: the packed
    # forward (real tokens moved left) gives the plain forward's log-probs and entropy, and the same gradient.
    model, tokenizer = qwen_policy
    model.train()
    rollout = grouped_rollout(model, tokenizer)
    ids, mask, index = packed_layout(rollout)
    assert ids.shape[1] == int(rollout.attention_mask.sum(1).max())  # the longest row: its full prompt and completion
    assert torch.equal(mask.sum(1), rollout.attention_mask.sum(1)) and bool((mask[:, :1] == 1).all())  # no left pad
    assert int(index[0, 0]) == int(rollout.attention_mask[0, : rollout.prompt_len].sum()) - 1
    mask_c = rollout.completion_mask
    weight = model.get_output_embeddings().weight
    grads = {}
    for name in ("plain", "chunked"):
        model.zero_grad()
        if name == "plain":
            logits = completion_logits(model, rollout, share_prefix=False)  # [N, C, V]
            log_probs = torch.log_softmax(logits, -1)
            logp = log_probs.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
        else:
            hidden = completion_hidden(model, rollout, share_prefix=False)
            logp, entropy = chunked_target_logprobs(hidden, weight, rollout.completion_ids, 1.0, 5, True)
        (logp * mask_c * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
        grads[name] = (logp.detach() * mask_c, entropy * mask_c)
        grads[name] += (torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]),)
    plain, chunked = grads["plain"], grads["chunked"]
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(chunked[1], plain[1], rtol=1e-5, atol=1e-4)
    assert plain[2].norm() > 1e-3
    assert float((chunked[2] - plain[2]).norm() / plain[2].norm()) < 1e-5


def test_length_sorted_forwards_take_rows_of_similar_length():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])  # 2, 4, 1, 3 real tokens
    rollout = type("Rows", (), {"attention_mask": mask, "__len__": lambda self: len(mask)})()
    assert [r.tolist() for r in update.forward_rows(rollout, 2, by_length=True)] == [[1, 3], [0, 2]]
    assert [r.tolist() for r in update.forward_rows(rollout, 2, by_length=False)] == [[0, 1], [2, 3]]


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["0", "4"])
def test_a_run_with_the_levers_trains_like_one_without(tmp_path, qwen_model_dir, lora):
    # The Qwen2 fixture under gradient checkpointing (sharing prompts in the training forward), KL 0.05, 2
    # prompts x 4 rows, micro-batches of 2 x accumulation 4 (one step per pass), three iterations: the chunked head,
    # packed forwards and length-sorted passes give the plain path's weights and logged statistics.
    from conftest import fit

    common = ["--model.init_args.iterations=3", "--model.init_args.grad_accum_steps=4"]
    common += ["--model.init_args.kl_coef=0.05", "--model.init_args.speed.gradient_checkpointing=true"]
    common += ["--data.task=test_variants.VariedTask", "--data.task.init_args.eval_size=4"]
    common += [
        f"--model.init_args.lora.r={lora}",
        "--model.init_args.lora.dropout=0.0",
        "--model.init_args.dtype=float32",
    ]
    old = ["--model.init_args.speed.logprob_chunk_size=0", "--model.init_args.speed.group_by_length=false"]
    new = ["--model.init_args.speed.logprob_chunk_size=7"]
    runs = {name: fit(tmp_path / name, qwen_model_dir, *common, *keys) for name, keys in (("old", old), ("new", new))}
    weights = {name: dict(cli.model.policy.named_parameters()) for name, cli in runs.items()}
    assert_moved(weights["old"], qwen_model_dir)  # three iterations of updates happened
    logged = {name: _train_rows(tmp_path / name / "run") for name in runs}
    assert logged["old"][-1]["train/kl"] > 1e-6
    keys = ("train/loss", "train/kl", "train/clip_fraction", "train/entropy", "train/grad_norm")
    assert_trained_alike(weights["new"], weights["old"], logged["new"], logged["old"], keys)


def test_chunked_head_under_bf16_autocast_matches_the_autocast_head():
    # As on a GPU with dtype bfloat16: the plain head's matmul runs in bf16 and its logits are upcast. The chunked
    # head gives the same log-probs and input gradient; its weight gradient sums float32 per-chunk partials where the
    # plain backward rounds one bf16 matmul, so they agree to bf16 rounding (2^-8 relative), not bit for bit.
    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = (0.5 * torch.randn(1000, 32)).requires_grad_()
    targets, upstream = torch.randint(0, 1000, (40,)), torch.randn(40)
    results = []
    for chunked in (False, True):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                logp = chunked_target_logprobs(hidden, weight, targets, 1.0, chunk_size=7)[0]
            else:
                logits = torch.nn.functional.linear(hidden, weight)  # [40, 1000] bf16
                logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), hidden.grad.clone(), weight.grad.clone()))
    (plain_logp, plain_hidden, plain_weight), (logp, grad_hidden, grad_weight) = results
    torch.testing.assert_close(logp, plain_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_hidden, plain_hidden, rtol=1e-5, atol=1e-5)
    assert float((grad_weight - plain_weight).norm() / plain_weight.norm()) < 2**-8


def test_share_prompt_dropout_lets_a_training_forward_with_dropout_share_prompts(qwen_model_dir):
    # LoRA dropout 0.3 in train mode: by default each row draws its own mask, so the training forward runs every
    # row's prompt; with share_prompt_dropout the prompt runs once per group (one mask per prompt), and under
    # reentrant gradient checkpointing it does not share. The no-grad eval-mode passes share either way.
    from llm_pg.modules.logprobs import prefix_sharing_in_graph, shares_prefix

    base = AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"]))
    model.train()
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    assert shares_prefix(model, rollout, enabled=True) is None
    assert not prefix_sharing_in_graph(model, True)
    first, _ = shares_prefix(model, rollout, enabled=True, shared_dropout=True)
    assert len(first) == 3 and prefix_sharing_in_graph(model, True, shared_dropout=True)
    seen = []
    decoder = model.get_base_model().get_decoder()
    decoder.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    completion_hidden(model, rollout, share_prefix=True, shared_dropout=True)
    assert seen == [3 * rollout.prompt_len, len(rollout) * (rollout.completion_mask.shape[1] - 1)]
    # Reentrant checkpointing runs each layer without a graph: keys leaving it through the cache would get no
    # gradient, so it does not share (non-reentrant checkpointing does: tests/test_prefix_checkpointing.py).
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert shares_prefix(model, rollout, enabled=True, shared_dropout=True) is None
