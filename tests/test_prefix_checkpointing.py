"""Prompt-prefix sharing in a training forward under gradient checkpointing (`llm_pg.modules.logprobs`, the cache
helpers of `llm_pg.models`): each distinct prompt runs once, and the backward's recompute of every checkpointed
layer sees the keys and values its forward saw, so log-probs and gradients are the plain forward's. It stays off
under reentrant checkpointing, and the layers' `_can_checkpoint_with_cache` is theirs again after each forward.
"""

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_prefix_sharing import _train_rows, assert_moved, assert_trained_alike, grouped_rollout
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from llm_pg.core.chunked_logprobs import chunked_target_logprobs
from llm_pg.models.cache import cache_survives_checkpointing, enable_activation_checkpointing
from llm_pg.models.loading import load_tokenizer
from llm_pg.modules import logprobs
from llm_pg.modules.logprobs import completion_hidden, completion_logits, prefix_sharing_in_graph, shares_prefix


def checkpointed_policy(path: str, lora: int, dropout: float = 0.0) -> torch.nn.Module:
    """The Qwen2 fixture under non-reentrant checkpointing as `load_policy` builds it, with a random LoRA adapter
    (`lora` > 0: its B is not zero, so the adapter changes the forward) on four projections."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    enable_activation_checkpointing(model)
    if lora:
        torch.manual_seed(0)
        targets = ["q_proj", "k_proj", "v_proj", "down_proj"]
        config = LoraConfig(r=lora, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(model, config)
        model.enable_input_require_grads()
    return model.train()


def checkpointed_layers(model: torch.nn.Module) -> list[GradientCheckpointingLayer]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointing_off(model: torch.nn.Module) -> None:
    """What `gradient_checkpointing_disable` does, under any transformers name: every flag off (the checkpoint
    function stays set)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False


def decoder_positions(model: torch.nn.Module) -> list[int]:
    """Token positions of each decoder call (rows x columns), the logits path's and the hidden path's alike."""
    seen = []
    decoder = logprobs._decoder_and_head(model)[0]
    decoder.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen


def logp_and_gradient(model, rollout, share: bool, path: str, shared_dropout: bool = False):
    """Completion log-probs `[N, C]` (masked) and the flat gradient of a weighted sum of them."""
    model.zero_grad()
    if path == "logits":
        logits = completion_logits(model, rollout, share_prefix=share, shared_dropout=shared_dropout)  # [N, C, V]
        logp = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    else:
        hidden = completion_hidden(model, rollout, share_prefix=share, shared_dropout=shared_dropout)  # [N, C, H]
        weight = logprobs._decoder_and_head(model)[1].weight
        logp = chunked_target_logprobs(hidden, weight, rollout.completion_ids, 1.0, 5)[0]
    mask = rollout.completion_mask
    (logp * mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return logp.detach() * mask, grad


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("lora", [0, 4])
def test_shared_prefix_under_checkpointing_gives_the_plain_logprobs_and_gradients(qwen_model_dir, lora, path):
    # 3 prompts x 4 rows, no dropout: the shared forward runs each prompt once (fewer positions than the plain
    # forward) and, through the recompute of every checkpointed layer, gives its log-probs and gradients.
    model = checkpointed_policy(qwen_model_dir, lora)
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    assert cache_survives_checkpointing(model) and shares_prefix(model, rollout, enabled=True) is not None
    positions = decoder_positions(model)
    plain_logp, plain_grad = logp_and_gradient(model, rollout, False, path)
    plain_positions = sum(positions)
    positions.clear()
    shared_logp, shared_grad = logp_and_gradient(model, rollout, True, path)
    n, prompt, width = len(rollout), rollout.prompt_len, rollout.completion_mask.shape[1]
    assert positions == [3 * prompt, n * (width - 1)]  # each prompt once, then every row's completion
    assert sum(positions) < plain_positions
    assert float(plain_logp.abs().max()) > 1.0  # log-probs that mean something
    torch.testing.assert_close(shared_logp, plain_logp, rtol=0, atol=1e-4)
    assert plain_grad.norm() > 1e-3
    assert float((shared_grad - plain_grad).norm() / plain_grad.norm()) < 1e-5


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_dropout_masks_are_redrawn_alike_by_the_recompute(qwen_model_dir, path):
    # LoRA dropout 0.3 with share_prompt_dropout: under checkpointing the backward recomputes every layer (prompt
    # pass and completion pass) with the RNG state of its forward, so the gradient equals that of the same shared
    # forward without checkpointing under the same seed. Another seed draws other masks: another gradient.
    model = checkpointed_policy(qwen_model_dir, lora=4, dropout=0.3)
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    assert shares_prefix(model, rollout, enabled=True) is None  # dropout: a mask per row unless opted in
    positions = decoder_positions(model)

    def gradient(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return logp_and_gradient(model, rollout, True, path, shared_dropout=True)[1]

    checkpointed = gradient(1)
    checkpointing_off(model)
    plain, other_seed = gradient(1), gradient(2)
    shared = [3 * rollout.prompt_len, len(rollout) * (rollout.completion_mask.shape[1] - 1)]
    assert positions == shared * 3  # each forward shared the prompts, with checkpointing and without
    assert plain.norm() > 1e-3
    assert float((checkpointed - plain).norm() / plain.norm()) < 1e-5
    assert float((other_seed - plain).norm() / plain.norm()) > 1e-3  # the masks matter


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant parameter should be passed")
def test_sharing_stays_off_under_reentrant_checkpointing(qwen_model_dir):
    # The reentrant variant runs each layer's forward without a graph: keys leaving a layer through the cache would
    # carry no gradient. Sharing stays off (also where the variant cannot be told), and the training forward is the
    # plain one, with the gradient of the model without checkpointing.
    model = checkpointed_policy(qwen_model_dir, lora=0)
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    positions = decoder_positions(model)
    checkpointing_off(model)
    expected = logp_and_gradient(model, rollout, False, "hidden")[1]
    for func in (functools.partial(checkpoint, use_reentrant=True), checkpoint):  # reentrant; unknown (its default)
        for layer in checkpointed_layers(model):
            layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, func
        assert not cache_survives_checkpointing(model) and not prefix_sharing_in_graph(model, True)
        assert shares_prefix(model, rollout, enabled=True) is None
        positions.clear()
        grad = logp_and_gradient(model, rollout, True, "hidden")[1]
        assert len(positions) == 1  # one packed forward of every row
        assert float((grad - expected).norm() / expected.norm()) < 1e-5
    with torch.no_grad():
        assert shares_prefix(model, rollout, enabled=True) is not None  # no graph: the no-grad passes still share


def test_layers_read_their_class_flag_again_after_a_forward_and_after_an_error(qwen_model_dir):
    model = checkpointed_policy(qwen_model_dir, lora=4)
    rollout = grouped_rollout(model, load_tokenizer(qwen_model_dir))
    layers = checkpointed_layers(model)
    during = []
    layers[0].register_forward_pre_hook(lambda layer, args: during.append(layer._can_checkpoint_with_cache))
    completion_hidden(model, rollout, share_prefix=True)
    assert during == [True, True]  # the prompt pass and the completion pass kept the cache
    assert all("_can_checkpoint_with_cache" not in m.__dict__ and m._can_checkpoint_with_cache is False for m in layers)

    def fail_on_the_completion_pass(layer, args):
        if args[0].shape[0] == len(rollout):
            raise RuntimeError("completion pass failed")

    layers[-1].register_forward_pre_hook(fail_on_the_completion_pass)
    with pytest.raises(RuntimeError, match="completion pass failed"):
        completion_logits(model, rollout, share_prefix=True)
    assert len(during) == 4  # it failed inside the shared forward
    assert all("_can_checkpoint_with_cache" not in m.__dict__ and m._can_checkpoint_with_cache is False for m in layers)


@pytest.mark.parametrize("lora", ["0", "4"])
def test_a_checkpointed_run_with_sharing_trains_like_one_without(tmp_path, qwen_model_dir, lora, monkeypatch):
    # The Qwen2 fixture under gradient checkpointing, no dropout, KL 0.05, 2 prompts x 4 rows, micro-batches of 2 x
    # accumulation 4 (one step per pass), three iterations: with sharing the training forwards take whole groups and
    # run each prompt once through the checkpointed layers; the weights and logged means are those of the run
    # without sharing.
    from conftest import fit

    shared_in_graph = []
    original = logprobs._prompt_shared

    def recording(forward, *args, **kwargs):
        shared_in_graph.append(torch.is_grad_enabled() and forward.training)
        return original(forward, *args, **kwargs)

    monkeypatch.setattr(logprobs, "_prompt_shared", recording)
    common = ["--model.init_args.iterations=3", "--model.init_args.grad_accum_steps=4"]
    common += ["--model.init_args.kl_coef=0.05", "--model.init_args.speed.gradient_checkpointing=true"]
    common += ["--data.task=test_variants.VariedTask", "--data.task.init_args.eval_size=4"]
    common += [f"--model.init_args.lora.r={lora}", "--model.init_args.lora.dropout=0.0"]
    common += ["--model.init_args.dtype=float32"]
    runs = {}
    for share in ("true", "false"):
        shared_in_graph.clear()
        runs[share] = fit(
            tmp_path / share, qwen_model_dir, *common, f"--model.init_args.speed.share_prompt_prefix={share}"
        )
        if share == "true":
            assert shared_in_graph.count(True) == 3 * 2 * 4  # iterations x epochs x forwards: every training forward
    weights = {share: {n: p.detach() for n, p in cli.model.policy.named_parameters()} for share, cli in runs.items()}
    assert_moved(weights["false"], qwen_model_dir)  # three iterations of updates happened
    logged = {share: _train_rows(tmp_path / share / "run") for share in runs}
    assert logged["false"][-1]["train/kl"] > 1e-6  # the KL term was at work
    keys = ("train/loss", "train/kl", "train/clip_fraction", "train/entropy", "train/grad_norm")
    assert_trained_alike(weights["true"], weights["false"], logged["true"], logged["false"], keys)
