"""Configs, command lines and checkpoints from before the settings were grouped (2026-12-05) load in today's spelling
(`llm_pg.runs.spelling`), each move said once in one line; a key spelled both ways is refused naming both."""

import json

import pytest
import yaml
from conftest import ROOT

from llm_pg.cli.fit import main
from llm_pg.runs import spelling
from llm_pg.runs.config import class_defaults, config_changes
from llm_pg.runs.spelling import load_config, upgrade_args, upgrade_config

# The main job's checkpoint config as the code of 2026-12-04 stored it (read from its iter_00020.ckpt header): a
# resume from that checkpoint with today's config continued it bit for bit (the note of issue 40).
STORED = ROOT / "tests/fixtures/stored_config_before_groups.json"
MAIN_JOB = ROOT / "configs/tiny/format_copy_grpo.yaml"


def _printed(capsys, *words) -> tuple[dict, str]:
    with pytest.raises(SystemExit) as stop:
        main(["fit", *words, "--print_config"])
    assert stop.value.code in (0, None)
    out = capsys.readouterr()
    return yaml.safe_load(out.out), out.err


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(spelling, "_said", set())


def test_a_checkpoint_from_before_matches_todays_main_job(capsys):
    stored = json.loads(STORED.read_text())
    moves = upgrade_config(stored)
    assert "model.init_args.eval_every -> evaluation.every" in moves
    assert "model.init_args.policy_loss -> objective: ClippedSurrogate" in moves
    assert "model.init_args.loss_aggregation -> objective.init_args.aggregation" in moves
    args = stored["model"]["init_args"]
    assert args["evaluation"]["every"] == 5 and args["speed"]["logprob_batch_size"] == 32
    assert args["objective"]["class_path"] == "llm_pg.core.objectives.ClippedSurrogate"
    assert "tis_cap" not in args and "policy_loss" not in args and "eval_every" not in args
    current, _ = _printed(capsys, f"--config={MAIN_JOB}")
    for key in ("config", "ckpt_path", "overwrite"):  # what `plain_config` leaves out of a checkpoint's config
        current.pop(key, None)
    assert config_changes(stored, current, class_defaults(current)) == []
    current["model"]["init_args"]["evaluation"]["samples"] = 2  # a change the old spelling also held is still one
    assert config_changes(stored, current, class_defaults(current)) == ["model.init_args.evaluation.samples: 0 -> 2"]


def test_an_old_config_file_and_command_line_parse_as_the_new_spelling(capsys, tmp_path):
    old = dict(yaml.safe_load(MAIN_JOB.read_text()))
    args = old["model"]["init_args"]
    for group in ("evaluation", "speed", "log_generations", "objective"):
        args.pop(group, None)
    args |= {"eval_every": 5, "log_generations_every": 5, "logprob_batch_size": 16, "tis_cap": 1.5}
    args |= {"policy_loss": "clip", "ratio_level": "sequence", "clip_eps_high": 0.28}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    printed, err = _printed(capsys, f"--config={path}", "--model.init_args.eval_samples", "3")
    new = printed["model"]["init_args"]
    assert new["objective"] == {
        "class_path": "llm_pg.core.objectives.GSPO",
        "init_args": {"aggregation": "seq_mean_token_mean", "entropy_coef": 0.0, "clip_eps_high": 0.28},
    }
    assert new["correction"]["mode"] == "token_truncate" and new["correction"]["max"] == 1.5
    assert (new["evaluation"]["every"], new["evaluation"]["samples"], new["speed"]["logprob_batch_size"]) == (5, 3, 16)
    notes = [line for line in err.splitlines() if line.startswith("llm-pg: note:")]
    assert len(notes) == 2, err  # one line for the command line, one for the file
    assert "--model.init_args.eval_samples -> --model.init_args.evaluation.samples" in notes[0]
    assert "tis_cap: 1.5 -> correction: {mode: token_truncate, max: 1.5}" in notes[1]


def test_todays_configs_load_without_a_note(capsys):
    _, err = _printed(capsys, f"--config={MAIN_JOB}", "--model.init_args.objective=cispo")
    assert "note" not in err


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["--model.init_args.tis_cap", "2"], ["--model.init_args.correction.mode=token_truncate",
                                              "--model.init_args.correction.max=2"]),
        (["--model.init_args.policy_loss=cispo"], ["--model.init_args.objective=llm_pg.core.objectives.CISPO"]),
        (["--model.init_args.entropy_coef=0.1"], ["--model.init_args.objective.init_args.entropy_coef=0.1"]),
        (["--model.init_args.vllm_gpu_memory_utilization=0.5"], ["--model.init_args.vllm.gpu_memory_utilization=0.5"]),
        (["--data.eval_batch_size", "8"], ["--data.validate_batch_size=8"]),
        (["--model.init_args.objective", "gspo"], ["--model.init_args.objective=llm_pg.core.objectives.GSPO"]),
        (["--run_name", "clip", "--model.init_args.lr=1e-4"], ["--run_name", "clip", "--model.init_args.lr=1e-4"]),
        (["--model.objective", "cispo"], ["--model.objective=llm_pg.core.objectives.CISPO"]),
        (["--model.objective.help", "gspo"], ["--model.objective.help=llm_pg.core.objectives.GSPO"]),
        (["--model.eval_every", "5"], ["--model.evaluation.every=5"]),
        (["--model.init_args.tis_cap", "--seed", "1"], ["--model.init_args.tis_cap", "--seed", "1"]),  # no value
        (["--model.init_args.ratio_level=token"], []),  # the clipped surrogate's own
        (
            ["--model.init_args.ratio_level=sequence", "--model.init_args.policy_loss=cispo"],
            ["--model.init_args.objective=llm_pg.core.objectives.CISPO",
             "--model.init_args.objective.init_args.ratio_level=sequence"],
        ),
        (["--model.init_args.policy_loss=clip", "--model.init_args.ratio_level=sequence"],
         ["--model.init_args.objective=llm_pg.core.objectives.GSPO"]),
    ],
)  # fmt: skip
def test_old_flags_become_new_flags(words, expected):
    assert upgrade_args(["fit", *words]) == ["fit", *expected]


def test_what_the_old_spelling_refused_stays_refused():
    with pytest.raises(ValueError, match="sets tis_cap and sampler_is_mode"):
        upgrade_args(["--model.init_args.sampler_is_mode=token_mask", "--model.init_args.tis_cap", "2"])
    with pytest.raises(ValueError, match="sets tis_cap and sampler_is_mode or sampler_is_max"):
        upgrade_config({"model": {"init_args": {"tis_cap": 2.0, "sampler_is_max": 3.0}}})
    reinforce = {"class_path": "llm_pg.modules.ReinforceModule", "init_args": {"clip_eps_high": 0.28}}
    with pytest.raises(ValueError, match="for ReinforceModule, whose objective, sequence_mean, has no ratio"):
        upgrade_config({"model": reinforce})


def test_an_old_grpo_config_switched_to_reinforce_trains_reinforces_objective(capsys, tmp_path):
    old = yaml.safe_load(MAIN_JOB.read_text())
    old["model"]["init_args"] |= {"loss_aggregation": "seq_mean_token_mean", "entropy_coef": 0.0}  # the defaults
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    switch = "--model.class_path=llm_pg.modules.ReinforceModule"
    printed, err = _printed(capsys, f"--config={path}", switch)
    assert printed["model"]["init_args"]["objective"]["class_path"] == "llm_pg.core.objectives.SequenceMean"
    assert "loss_aggregation -> (the default)" in err
    printed, _ = _printed(capsys, f"--config={MAIN_JOB}", switch)  # today's main job names no objective either
    assert printed["model"]["init_args"]["objective"]["class_path"] == "llm_pg.core.objectives.SequenceMean"


def test_yaml_is_read_as_jsonargparse_reads_it_and_a_model_file_is_upgraded_too():
    assert load_config("run_name: 2026-12-05\nlr: 1e-3")["run_name"] == "2026-12-05"  # not a date
    model = load_config("class_path: llm_pg.modules.GRPOModule\ninit_args: {eval_every: 3, tis_cap: 1.5}")
    assert model["init_args"] == {"evaluation": {"every": 3}, "correction": {"mode": "token_truncate", "max": 1.5}}


def test_a_key_spelled_both_ways_is_refused_naming_both():
    config = {"model": {"init_args": {"eval_every": 5, "evaluation": {"every": 10}}}}
    with pytest.raises(ValueError, match=r"sets evaluation\.every and its old spelling eval_every both"):
        upgrade_config(config)
    config = {"model": {"init_args": {"policy_loss": "cispo", "objective": "clip"}}}
    with pytest.raises(ValueError, match="sets objective and its old spelling"):
        upgrade_config(config)


def test_a_reinforce_checkpoint_holding_the_retired_grpo_keys_resumes():
    # ReinforceModule took ppo_epochs (1 only) and three GRPO keys (None only) until 2026-12-03; its checkpoints hold
    # them, this run's config does not: no change. Another value (which the old code refused) would be one.
    kept = {"lr": 3e-4}
    retired = {"ppo_epochs": 1, "clip_eps_high": None, "ratio_level": None, "reuse_first_pass_logp": None}
    current = {"model": {"class_path": "llm_pg.modules.ReinforceModule", "init_args": kept}}
    stored = {"model": {"class_path": "llm_pg.modules.ReinforceModule", "init_args": kept | retired}}
    upgrade_config(stored)
    assert config_changes(stored, current) == []
    stored = {"model": {"class_path": "llm_pg.modules.ReinforceModule", "init_args": kept | retired}}
    stored["model"]["init_args"]["ppo_epochs"] = 2
    upgrade_config(stored)
    assert config_changes(stored, current) == ["model.init_args.ppo_epochs: 2 -> <unset>"]
