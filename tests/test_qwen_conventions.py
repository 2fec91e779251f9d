"""The real configs on a model with Qwen2.5-Math-1.5B-Instruct's conventions, without a download.

`configs/{format_copy,math_hard}/{grpo,reinforce}.yaml` name a 1.5B hub model that CI cannot fetch. The
`qwen_model_dir` fixture (`tests/make_qwen_fixture.py`) is a tiny random Qwen2 with that model's tokenizer class,
special tokens, ChatML template, vocabulary padded above the tokenizer and sampling-happy generation config.
Here each real config trains 2 iterations on it (CPU, float32, short completions, small eval sets, the math
fixture rows), and the checks are the ones a convention mismatch would break: LoRA finds all seven projection
types, completions end at the first `<|im_end|>` or `<|endoftext|>`, the reference is the base model (adapter
off, raw-logit log-probs), the run's sampling settings beat the model's generation config, and `final/` reloads
with peft and gives the trained policy's logits.
"""

from pathlib import Path

import pytest
import torch
from conftest import ROOT
from lightning.pytorch.callbacks import Callback
from make_qwen_fixture import DEFAULT_SYSTEM_PROMPT, ENDOFTEXT, IM_END, MODEL_VOCAB_SIZE, TOKENIZER_SIZE
from transformers import LogitsProcessorList

from llm_pg.models.generation import Sampling, encode_prompts, eos_token_ids, generate, unused_token_ids
from llm_pg.models.loading import load_tokenizer
from llm_pg.models.sampling import NucleusSampler

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
MATH_SAMPLE = ROOT / "tests" / "fixtures" / "math_sample"
QUESTION = [{"role": "user", "content": "Copy this integer exactly: 4096"}]


class RolloutRecorder(Callback):
    """Keeps every iteration's rollout, on the CPU, for the checks after the run."""

    def __init__(self) -> None:
        self.rollouts = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.rollouts.append(batch.rollout.rows.to("cpu"))


def fit_real_config(tmp_path: Path, model_dir: str, config: str, *overrides: str):
    """`llm-pg fit --config configs/<config>` for 2 iterations on the fixture; returns the CLI and the rollouts."""
    from llm_pg.cli.fit import run_cli

    args = [
        "fit",
        f"--config={ROOT / 'configs' / config}",
        f"--model.init_args.model_name_or_path={model_dir}",
        "--model.init_args.dtype=float32",
        "--model.init_args.iterations=2",
        "--model.init_args.max_new_tokens=16",  # math_hard keeps min_new_tokens 8: EOS is possible in 8 of 16
        "--data.task.init_args.eval_size=2",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=test_qwen_conventions.RolloutRecorder",
        f"--runs_root={tmp_path}",
        "--run_name=run",
        "--wandb_project=null",
    ]
    if config.startswith("math_hard"):
        files = f'{{"train": "{MATH_SAMPLE / "train.jsonl"}", "test": "{MATH_SAMPLE / "test.jsonl"}"}}'
        args += ["--data.task.init_args.dataset=json", f"--data.task.init_args.data_files={files}"]
    cli = run_cli([*args, *overrides])
    recorder = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutRecorder))
    return cli, recorder.rollouts


def load_base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def logits_of(model, rollout) -> torch.Tensor:
    """Logits `[N, P+C, V]` of the rollout's sequences, positions numbered as generate() numbers left-padded rows."""
    mask = rollout.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=rollout.input_ids, attention_mask=mask, position_ids=position_ids).logits.float()


def completion_logprobs(logits: torch.Tensor, rollout, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each completion token `[N, C]`, from the full logits (not the trainer's code)."""
    scores = torch.log_softmax(logits[:, rollout.prompt_len - 1 : -1] / temperature, dim=-1)
    return scores.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)


def first_eos_mask(completion_ids: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """True up to and including each row's first EOS token, written as a plain loop."""
    mask = torch.zeros_like(completion_ids, dtype=torch.bool)
    for row, ids in enumerate(completion_ids.tolist()):
        for col, token in enumerate(ids):
            mask[row, col] = True
            if token in eos:
                break
    return mask


def assert_final_adapter_reproduces_policy(cli, model_dir: str, rollout) -> float:
    """`final/` on top of a fresh base gives the trained policy's logits; returns max |policy - base| logits."""
    from peft import PeftModel

    from llm_pg.callbacks.evaluation import run_dir

    final = run_dir(cli.trainer) / "final"
    policy = cli.model.policy.eval()
    reloaded = PeftModel.from_pretrained(load_base(model_dir), final).eval()
    trained = logits_of(policy, rollout)
    torch.testing.assert_close(logits_of(reloaded, rollout), trained, rtol=0, atol=1e-5)
    assert type(load_tokenizer(str(final))).__name__ == "Qwen2Tokenizer"
    return (trained - logits_of(load_base(model_dir), rollout)).abs().max().item()


# ---- the fixture and the sampling settings ------------------------------------------------------------------


def test_fixture_has_the_qwen_conventions(qwen_model_dir):
    tokenizer = load_tokenizer(qwen_model_dir)
    model = load_base(qwen_model_dir)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"  # AutoTokenizer builds Qwen's class, as for the hub model
    assert (len(tokenizer), model.config.vocab_size) == (TOKENIZER_SIZE, MODEL_VOCAB_SIZE)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (IM_END, ENDOFTEXT, None)
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    assert eos_token_ids(model, tokenizer) == sorted([im_end, endoftext])
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nCopy this integer exactly: 4096<|im_end|>\n<|im_start|>assistant\n"
    )
    assert DEFAULT_SYSTEM_PROMPT == "Please reason step by step, and put your final answer within \\boxed{}."
    config = model.generation_config
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (True, 0.7, 0.8, 20)
    assert config.repetition_penalty == 1.05


def _prompt(tokenizer, num_samples: int) -> dict[str, torch.Tensor]:
    encoded = encode_prompts(tokenizer, [QUESTION])
    return {key: value.repeat_interleave(num_samples, dim=0) for key, value in encoded.items()}


def test_sampling_overrides_the_generation_config(qwen_model_dir):
    """Our sampling = HF generate running the nucleus sampler (`llm_pg.models.sampling`) at the run's T/top-p, with
    repetition_penalty 1.0 said explicitly; the config's top_k 20 cannot apply (no sampling warpers run: the sampler
    draws, generate takes its argmax)."""
    tokenizer, model = load_tokenizer(qwen_model_dir), load_base(qwen_model_dir)
    ours = generate(
        model, tokenizer, [QUESTION], Sampling(max_new_tokens=12, temperature=0.8, top_p=0.95), num_samples=6, seed=3
    )
    prompt = _prompt(tokenizer, 6)
    eos, pad = eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    unused = unused_token_ids(model, tokenizer)  # the head's rows past the tokenizer, as Qwen's: never drawn
    assert unused and int(ours.completion_ids.max()) < len(tokenizer)
    common = {**prompt, "max_new_tokens": 12, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    common["suppress_tokens"] = unused
    sampler = LogitsProcessorList([NucleusSampler(0.8, 0.95)])
    torch.manual_seed(3)
    explicit = model.generate(**common, logits_processor=sampler, repetition_penalty=1.0)
    torch.manual_seed(3)
    with_model_defaults = model.generate(**common, logits_processor=sampler)  # the config's penalty 1.05 applies
    width = prompt["input_ids"].shape[1]
    assert torch.equal(ours.completion_ids, explicit[:, width:])
    assert not torch.equal(ours.completion_ids, with_model_defaults[:, width:])  # the override is not a no-op


def test_greedy_eval_is_greedy_although_the_generation_config_samples(qwen_model_dir):
    tokenizer, model = load_tokenizer(qwen_model_dir), load_base(qwen_model_dir)
    torch.manual_seed(0)  # a sampling bug would show as a different draw, not as the argmax path
    ours = generate(model, tokenizer, [QUESTION], Sampling(max_new_tokens=10, greedy=True)).completion_ids[0].tolist()
    ids = _prompt(tokenizer, 1)["input_ids"]
    expected = []
    with torch.no_grad():
        for _ in range(10):  # the argmax path by hand, one full forward per token
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            expected.append(token)
            if token in eos_token_ids(model, tokenizer):
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert ours[: len(expected)] == expected


# ---- the four real configs, 2 iterations each ------------------------------------------------------------------

REAL_CONFIGS = [
    "format_copy/grpo.yaml",
    "format_copy/reinforce.yaml",
    pytest.param("math_hard/reinforce.yaml", marks=pytest.mark.slow),
    pytest.param("math_hard/grpo.yaml", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_real_config_trains_on_the_qwen_fixture(tmp_path, qwen_model_dir, config):
    from peft.tuners.lora import LoraLayer

    cli, rollouts = fit_real_config(tmp_path, qwen_model_dir, config)
    module, hp = cli.model, cli.model.hparams
    assert module.iteration == 2 and len(rollouts) == 2
    wrapped = [name.rsplit(".", 1)[-1] for name, m in module.policy.named_modules() if isinstance(m, LoraLayer)]
    assert set(wrapped) == PROJECTIONS and len(wrapped) == 7 * 2  # every projection of both layers
    assert (hp.temperature, hp.top_p, hp.logprob_temperature) == (0.8, 0.95, 1.0)

    eos = set(eos_token_ids(module.policy, module.tokenizer))
    assert eos == set(module.tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT]))
    base = load_base(qwen_model_dir)
    stopped_early = 0
    for rollout in rollouts:
        assert rollout.completion_mask.shape[1] == 16
        assert torch.equal(rollout.completion_mask, first_eos_mask(rollout.completion_ids, eos))
        stopped_early += int((~rollout.completion_mask[:, -1]).sum())
        expected_ref = completion_logprobs(logits_of(base, rollout), rollout, temperature=1.0)
        mask = rollout.completion_mask
        torch.testing.assert_close(rollout.ref_logp[mask], expected_ref[mask], rtol=0, atol=2e-5)
    assert stopped_early > 0, "no completion hit an EOS before the last column: the mask check saw no EOS"
    if rollouts[0].old_logp is not None:  # GRPO: before any update the policy is the base (LoRA B = 0)
        torch.testing.assert_close(rollouts[0].old_logp, rollouts[0].ref_logp, rtol=0, atol=1e-5)
    assert_final_adapter_reproduces_policy(cli, qwen_model_dir, rollouts[-1])


def test_trained_adapter_moves_and_the_reference_stays_the_base(tmp_path, qwen_model_dir):
    """With rewards that vary inside groups (a random model earns none on the real tasks) and a learning rate
    large enough to move a tiny adapter in one step, the second rollout's pi_old is the moved policy while its
    reference is still the base model, and `final/` carries the moved adapter."""
    cli, rollouts = fit_real_config(
        tmp_path,
        qwen_model_dir,
        "format_copy/grpo.yaml",
        "--data.task=conftest.DigitTask",
        "--model.init_args.lr=3e-3",
        "--model.init_args.warmup_steps=0",
    )
    first, second = rollouts
    assert first.advantages.abs().sum() > 0  # the first update has a signal
    mask = second.completion_mask
    expected_ref = completion_logprobs(logits_of(load_base(qwen_model_dir), second), second, temperature=1.0)
    torch.testing.assert_close(second.ref_logp[mask], expected_ref[mask], rtol=0, atol=2e-5)
    assert (second.old_logp - second.ref_logp)[mask].abs().max() > 1e-2  # pi_old is the moved policy
    assert assert_final_adapter_reproduces_policy(cli, qwen_model_dir, second) > 1e-2


def test_vllm_is_told_the_same_unused_rows_as_hf_sampling(qwen_model_dir):
    """vLLM's requests bias exactly the rows HF sampling suppresses (read from the config, not a model); none for a
    model whose head matches its tokenizer."""
    from llm_pg.engines.vllm import unused_logit_bias
    from llm_pg.models.loading import TINY_MODEL

    tokenizer = load_tokenizer(qwen_model_dir)
    bias = unused_logit_bias(qwen_model_dir, tokenizer)
    assert (
        sorted(bias)
        == unused_token_ids(load_base(qwen_model_dir), tokenizer)
        == list(range(TOKENIZER_SIZE, MODEL_VOCAB_SIZE))
    )
    assert set(bias.values()) == {-100.0}  # vLLM's lowest bias: e^-100 of the probability, 0 after a float32 softmax
    assert unused_logit_bias(str(TINY_MODEL), load_tokenizer(str(TINY_MODEL))) is None
