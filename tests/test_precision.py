"""Mixed precision: bf16 compute, float32 master weights for what the optimizer updates."""

import pytest
import torch
from conftest import fit
from transformers import AutoModelForCausalLM

from llm_pg.modules import GRPOModule

DIGITS = ["--data.task=conftest.DigitTask", "--data.task.init_args.eval_size=4"]


def test_full_finetuning_in_bf16_moves_every_weight(tmp_path, random_model_dir):
    # bf16 has 8 mantissa bits: a weight of 0.02 moves in steps of ~1e-4, so lr 3e-5 AdamW updates (~3e-5 each)
    # round away on bf16 weights. Float32 master weights keep every update.
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    cli = fit(
        tmp_path,
        random_model_dir,
        "--model.init_args.dtype=bfloat16",
        "--model.init_args.lr=3e-5",
        "--model.init_args.kl_coef=0.05",
        "--model.init_args.iterations=5",
        "--model.init_args.ppo_epochs=1",  # 8 rows in micro-batches of 2, 2 per step: 2 optimizer steps per iteration
        *DIGITS,
    )
    module = cli.model
    assert module.optimizer_steps == 10
    changed = total = 0
    for name, weight in module.policy.named_parameters():
        assert weight.dtype == torch.float32, name  # the master copy the optimizer updates
        changed += int((weight.detach() != initial[name]).sum())
        total += weight.numel()
    assert changed / total >= 0.99, f"only {changed / total:.2%} of the weights moved"
    reference = module.reference
    assert all(p.dtype == torch.bfloat16 for p in reference.parameters())  # a bf16 copy, not the fp32 master
    assert all(torch.equal(p, initial[n].to(torch.bfloat16)) for n, p in reference.state_dict().items())


def test_lora_in_bf16_keeps_base_in_bf16_and_adapter_in_float32(random_model_dir):
    from llm_pg.models.loading import LoRA

    module = GRPOModule(model_name_or_path=random_model_dir, dtype="bfloat16", lora=LoRA(r=4, alpha=8))
    module.configure_model()
    dtypes = {n: p.dtype for n, p in module.policy.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert module.compute_dtype == torch.bfloat16


def test_a_bf16_lora_forward_without_peft_input_casts_is_bitwise_the_same(random_model_dir):
    # peft casts each adapter's bf16 input to its float32 weights, and autocast casts it back for the matmul: exact
    # both ways, so leaving the cast out (`autocast_forward`) changes no bit of the logits or the adapter's gradient,
    # and runs fewer copies (`aten::_to_copy` calls counted under the profiler).
    from llm_pg.models.loading import LoRA, autocast_forward

    module = GRPOModule(model_name_or_path=random_model_dir, dtype="bfloat16", lora=LoRA(r=4, alpha=8), kl_coef=0.0)
    module.configure_model()
    policy = module.policy
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # a zero B would hide the adapter's forward
    ids = torch.randint(0, 250, (3, 9), generator=torch.Generator().manual_seed(0))

    def run(context) -> tuple[torch.Tensor, torch.Tensor, int]:
        policy.zero_grad()
        with torch.profiler.profile() as prof, context():
            logits = policy(input_ids=ids).logits.float()
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])
        copies = sum(event.count for event in prof.key_averages() if event.key == "aten::_to_copy")
        return logits.detach(), grad, copies

    plain = run(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    lean = run(lambda: autocast_forward(policy, "cpu", torch.bfloat16))
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    assert plain[1].abs().sum() > 0 and lean[2] < plain[2]
    assert all(layer.cast_input_dtype_enabled for layer in policy.modules() if hasattr(layer, "lora_A"))  # restored


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_logprobs_run_in_the_compute_dtype(random_model_dir, dtype, expected):
    module = GRPOModule(model_name_or_path=random_model_dir, dtype=dtype, kl_coef=0.0)
    module.configure_model()
    seen = []
    hook = module.policy.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    ids = torch.tensor([[5, 6, 7, 8]])
    with module.autocast():
        module.policy(input_ids=ids)
    hook.remove()
    assert seen == [expected]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"amx_bf16"}, torch.bfloat16),
        ({"avx512f", "avx2"}, torch.float32),
    ],
)
def test_dtype_auto_follows_the_cpus_bf16_instructions(random_model_dir, monkeypatch, caplog, flags, expected):
    from llm_pg.models import loading

    assert loading.auto_dtype("cuda", set())[0] == torch.bfloat16  # a GPU: bf16 whatever the host CPU has
    monkeypatch.setattr(loading, "cpu_flags", lambda: flags)
    module = GRPOModule(model_name_or_path=random_model_dir, dtype="auto", kl_coef=0.0)
    with caplog.at_level("INFO"):
        module.configure_model()
    assert module.compute_dtype == expected
    said = "bfloat16 (this CPU has" if expected == torch.bfloat16 else "float32 (this CPU has none of amx_bf16"
    assert f"llm-pg: dtype auto: {said}" in caplog.text


def test_cpu_flags_reads_the_flags_line(tmp_path):
    from llm_pg.models.loading import cpu_flags

    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\nbugs\t\t: none\n")
    assert cpu_flags(str(tmp_path / "cpuinfo")) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
