"""Every `model.init_args` key is checked in the constructor, with one line naming the key, the value and a fix."""

import importlib.util
from dataclasses import asdict
from functools import partial

import pytest
import yaml

from llm_pg.core.objectives import CISPO, ClippedSurrogate, SequenceMean
from llm_pg.models.loading import LoRA
from llm_pg.modules import GRPOModule, ReinforceModule
from llm_pg.modules.groups import Evaluation

BAD = [  # (override, start of the message)
    ({"iterations": 0}, "model.iterations must be >= 1, got 0; "),
    ({"group_size": 1}, "model.group_size must be >= 2, got 1; "),
    ({"prompts_per_step": 0}, "model.prompts_per_step must be >= 1, got 0; "),
    ({"minibatch_size": 0}, "model.minibatch_size must be >= 1, got 0; "),
    ({"grad_accum_steps": 0}, "model.grad_accum_steps must be >= 1, got 0; "),
    ({"minibatch_size": 49}, "model.minibatch_size=49 is larger than one iteration's 48 rows"),
    ({"kl_coef": -0.1}, "model.kl_coef must be >= 0 and < 100, got -0.1; "),
    ({"kl_coef": 1e6}, "model.kl_coef must be >= 0 and < 100, got 1000000.0; "),
    ({"lr": 0.0}, "model.lr must be > 0 and < 1, got 0.0; "),
    ({"lr": float("nan")}, "model.lr must be > 0 and < 1, got nan; "),
    ({"lr": 1000.0}, "model.lr must be > 0 and < 1, got 1000.0; "),
    ({"lr": 1e38}, "model.lr must be > 0 and < 1, got 1e+38; "),
    ({"weight_decay": -0.01}, "model.weight_decay must be >= 0 and < 1, got -0.01; "),
    ({"weight_decay": 2.0}, "model.weight_decay must be >= 0 and < 1, got 2.0; "),
    ({"warmup_steps": -1}, "model.warmup_steps must be >= 0, got -1; "),
    ({"max_grad_norm": 0.0}, "model.max_grad_norm must be > 0, got 0.0; "),
    ({"adv_clip": 0.0}, "model.adv_clip must be > 0, got 0.0; "),
    ({"adv_clip": float("inf")}, "model.adv_clip must be > 0, got inf; "),
    ({"temperature": 0.0}, "model.temperature must be > 0 and < 100, got 0.0; "),
    ({"temperature": 1e9}, "model.temperature must be > 0 and < 100, got 1000000000.0; "),
    ({"max_skipped_iterations": 0}, "model.max_skipped_iterations must be an integer >= 1, got 0; "),
    ({"top_p": 1.5}, "model.top_p must be in (0, 1], got 1.5; "),
    ({"top_p": 0.0}, "model.top_p must be in (0, 1], got 0.0; "),
    ({"logprob_temperature": 0.0}, "model.logprob_temperature must be > 0, got 0.0; "),
    ({"max_new_tokens": 0}, "model.max_new_tokens must be >= 1, got 0; "),
    ({"min_new_tokens": 25}, "model.min_new_tokens must be in [0, max_new_tokens=24], got 25; "),
    ({"min_new_tokens": -1}, "model.min_new_tokens must be in [0, max_new_tokens=24], got -1; "),
    ({"max_prompt_tokens": 0}, "model.max_prompt_tokens must be >= 1, got 0; "),
    ({"evaluation": {"every": 0}}, "model.evaluation.every must be >= 1, got 0; "),
    ({"evaluation": {"max_new_tokens": 0}}, "model.evaluation.max_new_tokens must be >= 1, got 0; "),
    ({"evaluation": {"generate_batch_size": 0}}, "model.evaluation.generate_batch_size must be >= 1, got 0; "),
    ({"speed": {"logprob_batch_size": 0}}, "model.speed.logprob_batch_size must be >= 1, got 0; "),
    ({"speed": {"share_prompt_prefix": "yes"}}, "model.speed.share_prompt_prefix must be true or false, got 'yes'; "),
    ({"log_generations": {"every": -1}}, "model.log_generations.every must be >= 0, got -1; "),
    ({"log_generations": {"rows": 0}}, "model.log_generations.rows must be an integer >= 1, got 0; "),
    ({"evaluation": {"evry": 1}}, "model.evaluation.evry is not a key of evaluation; its keys: every, "),
    ({"clip_eps": 1.0}, "model.clip_eps must be in (0, 1), got 1.0; "),
    ({"seed": -1}, "model.seed must be >= 0, got -1; "),
    ({"dtype": "float16"}, "model.dtype must be one of ('float32', 'bfloat16'), got 'float16'; "),
    ({"dtype": "bf16"}, "model.dtype must be one of ('float32', 'bfloat16'), got 'bf16'; "),
    ({"advantage": "ppo"}, "model.advantage must be one of grpo, dr_grpo, rloo, reinforce_pp, got 'ppo'; "),
    (
        {"objective": {"class_path": "clip", "init_args": {}}},
        "model.objective must be an objective class (class_path) or a short name, got {'class_path'",
    ),
    ({"objective": "ppo"}, "model.objective must be one of clip, gspo, cispo, sequence_mean or a class of "),
    ({"filter_zero_std_groups": "yes"}, "model.filter_zero_std_groups must be true or false, got 'yes'; "),
    ({"mask_truncated": 1}, "model.mask_truncated must be true or false, got 1; "),
    ({"max_sampling_rounds": 0}, "model.max_sampling_rounds must be an integer >= 1, got 0; "),
    ({"max_sampling_rounds": 2.0}, "model.max_sampling_rounds must be an integer >= 1, got 2.0; "),
    (
        {"max_sampling_rounds": 3},
        "model.max_sampling_rounds=3 refills the groups that filter_zero_std_groups drops, but "
        "filter_zero_std_groups is false: ",
    ),
    ({"evaluation": {"samples": -1}}, "model.evaluation.samples must be an integer >= 0, got -1; "),
    ({"evaluation": {"samples": 2.5}}, "model.evaluation.samples must be an integer >= 0, got 2.5; "),
    ({"evaluation": {"temperature": 0.0}}, "model.evaluation.temperature must be > 0, got 0.0; "),
    ({"rollout_engine": "sglang"}, "model.rollout_engine must be one of hf, vllm, got 'sglang'; "),
    ({"vllm": {"gpu_memory_utilization": 1.0}}, "model.vllm.gpu_memory_utilization must be in (0, 1), got 1.0; "),
    ({"vllm": {"kv_cache_memory_bytes": 0}}, "model.vllm.kv_cache_memory_bytes must be >= 1, got 0; "),
    ({"vllm": {"max_num_batched_tokens": 0}}, "model.vllm.max_num_batched_tokens must be >= 1, got 0; "),
    ({"lora": LoRA(r=-1)}, "model.lora.r must be >= 0, got -1; "),
    ({"lora": LoRA(r=8, alpha=0)}, "model.lora.alpha must be > 0, got 0; "),
    ({"lora": LoRA(r=8, dropout=1.0)}, "model.lora.dropout must be in [0, 1), got 1.0; "),
    ({"lora": LoRA(r=8, target_modules=[])}, "model.lora.target_modules must be non-empty, got []; "),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[m.split(" must")[0].split("=")[0] for _, m in BAD])
def test_bad_value_names_key_value_and_fix(override, message):
    for module in (GRPOModule, ReinforceModule):
        with pytest.raises(ValueError) as error:
            module(model_name_or_path="tiny", **override)
        text = str(error.value)
        assert text.startswith(message), text
        assert "\n" not in text and len(text) > len(message) + 5  # one line, with a fix after the rule


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"ppo_epochs": 0}, "model.ppo_epochs must be >= 1, got 0"),
        ({"objective": "sequence_mean"}, "model.objective=SequenceMean has no ratio, and GRPO reuses each rollout"),
        ({"speed": {"reuse_first_pass_logp": "no"}}, "model.speed.reuse_first_pass_logp must be true or false"),
    ],
)
def test_grpo_keys(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOModule(model_name_or_path="tiny", **override)


def test_good_edge_values_pass():
    GRPOModule(
        model_name_or_path="tiny",
        min_new_tokens=24,
        max_prompt_tokens=1,
        log_generations={"every": 0, "rows": 1},
        kl_coef=0.0,
        logprob_temperature=None,
        dtype="bfloat16",
        lora=LoRA(r=0, dropout=0.0),
        objective=partial(CISPO, clip_eps_high=0.28, ratio_level="sequence", aggregation="seq_mean_token_sum_norm"),
        advantage="reinforce_pp",
        filter_zero_std_groups=True,
        mask_truncated=True,
        evaluation=Evaluation(samples=1, temperature=0.7, generate_batch_size=1),
    )


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        (partial(ClippedSurrogate, clip_eps_high=0.0), "model.objective.init_args.clip_eps_high must be > 0 or null"),
        (partial(CISPO, ratio_level="seq"), "model.objective.init_args.ratio_level must be one of token, sequence"),
        (partial(SequenceMean, aggregation="sum"), "model.objective.init_args.aggregation must be one of seq_mean_tok"),
        (partial(SequenceMean, entropy_coef=-0.1), "model.objective.init_args.entropy_coef must be >= 0 and < 1"),
    ],
)
def test_the_objectives_own_keys(objective, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReinforceModule(model_name_or_path="tiny", objective=objective)


def test_reinforce_takes_an_objective_with_a_ratio_and_then_needs_pi_old():
    assert not ReinforceModule(model_name_or_path="tiny").needs_pi_old
    module = ReinforceModule(model_name_or_path="tiny", objective="clip", clip_eps=0.1)
    assert module.needs_pi_old and module.objective.terms.clip_eps == 0.1 and module.epochs == 1


def test_vllm_engine_without_vllm_installed_says_how_to_install_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (.venv-vllm): tests/test_vllm.py covers the engine")
    with pytest.raises(ValueError) as error:
        GRPOModule(model_name_or_path="tiny", rollout_engine="vllm")
    text = str(error.value)
    assert text.startswith('model.rollout_engine=vllm but vLLM is not installed; pip install -e ".[vllm]"')
    assert "make test-vllm" in text and "\n" not in text


def test_the_saved_settings_show_the_objective_as_a_config_spells_it():
    # What the loggers and W&B show of a run (hparams_initial): the class path and the objective's own keys.
    module = GRPOModule(model_name_or_path="tiny", objective=partial(CISPO, clip_eps_high=0.28))
    assert module.hparams_initial["objective"] == {
        "class_path": "llm_pg.core.objectives.CISPO",
        "init_args": {
            "aggregation": "seq_mean_token_mean",
            "entropy_coef": 0.0,
            "clip_eps_high": 0.28,
            "ratio_level": "token",
        },
    }
    assert module.hparams_initial["ppo_epochs"] == 2 and module.hparams_initial["evaluation"] == asdict(Evaluation())
    saved = {k: v for k, v in module.hparams_initial.items() if k != "lora"}
    assert yaml.safe_load(yaml.safe_dump(saved)) == saved  # hparams.yaml loads with a safe loader
    default = ReinforceModule(model_name_or_path="tiny").hparams_initial["objective"]
    assert default["class_path"] == "llm_pg.core.objectives.SequenceMean"
