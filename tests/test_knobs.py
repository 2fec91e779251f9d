"""Issue 29's options, each against its published formula in float64, at its default bit for bit the old path, and
in a 2-iteration run: the learning-rate decay, the entropy bonus, CISPO, DAPO's soft overlong punishment, the four
importance corrections against the sampler and the off-policy sequence mask (dynamic sampling's refill is in
tests/test_variants.py and tests/test_ddp.py; the sequence-level corrections' run, which needs vLLM, in
tests/test_vllm.py)."""

import csv
import inspect
import math
import textwrap
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import fit
from safetensors.torch import load_file

from llm_pg.core.advantages import overlong_penalty
from llm_pg.core.chunked_logprobs import chunked_target_logprobs
from llm_pg.core.correction import off_policy_keep, sampler_is_weight
from llm_pg.core.losses import cispo_loss, differentiable_entropy, entropy_bonus, grpo_loss
from llm_pg.core.objectives import ClippedSurrogate, SequenceMean
from llm_pg.core.rollout import MicroBatch
from llm_pg.core.schedule import lr_factor
from llm_pg.modules import GRPOModule, ReinforceModule
from llm_pg.modules.groups import Correction
from llm_pg.runs.config import config_changes

VARIED = ["--data.task=test_variants.VariedTask", "--data.task.init_args.eval_size=4"]


def _train_rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    return sorted((r for r in rows if "train/reward" in r), key=lambda r: r["step"])


# ---- learning-rate schedule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [0, 1, 3, 7])
def test_the_constant_schedule_is_the_old_warmup_ramp_exactly(warmup):
    for step in range(20):
        old = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        assert lr_factor(step, warmup, 20) == old  # ==: the default path's rates are the same floats


@pytest.mark.parametrize("warmup", [0, 4])
def test_linear_and_cosine_decay_match_transformers_after_warmup(warmup):
    from transformers import get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup

    total = 20
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    linear = get_linear_schedule_with_warmup(optimizer, warmup, total).lr_lambdas[0]
    cosine = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=0.1).lr_lambdas[0]
    for step in range(warmup, total + 1):
        assert lr_factor(step, warmup, total, "linear") == pytest.approx(linear(step), abs=1e-12)
        assert lr_factor(step, warmup, total, "cosine", 0.1) == pytest.approx(cosine(step), abs=1e-12)
    # A floor under the linear decay: floor + (1 - floor)(1 - p), p = (step - warmup) / (total - warmup).
    p = (15 - warmup) / (total - warmup)
    assert lr_factor(15, warmup, total, "linear", 0.2) == pytest.approx(0.2 + 0.8 * (1 - p), abs=1e-15)
    assert lr_factor(10**6, warmup, total, "cosine", 0.2) == pytest.approx(0.2, abs=1e-15)  # held at the floor


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr_schedule": "exponential"}, "model.lr_schedule must be one of constant, linear, cosine"),
        ({"min_lr_ratio": 1.5, "lr_schedule": "cosine"}, "model.min_lr_ratio must be in [0, 1]"),
        ({"min_lr_ratio": 0.1}, "model.min_lr_ratio=0.1 means nothing with lr_schedule 'constant'"),
        ({"overlong_buffer": 30, "max_new_tokens": 24}, "model.overlong_buffer must be an integer in [0, max_new"),
        ({"overlong_penalty": -1.0}, "model.overlong_penalty must be >= 0"),
        ({"objective": "ppo"}, "model.objective must be one of clip, gspo, cispo, sequence_mean"),
    ],
)
def test_bad_values_are_one_line_errors(settings, message):
    with pytest.raises(ValueError) as error:
        GRPOModule(model_name_or_path="tiny", **settings)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_reinforce_takes_the_base_knobs_but_not_ppo_epochs():
    objective = partial(SequenceMean, entropy_coef=0.01)
    module = ReinforceModule(model_name_or_path="tiny", lr_schedule="cosine", objective=objective, overlong_buffer=4)
    assert (module.hparams.lr_schedule, module.objective.entropy_coef, module.hparams.overlong_buffer) == (
        "cosine",
        0.01,
        4,
    )
    with pytest.raises(TypeError):
        ReinforceModule(model_name_or_path="tiny", ppo_epochs=2)


def test_a_decaying_schedule_refuses_a_resume_with_other_iterations():
    stored = {"model": {"init_args": {"iterations": 10, "lr_schedule": "cosine"}}}
    current = {"model": {"init_args": {"iterations": 20, "lr_schedule": "cosine"}}}
    assert config_changes(stored, current) == ["model.init_args.iterations: 10 -> 20"]
    for tree in (stored, current):
        tree["model"]["init_args"]["lr_schedule"] = "constant"
    assert config_changes(stored, current) == []  # a constant rate: training longer is allowed, as before


def test_a_cosine_run_logs_the_decaying_rate(tmp_path, random_model_dir):
    args = ["--model.init_args.iterations=4", "--model.init_args.lr_schedule=cosine", "--model.init_args.lr=1e-3"]
    fit(tmp_path, random_model_dir, *args, "--model.init_args.min_lr_ratio=0.1", *VARIED)
    rates = [r["train/lr"] for r in _train_rows(tmp_path / "run")]
    expected = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4))) for k in range(4)]
    assert rates == pytest.approx(expected, rel=1e-6)


# ---- entropy bonus ---------------------------------------------------------------------------------------------


def test_chunked_entropy_gradient_is_the_autograd_gradient_in_float64():
    torch.manual_seed(0)
    hidden = torch.randn(10, 6, requires_grad=True)  # the head runs in float32; the reference in float64
    weight = torch.randn(13, 6, requires_grad=True)
    targets = torch.randint(0, 13, (10,))
    g_logp, g_h = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    for temperature in (1.0, 0.7):
        logp, entropy = chunked_target_logprobs(hidden, weight, targets, temperature, 3, entropy_grad=True)
        ours = torch.autograd.grad((logp.double() * g_logp + entropy.double() * g_h).sum(), (hidden, weight))
        h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        log_p = torch.log_softmax(h64 @ w64.t() / temperature, -1)  # [n, V] float64, by the formula
        ref_logp, ref_h = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
        reference = torch.autograd.grad((ref_logp * g_logp + ref_h * g_h).sum(), (h64, w64))
        assert torch.allclose(entropy.double(), ref_h, atol=1e-5) and torch.allclose(logp.double(), ref_logp, atol=1e-5)
        for a, b in zip(ours, reference, strict=True):
            assert torch.allclose(a.double(), b, atol=1e-4)
        plain = differentiable_entropy(hidden @ weight.t(), temperature)  # the plain head's path, same values
        assert torch.allclose(plain.double(), ref_h, atol=1e-5)


def test_without_the_bonus_the_chunked_gradient_is_unchanged_bit_for_bit():
    torch.manual_seed(1)
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(17, 8, requires_grad=True)
    targets = torch.randint(0, 17, (9,))
    grads = []
    for entropy_grad in (False, True):  # True with no use of the entropy: a zero entropy gradient
        logp, _ = chunked_target_logprobs(hidden, weight, targets, 1.0, 4, True, entropy_grad)
        grads.append(torch.autograd.grad(logp.sum(), (hidden, weight)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_entropy_bonus_is_the_coefficient_times_the_token_mean():
    entropy = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # The micro-batch's token mean (as the KL term): 18 over 5 tokens, whatever the rows' lengths.
    assert entropy_bonus(entropy, mask, 0.1).item() == pytest.approx(0.1 * 18 / 5, abs=1e-15)
    assert entropy_bonus(entropy, mask, 0.1, "token_mean", 10.0).item() == pytest.approx(0.1 * 18 / 10, abs=1e-15)


def test_an_entropy_bonus_run_logs_its_term_and_moves_the_weights_differently(tmp_path, random_model_dir):
    runs = {}
    for name, coef in (("plain", "0.0"), ("bonus", "0.5")):
        fit(
            tmp_path / name,
            random_model_dir,
            "--model.init_args.iterations=2",
            f"--model.init_args.objective.init_args.entropy_coef={coef}",
            *VARIED,
        )
        runs[name] = _train_rows(tmp_path / name / "run")
    assert all("train/entropy_bonus" not in r for r in runs["plain"])  # the default logs what it logged before
    for row in runs["bonus"]:
        assert row["train/entropy_bonus"] == pytest.approx(0.5 * row["train/entropy"], rel=1e-5)
    assert runs["bonus"][0]["train/loss"] != runs["plain"][0]["train/loss"]
    # The bonus has a gradient: with a detached entropy the loss would only shift and the weights would be equal.
    plain, bonus = (load_file(tmp_path / name / "run" / "final" / "model.safetensors") for name in ("plain", "bonus"))
    assert plain.keys() == bonus.keys() and any(not torch.equal(plain[k], bonus[k]) for k in plain)
    assert runs["bonus"][0]["train/reward"] == runs["plain"][0]["train/reward"]  # the same first rollout


# ---- CISPO -----------------------------------------------------------------------------------------------------


def _tensors():
    torch.manual_seed(3)
    logp = (torch.randn(4, 5, dtype=torch.float64) * 0.3 - 1.0).requires_grad_()
    old = logp.detach() + torch.randn(4, 5, dtype=torch.float64) * 0.4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    ref = logp.detach() + torch.randn(4, 5, dtype=torch.float64) * 0.2
    return logp, old, mask, advantages, ref


def test_cispo_is_its_formula_in_float64():
    logp, old, mask, advantages, ref = _tensors()
    loss, stats = cispo_loss(logp, old, mask, advantages, ref, clip_eps_high=0.28, kl_coef=0.05)
    rho = torch.exp(logp.detach() - old)
    weight = torch.minimum(rho, torch.full_like(rho, 1.28))
    per_token = weight * advantages[:, None] * logp
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    lengths = mask.sum(1)
    by_hand = -((per_token * mask).sum(1) / lengths).mean() + 0.05 * (kl * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-12)
    # The gradient flows through log pi only, at the capped weight, also where the ratio passed the bound.
    (grad,) = torch.autograd.grad(loss - 0.05 * (kl * mask).sum() / mask.sum(), logp)
    expected = -(weight * advantages[:, None] * mask) / lengths[:, None] / 4
    assert torch.allclose(grad, expected, atol=1e-12)
    capped = ((rho > 1.28) & (advantages[:, None] > 0) & mask).sum() / mask.sum()
    assert stats["clip_fraction"].item() == pytest.approx(capped.item(), abs=1e-12) and capped > 0
    assert stats["clip_fraction_low"].item() == 0.0


def test_the_default_objective_is_grpos_clipped_surrogate(tmp_path, random_model_dir):
    logp, old, mask, advantages, ref = _tensors()
    assert type(GRPOModule(model_name_or_path="tiny").objective) is ClippedSurrogate
    cispo, _ = cispo_loss(logp, old, mask, advantages, ref, 0.2, 0.05)
    clip, _ = grpo_loss(logp, old, mask, advantages, ref, 0.2, 0.05)
    assert cispo.item() != clip.item()  # different objectives on off-policy tokens
    rows = {}
    for loss in ("clip", "cispo"):
        fit(
            tmp_path / loss,
            random_model_dir,
            "--model.init_args.iterations=2",
            f"--model.init_args.objective={loss}",
            *VARIED,
        )
        rows[loss] = _train_rows(tmp_path / loss / "run")
    assert len(rows["cispo"]) == 2 and all(r["train/clip_fraction_low"] == 0 for r in rows["cispo"])
    # The same first rollout, another objective: GRPO's surrogate is ~0 at rho = 1, CISPO's is -A logp.
    assert rows["cispo"][0]["train/reward"] == rows["clip"][0]["train/reward"]
    assert rows["cispo"][0]["train/policy_loss"] != rows["clip"][0]["train/policy_loss"]


def _trl_loss(
    loss_type, logp, old, mask, advantages, ref, beta, epsilon_high, entropy=None, entropy_coef=0.0, **changes
):
    """TRL 1.16's GRPOTrainer._compute_loss on these tensors: the trainer's attributes it reads, on a namespace
    (`changes`: other attribute values; `inputs_<key>` ones go into the inputs)."""
    trl = pytest.importorskip("trl", minversion="1.16")
    accelerator = SimpleNamespace(
        num_processes=1,
        sync_gradients=True,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
    )
    entropies = torch.zeros_like(logp) if entropy is None else entropy
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=accelerator,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _entropy_bonus_enabled=entropy is not None, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list)},
    )  # fmt: skip
    for name, value in changes.items():
        if not name.startswith("inputs_"):
            setattr(trainer, name, value)
    inputs = {
        "prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "completion_ids": torch.zeros(4, 5, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().float(),
    }  # fmt: skip
    inputs |= {name.removeprefix("inputs_"): value for name, value in changes.items() if name.startswith("inputs_")}
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs)


def test_cispo_and_the_entropy_bonus_equal_trl_on_the_same_tensors():
    logp, old, mask, advantages, ref = _tensors()
    ours, _ = cispo_loss(logp, old, mask, advantages, ref, clip_eps_high=0.28, kl_coef=0.04, aggregation="token_mean")
    theirs = _trl_loss("cispo", logp, old, mask, advantages, ref, beta=0.04, epsilon_high=1.28)  # TRL caps at 1.28
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    entropy = torch.rand(4, 5, dtype=torch.float64) * 3
    with_bonus = ours - entropy_bonus(entropy, mask, 0.01, "token_mean")
    theirs = _trl_loss("cispo", logp, old, mask, advantages, ref, 0.04, 1.28, entropy=entropy, entropy_coef=0.01)
    assert with_bonus.item() == pytest.approx(theirs.item(), abs=1e-12)


# ---- importance correction against the sampler, off-policy sequence masking -------------------------------------

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _sampler_tensors():
    """pi_old and a sampler that differs from it by up to ~1.5 nats a token, so every mode's bounds bind somewhere."""
    logp, old, mask, advantages, ref = _tensors()
    torch.manual_seed(5)
    sampler = old + torch.randn(4, 5, dtype=torch.float64) * 0.6
    return logp, old, sampler, mask, advantages, ref


def _reference_weight(old, sampler, mask, mode, high, low):
    """The weight of each token by the definition, one float at a time (math.exp of sums, the bounds compared)."""
    rows, width = old.shape
    out = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        tokens = [t for t in range(width) if mask[i, t]]
        diffs = {t: float(old[i, t] - sampler[i, t]) for t in tokens}
        for t in range(width):
            w = math.exp(sum(diffs.values())) if mode.startswith("sequence") else math.exp(diffs.get(t, 0.0))
            inside = w <= high and (low is None or w >= low)
            if mode.endswith("truncate"):
                w = min(max(w, low if low is not None else w), high)
            elif not inside:
                w = 0.0
            out[i, t] = w
    return out


@pytest.mark.parametrize("low", [None, 0.6])
@pytest.mark.parametrize("mode", MODES)
def test_each_importance_mode_is_its_definition_in_float64(mode, low):
    _, old, sampler, mask, _, _ = _sampler_tensors()
    weight = sampler_is_weight(old, sampler, mask, mode, high=1.3, low=low)
    assert weight.shape == ((4, 1) if mode.startswith("sequence") else (4, 5))
    reference = _reference_weight(old, sampler, mask, mode, 1.3, low)
    torch.testing.assert_close(weight.expand(4, 5)[mask], reference[mask], rtol=1e-12, atol=0)
    bound = (weight == 1.3) | (weight == 0) | ((weight == 0.6) if low else torch.zeros_like(weight, dtype=torch.bool))
    assert bound.any() and not bound.all()  # the bounds bind on some tokens or rows, not on all: the check has teeth


def _trl_is_ratio(mode, old, sampler, mask, clip_max, clip_min):
    """TRL 1.16's importance weight, computed inline in `GRPOTrainer._generate_and_score_completions`: that block of
    TRL's own source, run on these tensors (no copy of it here; the test fails if TRL moves or changes it)."""
    trl = pytest.importorskip("trl", minversion="1.16")
    source = textwrap.dedent(inspect.getsource(trl.GRPOTrainer._generate_and_score_completions))
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "per_token_logps_diff = (old_per_token_logps" in line) - 1
    end = next(i for i, line in enumerate(lines) if "Compute the per-token log probabilities for the reference" in line)
    block = textwrap.dedent("\n".join(lines[start:end]))
    trainer = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=clip_max,
        vllm_importance_sampling_clip_min=clip_min,
    )
    scope = {"self": trainer, "completion_mask": mask.to(old.dtype), "tool_mask": None, "torch": torch, "math": math}
    scope |= {"old_per_token_logps": old, "sampling_per_token_logps": sampler}
    exec(block, scope)  # TRL's own code, from the installed package
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("low", [None, 0.6])
@pytest.mark.parametrize("mode", MODES)
def test_each_importance_mode_and_its_loss_equal_trl_on_the_same_tensors(mode, low):
    logp, old, sampler, mask, advantages, ref = _sampler_tensors()
    ours = sampler_is_weight(old, sampler, mask, mode, high=1.3, low=low)
    theirs = _trl_is_ratio(mode, old, sampler, mask, clip_max=1.3, clip_min=low)
    trl = pytest.importorskip("trl")
    torch.testing.assert_close(ours.expand(4, 5)[mask], theirs.expand(4, 5)[mask], rtol=1e-12, atol=0)
    # The loss: TRL multiplies its per-token loss by the weight (and the off-policy mask) before adding the KL term.
    keep = off_policy_keep(advantages, logp, sampler, mask, threshold=0.1)
    loss, _ = grpo_loss(
        logp, old, mask, advantages, ref, 0.2, 0.04, aggregation="token_mean", clip_eps_high=0.28, is_weight=ours * keep
    )
    trl_loss = _trl_loss(
        "dapo", logp, old, mask, advantages, ref, beta=0.04, epsilon_high=0.28, use_vllm=True,
        vllm_importance_sampling_correction=True, off_policy_mask_threshold=0.1,
        get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask, inputs_importance_sampling_ratio=theirs,
        inputs_sampling_per_token_logps=sampler,
    )  # fmt: skip
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-12)


def test_off_policy_mask_is_deepseeks_rule_and_equals_trls():
    logp, _, sampler, mask, advantages, _ = _sampler_tensors()
    gap = [float((sampler[i] - logp[i].detach())[mask[i]].mean()) for i in range(4)]  # mean log pi_sampler / pi_theta
    for threshold in (-1.0, 0.0, 0.3, 10.0):
        keep = off_policy_keep(advantages, logp, sampler, mask, threshold)
        expected = [0.0 if advantages[i] < 0 and gap[i] > threshold else 1.0 for i in range(4)]
        assert keep.view(-1).tolist() == expected
        trl = pytest.importorskip("trl", minversion="1.16")
        theirs = trl.GRPOTrainer.get_off_policy_mask(advantages[:, None], logp, sampler, mask.double(), threshold)
        assert theirs.view(-1).tolist() == expected
    assert off_policy_keep(advantages, logp, sampler, mask, -1.0).view(-1).tolist() == [1.0, 0.0, 1.0, 0.0]  # A < 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "sequence_mask"}, "model.correction.mode='sequence_mask' corrects for a rollout engine"),
        ({"min": 0.5}, "model.correction.min / correction.max bound the weight of correction.mode, which is null"),
        ({"mode": "token_mask", "max": 0.9}, "model.correction.max must be >= 1, got 0.9; "),
        ({"mode": "token_mask", "min": 0.0}, "model.correction.min must be in (0, 1] or null"),
        ({"mode": "tokens"}, "model.correction.mode must be one of token_truncate, token_mask, "),
        ({"off_policy_mask_threshold": -0.1}, "model.correction.off_policy_mask_threshold must be >= 0, got -0.1; "),
    ],
)
def test_bad_correction_settings_are_one_line_errors(settings, message):
    with pytest.raises(ValueError) as error:
        GRPOModule(model_name_or_path="tiny", correction=settings)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_reinforce_on_its_own_samples_refuses_the_off_policy_mask():
    with pytest.raises(
        ValueError, match=r"^model\.correction\.off_policy_mask_threshold is set, but an objective without a ratio"
    ):
        ReinforceModule(model_name_or_path="tiny", correction={"off_policy_mask_threshold": 0.5})
    lax = Correction(off_policy_mask_threshold=0.5)
    assert GRPOModule(model_name_or_path="tiny", correction=lax).sampler_correction is None
    assert ReinforceModule(model_name_or_path="tiny", correction=lax, objective="clip").needs_pi_old  # has a ratio


def test_the_defaults_weigh_nothing_and_token_truncate_is_tis():
    module = GRPOModule(model_name_or_path="tiny")
    _, old, sampler, mask, advantages, _ = _sampler_tensors()
    rows = SimpleNamespace(old_logp=old, sampled_logp=sampler, completion_mask=mask, advantages=advantages)
    micro = MicroBatch(rows, old)
    assert module.objective.policy_weight(old, micro) == (None, None)  # is_weight=None: the course's path
    capped = GRPOModule(model_name_or_path="tiny", correction=Correction(mode="token_truncate", max=1.5))
    weight, _ = capped.objective.policy_weight(old, micro)
    assert torch.equal(weight, sampler_is_weight(old, sampler, mask, "token_truncate", 1.5))


def test_hf_runs_with_a_token_mode_or_a_lax_off_policy_mask_equal_a_plain_run_bitwise(tmp_path, random_model_dir):
    # With HF the sampler is pi_old: every token weight is exactly 1, and a mask threshold no sequence reaches keeps
    # every row, so both runs end bit for bit where the plain run does, and log their figures.
    common = ["--model.init_args.iterations=2", *VARIED]
    runs = {
        "plain": [],
        "mask": ["--model.init_args.correction.mode=token_mask", "--model.init_args.correction.min=0.5"],
        "lax": ["--model.init_args.correction.off_policy_mask_threshold=100"],
    }
    weights, rows = {}, {}
    for name, extra in runs.items():
        fit(tmp_path / name, random_model_dir, *common, *extra)
        weights[name] = load_file(tmp_path / name / "run" / "final" / "model.safetensors")
        rows[name] = _train_rows(tmp_path / name / "run")
    for name in ("mask", "lax"):
        assert all(torch.equal(weights["plain"][k], weights[name][k]) for k in weights["plain"]), name
    assert [(r["rollout/tis_weight_mean"], r["rollout/tis_masked_frac"]) for r in rows["mask"]] == [(1.0, 0.0)] * 2
    assert [r["train/off_policy_masked_frac"] for r in rows["lax"]] == [0.0, 0.0]


def test_a_tight_off_policy_mask_drops_rows_in_the_second_epoch(tmp_path, random_model_dir):
    # GRPO with HF: pi_sampler = pi_old. The first epoch is on-policy (gap 0: nothing dropped); in the second the
    # policy has moved, and negative-advantage rows it now likes less than pi_old did (gap > 0) leave the policy term.
    mask = "--model.init_args.correction.off_policy_mask_threshold=0"
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", mask, "--model.init_args.lr=3e-3", *VARIED)
    rows = _train_rows(tmp_path / "run")
    assert all(0 < r["train/off_policy_masked_frac"] < 0.5 for r in rows), rows  # a mean over both epochs


# ---- overlong punishment ---------------------------------------------------------------------------------------


def test_overlong_penalty_is_dapos_soft_punishment():
    lengths = torch.tensor([5, 15, 16, 18, 20])
    penalty = overlong_penalty(lengths, max_new_tokens=20, buffer=5, penalty=1.0)
    # L <= 20 - 5: nothing; then -(L - 15) / 5, down to -1 at 20 tokens (a completion that never ended).
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0], abs=1e-7)
    assert overlong_penalty(lengths, 20, 5, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.1, -0.3, -0.5], abs=1e-7)


def test_an_overlong_run_adds_its_reward_column(tmp_path, random_model_dir):
    # The random model seldom says EOS: most of its completions run to max_new_tokens and earn the full punishment.
    args = [
        "--model.init_args.iterations=2",
        "--model.init_args.overlong_buffer=4",
        "--model.init_args.overlong_penalty=0.5",
    ]
    fit(tmp_path, random_model_dir, *args, *VARIED)
    rows = _train_rows(tmp_path / "run")
    for row in rows:
        assert -0.5 <= row["train/reward_overlong"] < 0
        assert row["train/reward"] == pytest.approx(row["train/reward_value"] + row["train/reward_overlong"], abs=1e-5)
