"""Prompt-prefix sharing (`llm_pg.modules.logprobs`): each distinct prompt runs once, the completions on its cache.

The logits and gradients equal the plain forward's (float rounding apart), fewer token positions run, and it
stays off wherever it would not be exact: reentrant gradient checkpointing or dropout in a forward that builds a graph.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from llm_pg.core.losses import completion_mask, split_token_counts
from llm_pg.core.rollout import RolloutBatch
from llm_pg.models.generation import encode_prompts
from llm_pg.modules import update
from llm_pg.modules.logprobs import completion_logits, distinct_prompts, shares_prefix

PROMPTS = ["Say 1", "Say digits, as many as you can: 0123456789", "Digits?"]
GROUP = 4


def grouped_rollout(model, tokenizer, group: int = GROUP, width: int = 7) -> RolloutBatch:
    """`len(PROMPTS) * group` rows: left-padded prompts of three lengths, random completions that end (EOS, then
    pad) at different places, group-contiguous as the rollout callback builds them."""
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS])
    prompt_ids = encoded["input_ids"].repeat_interleave(group, 0)  # [N, P]
    prompt_mask = encoded["attention_mask"].repeat_interleave(group, 0)
    n = len(prompt_ids)
    completion = torch.randint(0, 250, (n, width), generator=torch.Generator().manual_seed(0))
    eos = tokenizer.eos_token_id
    for row, end in enumerate([2, 4, 6, width] * (n // 4)):
        if end < width:
            completion[row, end] = eos
            completion[row, end + 1 :] = tokenizer.pad_token_id
    mask = completion_mask(completion, eos)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, completion], 1),
        attention_mask=torch.cat([prompt_mask, mask.long()], 1),
        completion_mask=mask,
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        prompt_len=prompt_ids.shape[1],
        texts=[""] * n,
        prompt_index=[row // group for row in range(n)],
    )


@pytest.fixture(params=["llama", "qwen2"])
def model_and_tokenizer(request, random_model_dir, qwen_model_dir):
    from llm_pg.models.loading import load_tokenizer

    path = random_model_dir if request.param == "llama" else qwen_model_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_tokenizer(path)


def count_positions(model) -> list[int]:
    """Token positions each forward of `model` runs (rows x columns of its input ids)."""
    seen = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    return seen


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs().amax(-1) * mask).max())


def test_shared_logits_equal_the_plain_forward_with_fewer_positions(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    model.eval()
    rollout = grouped_rollout(model, tokenizer)
    positions = count_positions(model)
    with torch.no_grad():
        plain = completion_logits(model, rollout, share_prefix=False)
        shared = completion_logits(model, rollout, share_prefix=True)
    assert plain.shape == shared.shape == (12, 7, model.config.vocab_size)
    assert masked_gap(plain, shared, rollout.completion_mask) < 1e-4
    assert plain.abs().max() > 1e-2  # logits that mean something
    n, prompt, width = len(rollout), rollout.prompt_len, 7
    assert positions == [n * (prompt + width), 3 * prompt, n * (width - 1)]  # 3 distinct prompts, run once each


def test_shared_gradients_equal_the_plain_forward(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    model.train()  # dropout 0 in both configs: sharing applies while building a graph
    rollout = grouped_rollout(model, tokenizer)
    assert shares_prefix(model, rollout, enabled=True) is not None
    targets = rollout.completion_ids.unsqueeze(-1)

    def gradient(share: bool) -> torch.Tensor:
        model.zero_grad()
        logits = completion_logits(model, rollout, share_prefix=share)
        logp = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)  # [N, C]
        (logp * rollout.completion_mask).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    plain, shared = gradient(False), gradient(True)
    assert plain.norm() > 1e-3
    assert float((plain - shared).norm() / plain.norm()) < 1e-5


def test_lora_policy_and_its_disabled_adapter_share_exactly(random_model_dir):
    from llm_pg.models.loading import load_tokenizer

    base = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model.eval()
    rollout = grouped_rollout(model, load_tokenizer(random_model_dir))
    with torch.no_grad():
        plain = completion_logits(model, rollout, share_prefix=False)
        shared = completion_logits(model, rollout, share_prefix=True)
        with model.disable_adapter():
            reference_plain = completion_logits(model, rollout, share_prefix=False)
            reference_shared = completion_logits(model, rollout, share_prefix=True)
    assert masked_gap(plain, shared, rollout.completion_mask) < 1e-4
    assert masked_gap(reference_plain, reference_shared, rollout.completion_mask) < 1e-4
    assert masked_gap(plain, reference_plain, rollout.completion_mask) > 1e-3  # the adapter matters


def test_sharing_stays_off_where_it_would_not_be_exact_or_would_not_pay(random_model_dir):
    from llm_pg.models.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(random_model_dir)
    rollout = grouped_rollout(model, tokenizer)
    first, inverse = distinct_prompts(rollout)
    groups = inverse.view(3, GROUP)
    assert len(first) == 3 and (groups == groups[:, :1]).all() and len(set(groups[:, 0].tolist())) == 3
    assert torch.equal(
        rollout.input_ids[first[inverse], : rollout.prompt_len], rollout.input_ids[:, : rollout.prompt_len]
    )
    model.train()
    assert shares_prefix(model, rollout, enabled=False) is None
    mixed = rollout.select(torch.tensor([0, 4, 8, 1]))  # 3 distinct prompts in 4 rows: a second call does not pay
    assert shares_prefix(model, mixed, enabled=True) is None
    # Reentrant checkpointing runs each layer's forward without a graph: keys leaving a layer through the cache would
    # carry no gradient (non-reentrant checkpointing shares: tests/test_prefix_checkpointing.py).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert shares_prefix(model, rollout, enabled=True) is None
    with torch.no_grad():
        assert shares_prefix(model, rollout, enabled=True) is not None  # no graph: the no-grad passes still share
    model.gradient_checkpointing_disable()
    model.model.layers[0].self_attn.attention_dropout = 0.0
    model.config.attention_dropout = 0.1  # a config dropout: duplicate rows would share their prompt's mask
    assert shares_prefix(model, rollout, enabled=True) is None
    model.eval()
    assert shares_prefix(model, rollout, enabled=True) is not None  # eval mode: dropout is off


def _train_rows(run) -> list[dict]:
    import csv

    with open(run / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    return sorted((r for r in rows if "train/kl" in r), key=lambda r: r["step"])


def assert_moved(weights: dict, model_dir: str) -> None:
    """The fit changed the model: a base weight moved from the checkpoint's, or a LoRA B left zero (peft names)."""
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    base = [(n.replace("base_model.model.", "").replace(".base_layer", ""), v) for n, v in weights.items()]
    moved = max(float((v.detach() - start[n]).abs().max()) for n, v in base if "lora_" not in n)
    lora_moved = [float(v.detach().abs().max()) for n, v in weights.items() if "lora_B" in n]
    assert moved > 1e-5 or max(lora_moved, default=0.0) > 1e-5  # the iterations updated the model


def assert_trained_alike(weights: dict, reference: dict, rows: list[dict], reference_rows: list[dict], keys) -> None:
    """Two fits ended with the same weights and logged the same `keys` at every iteration (1e-4 relative).

    Weights agree to 1e-4 relative or 1.5e-5 absolute: a twentieth of one AdamW step at the tiny configs' lr 3e-4.
    AdamW divides by sqrt(v), so an element whose gradient is near zero turns float rounding into a visible share
    of a step (measured up to 2.9e-6 on another CPU); a path error moves whole rows by full steps."""
    for name, value in weights.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1.5e-5)
    assert len(rows) == len(reference_rows) > 0
    for row, reference_row in zip(rows, reference_rows, strict=True):
        for key in keys:
            assert row[key] == pytest.approx(reference_row[key], rel=1e-4, abs=1e-7), key


def _context(share: bool, minibatch_size: int) -> update.UpdateContext:
    return update.UpdateContext(None, None, None, 1, minibatch_size, 1, 1.0, grouped=share, by_length=False)


def test_forwards_take_whole_groups_only_where_a_pass_is_one_step_over_equal_micro_batches():
    assert update.grouped_passes(_context(True, 8), rows=48, steps=1)
    assert not update.grouped_passes(_context(False, 8), rows=48, steps=1)  # sharing off: by micro-batch, as before
    assert not update.grouped_passes(_context(True, 8), rows=48, steps=2)  # several steps: order changes the update
    assert not update.grouped_passes(_context(True, 8), rows=44, steps=1)  # a short micro-batch weighs rows more


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_grouped_forwards_with_split_token_counts_make_the_shuffled_splits_step(aggregation):
    # 8 rows of unequal lengths, micro-batches of 2, one step, KL on: the step (gradient, and the summed token-mean
    # statistics) of the shuffled split equals that of forwards over rows in rollout order once each row's token
    # means divide by its own micro-batch's tokens (split_tokens). Without split_tokens the KL mean of the
    # forward's rows weighs them otherwise, and the step differs.
    from llm_pg.core.losses import grpo_loss

    torch.manual_seed(0)
    logp = (torch.randn(8, 6) - 2).requires_grad_()
    ref, old = logp.detach() + 0.3 * torch.randn(8, 6), logp.detach() + 0.4 * torch.randn(8, 6)  # some ratios clip
    mask = torch.arange(6) < torch.tensor([6, 2, 5, 3, 6, 1, 4, 2]).unsqueeze(1)  # [8, 6]
    advantages = torch.randn(8)
    shuffled = [torch.tensor(rows) for rows in ([5, 0], [3, 6], [1, 7], [2, 4])]
    in_order = [torch.tensor(rows) for rows in ([0, 1], [2, 3], [4, 5], [6, 7])]

    def step(forwards: list[torch.Tensor], split_tokens: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        logp.grad, totals = None, {}
        for rows in forwards:
            loss, stats = grpo_loss(
                logp[rows], old[rows], mask[rows], advantages[rows], ref[rows], kl_coef=0.05, aggregation=aggregation,
                max_new_tokens=6, num_tokens=float(mask.sum()),
                split_tokens=None if split_tokens is None else split_tokens[rows],
            )  # fmt: skip
            (loss if aggregation == "token_mean" else loss / 4).backward()
            for key in ("kl", "clip_fraction", "ratio_mean", "policy_loss"):
                totals[key] = totals.get(key, 0.0) + float(stats[key])
        return logp.grad.clone(), totals

    reference, reference_stats = step(shuffled, None)
    grouped, grouped_stats = step(in_order, split_token_counts(mask, shuffled))
    torch.testing.assert_close(grouped, reference)
    assert grouped_stats == pytest.approx(reference_stats, rel=1e-6)
    assert reference_stats["kl"] > 1e-3 and reference_stats["clip_fraction"] > 0  # statistics that mean something
    naive, _ = step(in_order, None)
    if aggregation != "token_mean":  # token_mean's KL divides by the step's tokens: no split to get wrong
        assert (naive - reference).abs().max() > 1e-4


def test_a_run_with_sharing_trains_like_one_without(tmp_path, eos_model_dir, monkeypatch):
    # 8 rows per iteration (2 prompts x 4) of varied lengths (the model ends about one token in five), micro-batches
    # of 2 x accumulation 4: one step per pass, KL 0.05 (its gradient non-zero from the second iteration). With
    # sharing the forwards take whole groups (each prompt run once) and the loss weighs rows by their shuffled
    # micro-batch; without, the forwards are the shuffled micro-batches. Without that weighing this test fails.
    from conftest import fit

    from llm_pg.core.objectives import Objective

    groups: dict[str, list[set[int]]] = {"true": [], "false": []}
    running = []  # the share setting of the run in progress
    original = Objective.__call__

    def recording(self, logp, entropy, micro):
        groups[running[-1]].append(set(micro.rows.prompt_index))
        return original(self, logp, entropy, micro)

    monkeypatch.setattr(Objective, "__call__", recording)
    common = ["--model.init_args.iterations=3", "--model.init_args.grad_accum_steps=4"]
    common += ["--model.init_args.kl_coef=0.05", "--data.task=test_variants.VariedTask"]
    common += ["--data.task.init_args.eval_size=4"]
    runs = {}
    for share in ("true", "false"):
        running.append(share)
        runs[share] = fit(
            tmp_path / share, eos_model_dir, *common, f"--model.init_args.speed.share_prompt_prefix={share}"
        )
    assert len(groups["true"]) == 3 * 2 * 4 and all(len(g) == 1 for g in groups["true"])  # one prompt each
    assert any(len(g) == 2 for g in groups["false"])  # shuffled: some micro-batch mixes the two prompts
    weights = {share: dict(cli.model.policy.named_parameters()) for share, cli in runs.items()}
    start = AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32)
    moved = max(float((weights["true"][n] - p).abs().max()) for n, p in start.named_parameters())
    assert moved > 1e-4  # three iterations of updates happened
    logged = {share: _train_rows(tmp_path / share / "run") for share in runs}
    assert logged["true"][-1]["train/kl"] > 1e-4  # the KL term was at work
    keys = ("train/loss", "train/kl", "train/clip_fraction", "train/ratio_mean", "train/entropy")
    assert_trained_alike(weights["true"], weights["false"], logged["true"], logged["false"], keys)


@pytest.mark.parametrize("greedy", [False, True])
def test_generation_prefills_each_prompt_once_and_samples_the_same_tokens(model_and_tokenizer, greedy):
    from llm_pg.models.generation import Sampling, generate

    model, tokenizer = model_and_tokenizer
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]  # three prompt lengths: left padding
    settings = {"num_samples": GROUP, "seed": 3}
    sampling = Sampling(max_new_tokens=6, greedy=greedy)
    positions = count_positions(model)
    plain = generate(model, tokenizer, conversations, sampling, share_prompt=False, **settings)
    prefill_plain = positions[0]
    positions.clear()
    shared = generate(model, tokenizer, conversations, sampling, share_prompt=True, **settings)
    assert torch.equal(plain.completion_ids, shared.completion_ids) and plain.texts == shared.texts
    assert len(set(plain.texts)) > 1 or greedy  # sampling drew different completions within a group
    prompt = plain.prompt_ids.shape[1]
    assert prefill_plain == 3 * GROUP * prompt
    assert positions[:2] == [3 * (prompt - 1), 3 * GROUP]  # prompts once without their last token, then each row's


@pytest.mark.parametrize("greedy", [False, True])
def test_episode_turns_prefill_the_ids_every_context_shares_once(model_and_tokenizer, greedy):
    """A multi-turn episode's contexts (`continue_ids`): the rows of a first turn are one prompt, the later turns'
    rows go on differently after it. The ids they all share run once, then each row's rest (left-padded after
    them), and every row draws the tokens of a prefill of its own."""
    from llm_pg.models.generation import Sampling, continue_ids

    model, tokenizer = model_and_tokenizer
    prompt = encode_prompts(tokenizer, [[{"role": "user", "content": PROMPTS[1]}]])["input_ids"][0].tolist()
    rests = torch.randint(5, 60, (6, 9), generator=torch.Generator().manual_seed(0)).tolist()
    contexts = [prompt + rest[:k] for rest, k in zip(rests, (0, 3, 0, 9, 5, 1), strict=True)]
    sampling = Sampling(max_new_tokens=6, greedy=greedy)
    positions = count_positions(model)
    plain = continue_ids(model, tokenizer, contexts, sampling, seed=3, share_prefix=False)
    assert positions[0] == len(contexts) * (len(prompt) + 9)  # every row's whole context, left-padded
    positions.clear()
    shared = continue_ids(model, tokenizer, contexts, sampling, seed=3, share_prefix=True)
    assert shared == plain and (greedy or len(set(map(tuple, plain))) > 1)
    kept = len(prompt) - 1  # the shortest context keeps its last id for the batch's first forward
    assert positions[:2] == [kept, len(contexts) * (len(prompt) + 9 - kept)]
    positions.clear()
    continue_ids(model, tokenizer, contexts[1:2], sampling, seed=3)
    assert positions[0] == len(contexts[1])  # one row: nothing to share


def test_a_checkpoint_that_names_its_cache_samples_without_sharing(random_model_dir):
    # transformers refuses a cache passed to generate() beside a `cache_implementation` (Gemma 3 ships "hybrid"):
    # such a model prefills every row itself, and sampling still works.
    from llm_pg.models.generation import Sampling, generate
    from llm_pg.models.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    model.generation_config.cache_implementation = "static"
    tokenizer = load_tokenizer(random_model_dir)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    positions = count_positions(model)
    out = generate(model, tokenizer, conversations, Sampling(max_new_tokens=4), num_samples=GROUP, seed=1)
    assert out.completion_ids.shape == (3 * GROUP, 4)
    assert positions[0] == 3 * GROUP * out.prompt_ids.shape[1]  # one prefill of every row: nothing shared
