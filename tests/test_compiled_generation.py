"""Compiled decoding (`speed.compile_generation`, `llm_pg.models.decoding.compiled_forward`): HF generate's decode
steps run through `torch.compile` over the reserved cache, with eager's logits to float rounding, without
recompiling across batch sizes and lengths, and the model's own forward untouched outside sampling."""

import csv

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

import llm_pg.models.decoding as decoding
from llm_pg.models.cache import with_kv_cache
from llm_pg.models.decoding import compiled_forward, reserved_cache
from llm_pg.models.generation import Sampling, encode_prompts, generate, prompt_cache
from llm_pg.models.loading import load_tokenizer
from llm_pg.modules import GRPOModule

PROMPTS = ["Say 1", "Say digits, as many as you can: 0123456789", "Digits?"]  # three lengths: left padding


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles for itself: dynamo's graphs and recompile counts of other tests do not carry over."""
    torch._dynamo.reset()
    decoding._COMPILED.clear()
    yield
    assert not decoding._FAILED  # every compile in the test succeeded: no step fell back to eager
    torch._dynamo.reset()
    decoding._COMPILED.clear()


def _counting_compile(monkeypatch, cls) -> list[int]:
    """The compiled forward of `cls`, counting its calls."""
    calls = []
    real = torch.compile(cls.forward, dynamic=True)
    monkeypatch.setitem(decoding._COMPILED, cls, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _conversations(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in prompts]


@torch.no_grad()
def _greedy_logits(model, tokenizer, compiled: bool, num_samples: int, new_tokens: int):
    """Greedy `model.generate` over the reserved cache (the shared prompt prefill when `num_samples` > 1), returning
    the tokens `[N, new_tokens]` and every step's logits `[new_tokens, N, V]`."""
    encoded = encode_prompts(tokenizer, _conversations(PROMPTS))
    ids = encoded["input_ids"].repeat_interleave(num_samples, 0)
    mask = encoded["attention_mask"].repeat_interleave(num_samples, 0)
    cache = reserved_cache(model, prompt_cache(model, encoded, num_samples), new_tokens)
    model.eval()
    with compiled_forward(model, compiled):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **with_kv_cache(cache),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


@pytest.fixture(params=["llama", "qwen2"])
def model_and_tokenizer(request, random_model_dir, qwen_model_dir):
    path = random_model_dir if request.param == "llama" else qwen_model_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)


@pytest.mark.parametrize("num_samples", [4, 1])  # the shared prompt prefill, and a prefill of the whole prompt
def test_compiled_decoding_gives_the_eager_logits_to_float_rounding(model_and_tokenizer, num_samples, monkeypatch):
    model, tokenizer = model_and_tokenizer
    eager_tokens, eager_logits = _greedy_logits(model, tokenizer, False, num_samples, 12)
    calls = _counting_compile(monkeypatch, type(model))
    tokens, logits = _greedy_logits(model, tokenizer, True, num_samples, 12)
    assert len(calls) == 11  # every step after the prefill ran compiled
    assert torch.equal(tokens, eager_tokens)
    assert (logits - eager_logits).abs().max() < 1e-5
    assert eager_logits.std() > 0.1  # the comparison is between real logits, not constants
    assert "forward" not in vars(model)  # the class's eager forward again after the call


@pytest.mark.slow  # compiles (10-17 s here)
def test_compiled_calls_are_the_decode_steps_and_nothing_recompiles(random_model_dir, monkeypatch):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(random_model_dir), load_tokenizer(random_model_dir)
    calls = _counting_compile(monkeypatch, type(model))
    settings = {"seed": 0, "compiled": True}
    ten = Sampling(max_new_tokens=10, min_new_tokens=10)
    # The first compile sees a batch equal to the model's head size (16 prompts, greedy, as an evaluation samples):
    # with duck sizing the graph would tie the batch to that dimension and recompile at the next batch size.
    varied = [f"Say{' 7' * i}" for i in range(16)]  # 16 lengths: generate passes an attention mask
    generate(model, tokenizer, _conversations(varied), ten.greedy_version(), num_samples=1, **settings)
    assert len(calls) == 9  # 10 forwards: the whole-prompt prefill allocates the buffers (eager), then 9 tokens
    calls.clear()
    # Other batch sizes (12, 16 again, the hidden size 32), prompt widths and longer completions: the same graph. A
    # recompile raises inside the compiled call, which would mark the class failed. (Prompts of one length need no
    # attention mask, so generate calls without it: that would be a second graph.)
    with torch._dynamo.config.patch(error_on_recompile=True):
        generate(model, tokenizer, _conversations(PROMPTS), ten, num_samples=4, **settings)
        assert len(calls) == 9  # the prefill of the last prompt token over the shared prefill is eager too
        for prompts, samples, tokens in [(PROMPTS[:2], 8, 6), (PROMPTS[1:], 16, 20), (["Hi", "Hello"] * 3, 1, 4)]:
            sampling = Sampling(max_new_tokens=tokens, min_new_tokens=tokens)
            generate(model, tokenizer, _conversations(prompts), sampling, num_samples=samples, **settings)
    assert not decoding._FAILED and len(calls) == 9 + 5 + 19 + 3  # every decode step of the four calls compiled


def test_compiled_sampling_follows_weights_updated_in_place(random_model_dir, monkeypatch):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(random_model_dir), load_tokenizer(random_model_dir)
    calls = _counting_compile(monkeypatch, type(model))
    settings = {"num_samples": 4, "seed": 3}
    sampling = Sampling(max_new_tokens=12)
    before = generate(model, tokenizer, _conversations(PROMPTS), sampling, compiled=True, **settings).completion_ids
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)  # an optimizer step, in place
    with torch._dynamo.config.patch(error_on_recompile=True):
        after = generate(model, tokenizer, _conversations(PROMPTS), sampling, compiled=True, **settings).completion_ids
    assert torch.equal(after, generate(model, tokenizer, _conversations(PROMPTS), sampling, **settings).completion_ids)
    assert not torch.equal(after, before)  # the new weights were read, not ones captured at compile time
    assert len(calls) == 2 * 11  # both compiled runs decoded compiled


@pytest.mark.slow  # compiles (10-17 s here)
def test_a_lora_policy_compiles_its_wrapped_model(random_model_dir, monkeypatch):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = AutoModelForCausalLM.from_pretrained(random_model_dir), load_tokenizer(random_model_dir)
    calls = _counting_compile(monkeypatch, type(base))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # a trained adapter: B = 0 would leave the base model's logits
    settings = {"num_samples": 4}
    sampling = Sampling(max_new_tokens=12, greedy=True)
    eager = generate(model, tokenizer, _conversations(PROMPTS), sampling, **settings).completion_ids
    with model.disable_adapter():
        assert not torch.equal(
            eager, generate(model, tokenizer, _conversations(PROMPTS), sampling, **settings).completion_ids
        )
    compiled = generate(model, tokenizer, _conversations(PROMPTS), sampling, compiled=True, **settings).completion_ids
    assert torch.equal(compiled, eager) and len(calls) == 11  # the wrapped Llama decoded compiled, adapter and all
    assert "forward" not in vars(base)


def test_a_forward_replaced_on_the_instance_is_left_alone(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    hooked = model.forward  # a hook library's wrapper stands on the instance
    model.forward = hooked
    with compiled_forward(model):
        assert vars(model)["forward"] is hooked
    assert vars(model)["forward"] is hooked


def test_the_forward_is_restored_when_sampling_fails(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    with pytest.raises(RuntimeError, match="interrupted"), compiled_forward(model):
        assert "forward" in vars(model)
        raise RuntimeError("interrupted")
    assert "forward" not in vars(model)


def test_a_failed_compile_warns_once_and_decodes_eagerly(random_model_dir, monkeypatch):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(random_model_dir), load_tokenizer(random_model_dir)
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("backend='inductor' raised:\nRuntimeError: no compiler here\n\nSet TORCHDYNAMO_VERBOSE=1")

    monkeypatch.setitem(decoding._COMPILED, type(model), broken)
    settings = {"num_samples": 4, "seed": 3}
    sampling = Sampling(max_new_tokens=12)
    failed = r"torch.compile failed on LlamaForCausalLM \(RuntimeError: no compiler here\)"
    with pytest.warns(UserWarning, match=failed):
        fallen_back = generate(
            model, tokenizer, _conversations(PROMPTS), sampling, compiled=True, **settings
        ).completion_ids
    again = generate(model, tokenizer, _conversations(PROMPTS), sampling, compiled=True, **settings).completion_ids
    assert attempts == [1]  # one attempt, then the class decodes eagerly without trying again
    eager = generate(model, tokenizer, _conversations(PROMPTS), sampling, **settings).completion_ids
    assert torch.equal(fallen_back, eager) and torch.equal(again, eager)  # the failed step was rerun, not lost
    decoding._FAILED.clear()


def test_compile_generation_is_a_flag_for_the_hf_engine():
    with pytest.raises(ValueError, match=r"^model.speed.compile_generation must be true or false, got 'yes'; "):
        GRPOModule(model_name_or_path="tiny", speed={"compile_generation": "yes"})
    assert GRPOModule(model_name_or_path="tiny", speed={"compile_generation": True}).speed.compile_generation


def test_compile_generation_with_vllm_is_refused():
    with pytest.raises(ValueError, match=r"^model.speed.compile_generation=true compiles HF generate's decode steps"):
        GRPOModule(model_name_or_path="tiny", rollout_engine="vllm", speed={"compile_generation": True})


@pytest.mark.slow  # compiles (10-17 s here)
def test_a_fit_samples_compiled_and_trains_eagerly(tmp_path, random_model_dir, monkeypatch):
    from conftest import fit
    from transformers import LlamaForCausalLM

    compiled_calls, trained = _counting_compile(monkeypatch, LlamaForCausalLM), []
    training_step = GRPOModule.training_step

    def spy(self, *args):
        trained.append("forward" not in vars(self.policy))  # the update's forwards are the eager class forward
        return training_step(self, *args)

    monkeypatch.setattr(GRPOModule, "training_step", spy)
    overrides = ["--model.init_args.iterations=2", "--model.init_args.speed.compile_generation=true"]
    fit(tmp_path / "compiled", random_model_dir, *overrides)
    assert trained == [True, True] and len(compiled_calls) >= 2 * 7  # two rollouts of 8 tokens, and evaluations
    monkeypatch.setattr(GRPOModule, "training_step", training_step)
    fit(tmp_path / "eager", random_model_dir, "--model.init_args.iterations=2")
    first = []
    for side in ("compiled", "eager"):
        with open(tmp_path / side / "run" / "metrics.csv") as f:
            row = next(r for r in csv.DictReader(f) if r.get("train/reward"))  # iteration 1
        first.append({key: float(value) for key, value in row.items() if key.startswith("train/") and value})
    assert {"train/reward", "train/entropy", "train/loss", "train/kl"} <= first[0].keys()
    assert first[0] == first[1]  # the same weights sampled the same first rollout, and trained on it alike
