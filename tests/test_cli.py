"""Every shipped config instantiates, bad settings fail early with a message naming the key, and a run shows its
progress in RL iterations."""

import csv
import importlib.util
from pathlib import Path

import pytest
from conftest import ROOT, fit

from llm_pg.cli.fit import LLMPGCLI, run_cli
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.models import real_model
from llm_pg.modules import PolicyGradientModule

CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_there_are_configs_for_every_task_and_algorithm():
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS}
    for required in [
        "format_copy/grpo.yaml",
        "format_copy/reinforce.yaml",
        "math_hard/grpo.yaml",
        "math_hard/reinforce.yaml",
        "tiny/format_copy_grpo.yaml",
        "tiny/format_copy_reinforce.yaml",
        "tiny/arith_grpo.yaml",
        "tiny/arith_reinforce.yaml",
    ]:
        assert required in names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_config_instantiates_without_loading_weights(tmp_path, monkeypatch, config):
    assert config.read_text().startswith("# llm-pg fit --config"), "a config opens with the command that runs it"
    # The real-model configs name a model `llm-pg real-model NAME` prepares: a cache holding only its manifest stands
    # in (the name resolves at parse time, the weights only in configure_model).
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path / "cache"))
    for name in real_model.MODELS:
        real_model.model_dir(name).mkdir(parents=True)
        (real_model.model_dir(name) / real_model.MANIFEST).write_text("{}")
    # The vLLM variants need vLLM to instantiate; without it, their HF twin (tests/test_vllm_configs.py checks them).
    engine = ["--model.init_args.rollout_engine=hf"] if config.stem.endswith("_vllm") and not HAS_VLLM else []
    cli = LLMPGCLI(
        PolicyGradientModule,
        PromptGroupDataModule,
        subclass_mode_model=True,
        seed_everything_default=False,
        run=False,
        args=[
            f"--config={config}",
            "--trainer.accelerator=cpu",
            f"--runs_root={tmp_path}",
            "--wandb_project=null",
            *engine,
        ],
    )
    assert cli.model.policy is None  # weights load in configure_model, not at parse time
    assert cli.model.hparams.prompts_per_step == cli.datamodule.prompts_per_step  # linked once
    assert cli.model.hparams.seed == cli.datamodule.seed


# The course's four required runs: each command of hw4/README.md (berkeleydeeprlcourse/homework_spring2026) over the
# defaults of hw4/hw4/config.py. `--steps` -> iterations, `--batch_size` -> prompts_per_step, `--eval_interval` ->
# eval_every, `--save_interval` -> every_n_iterations; temperature/top_p/warmup/max_prompt_tokens/adv_clip/LoRA/
# weight_decay are config.py defaults where a command does not pass them (format_copy passes no temperature or
# top_p; math_hard passes no --warmup_steps, so config.py's 100 applies).
COURSE_LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.05,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
COURSE_COMMON = {
    "model_name_or_path": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "lr": 3e-5,
    "kl_coef": 0.05,
    "max_grad_norm": 0.5,
    "adv_clip": 5.0,
    "weight_decay": 0.0,
    "temperature": 0.8,
    "top_p": 0.95,
    "logprob_temperature": 1.0,
    "max_prompt_tokens": 512,
    "minibatch_size": 8,
}
COURSE_RUNS = {
    # --task format_copy --algo grpo --steps 51 --batch_size 8 --group_size 6 --min_new_tokens 1 --max_new_tokens 24
    # --lr 3e-5 --ppo_epochs 2 --minibatch_size 8 --grad_accum_steps 6 --clip_eps 0.2 --kl_coef 0.05
    # --max_grad_norm 0.5 --eval_interval 50 --save_interval 50 --warmup_steps 10
    "format_copy/grpo.yaml": {
        "class": "GRPOModule",
        "iterations": 51,
        "prompts": 8,
        "group_size": 6,
        "min_new_tokens": 1,
        "max_new_tokens": 24,
        "ppo_epochs": 2,
        "grad_accum_steps": 6,
        "clip_eps": 0.2,
        "warmup_steps": 10,
        "eval_every": 50,
        "save": 50,
    },
    # --task format_copy --algo reinforce: the same without --ppo_epochs and --clip_eps
    "format_copy/reinforce.yaml": {
        "class": "ReinforceModule",
        "iterations": 51,
        "prompts": 8,
        "group_size": 6,
        "min_new_tokens": 1,
        "max_new_tokens": 24,
        "ppo_epochs": None,
        "grad_accum_steps": 6,
        "clip_eps": None,
        "warmup_steps": 10,
        "eval_every": 50,
        "save": 50,
    },
    # --task math_hard --algo reinforce --steps 201 --batch_size 8 --group_size 8 --min_new_tokens 8
    # --max_new_tokens 512 --max_prompt_tokens 512 --temperature 0.8 --top_p 0.95 --lr 3e-5 --minibatch_size 8
    # --grad_accum_steps 8 --max_grad_norm 0.5 --kl_coef 0.05 --eval_interval 100 --save_interval 100
    "math_hard/reinforce.yaml": {
        "class": "ReinforceModule",
        "iterations": 201,
        "prompts": 8,
        "group_size": 8,
        "min_new_tokens": 8,
        "max_new_tokens": 512,
        "ppo_epochs": None,
        "grad_accum_steps": 8,
        "clip_eps": None,
        "warmup_steps": 100,
        "eval_every": 100,
        "save": 100,
    },
    # --task math_hard --algo grpo --steps 501 ... (as REINFORCE) ... --ppo_epochs 2 --clip_eps 0.2
    "math_hard/grpo.yaml": {
        "class": "GRPOModule",
        "iterations": 501,
        "prompts": 8,
        "group_size": 8,
        "min_new_tokens": 8,
        "max_new_tokens": 512,
        "ppo_epochs": 2,
        "grad_accum_steps": 8,
        "clip_eps": 0.2,
        "warmup_steps": 100,
        "eval_every": 100,
        "save": 100,
    },
}


@pytest.mark.parametrize("name", COURSE_RUNS)
def test_real_configs_are_the_course_commands(name):
    import yaml

    run = COURSE_RUNS[name]
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert config["model"]["class_path"] == f"llm_pg.modules.{run['class']}"
    args = config["model"]["init_args"]
    assert args["lora"] == COURSE_LORA
    for key, value in COURSE_COMMON.items():
        assert args[key] == value, key
    for key in ("iterations", "group_size", "min_new_tokens", "max_new_tokens", "grad_accum_steps"):
        assert args[key] == run[key], key
    for key in ("warmup_steps", "ppo_epochs", "clip_eps"):
        assert args.get(key) == run[key], key
    assert args["evaluation"]["every"] == run["eval_every"]
    assert config["data"]["prompts_per_step"] == run["prompts"]
    assert config["checkpoint"]["every_n_iterations"] == run["save"]
    # One optimizer step per pass, as in the course: prompts x G rows = minibatch x accumulation.
    assert run["prompts"] * run["group_size"] == args["minibatch_size"] * args["grad_accum_steps"]


def test_ablation_sweep_overrides_keys_of_the_grpo_reference():
    import yaml

    sweep = yaml.safe_load((ROOT / "configs/sweeps/grpo_format_copy_ablation.yaml").read_text())
    base = yaml.safe_load((ROOT / sweep["base"]).read_text())
    assert sweep["base"] == "configs/format_copy/grpo.yaml"
    for name, overrides in sweep["runs"].items():
        changed = 0
        for key, value in overrides.items():
            section, *path = key.split(".")
            node = base[section]
            for part in path:
                assert part in node, f"{name}: {key} is not a key of {sweep['base']}"
                node = node[part]
            changed += node != value
        assert changed or name == "reference", f"{name} changes nothing of {sweep['base']}"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.init_args.minibatch_size=0", "model.minibatch_size must be >= 1"),
        ("--model.init_args.grad_accum_steps=0", "model.grad_accum_steps must be >= 1"),
        ("--model.init_args.minibatch_size=64", "larger than one iteration's 8 rows"),
        ("--model.init_args.group_size=1", "model.group_size must be >= 2"),
        ("--model.init_args.model_name_or_path=./no/such/model", "no model directory at './no/such/model'"),
        ("--model.init_args.kl_coef=-1", "model.kl_coef must be >= 0 and < 100"),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, "tiny", override)


def test_unknown_task_is_a_config_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, "tiny", "--data.task=llm_pg.data.tasks.NoSuchTask")
    assert "data.task" in capsys.readouterr().err


def test_validate_reports_the_baseline(tmp_path, random_model_dir):
    cli = run_cli(
        [
            "validate",
            f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
            f"--model.init_args.model_name_or_path={random_model_dir}",
            "--data.task.init_args.eval_size=4",
            f"--runs_root={tmp_path}",
            "--wandb_project=null",
        ]
    )
    assert cli.trainer.callback_metrics["eval/exact_match"] == 0.0  # a random model copies nothing
    assert Path(cli.trainer.default_root_dir).name == "tiny_format_copy_grpo"


def test_progress_bar_counts_iterations_and_shows_reward_and_eval_em(tmp_path, random_model_dir, monkeypatch):
    """Two iterations, then a resume to four with the bar on: it counts 4/4, not `Epoch 0/-2 ... 2/--`."""
    from llm_pg.callbacks.progress import IterationProgressBar

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # a terminal, as rich tells one
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", "--model.init_args.evaluation.every=2")
    resume = ("--ckpt_path=last", "--model.init_args.iterations=4", "--trainer.enable_progress_bar=true")
    cli = fit(tmp_path, random_model_dir, "--model.init_args.evaluation.every=2", *resume)
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, IterationProgressBar)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.description, task.completed, task.total) == ("iteration", 4, 4)
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    reward = [float(r["train/reward"]) for r in rows if r["train/reward"]]
    em = {int(float(r["step"])): float(r["eval/exact_match"]) for r in rows if r["eval/exact_match"]}
    assert len(reward) == 4 and sorted(em) == [0, 2, 4]
    # The bar's last values: iteration 4's reward and the final evaluation's EM (as the summary prints them).
    assert bar.get_metrics(cli.trainer, cli.model) == pytest.approx({"reward": reward[-1], "eval_em": em[4]})


def test_wandb_offline_prints_nothing_of_its_own(tmp_path, monkeypatch, capfd):
    """W&B's banner, sync hint and the `anonymous` warning all stay out; the run's summary gives the sync command."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from llm_pg.cli.summary import offline_wandb_dir
    from llm_pg.runs.loggers import default_loggers

    loggers = default_loggers(str(tmp_path), "run", "llm_pg_test")
    run = loggers[1].experiment
    run.log({"train/reward": 1.3})
    trainer = type("Trainer", (), {"loggers": loggers})()
    assert offline_wandb_dir(trainer).parent == tmp_path / "wandb"
    run.finish()
    printed = capfd.readouterr()
    assert "wandb" not in printed.out + printed.err


def test_a_runs_wandb_id_is_kept_in_its_dir_new_for_each_fresh_start_and_the_path_hash_for_an_old_run(tmp_path):
    """`run_wandb_id`: a fresh start draws a new id and writes it to `<run dir>/wandb_id`; a resume reads it back; a
    fresh start in a new directory at the same path (after `--overwrite true`) draws another; a run from before the
    file resumes under the path hash it was logged with; junk in the file is not taken as an id."""
    import re

    from llm_pg.runs.loggers import path_wandb_id, run_wandb_id

    run = tmp_path / "run"
    run.mkdir()
    first = run_wandb_id(run, "proj", resume=False)
    assert re.fullmatch(r"[0-9a-f]{16}", first) and (run / "wandb_id").read_text() == first + "\n"
    assert first != path_wandb_id(run, "proj")
    assert run_wandb_id(run, "proj", resume=True) == first
    run.rename(tmp_path / "run.old-1")  # what --overwrite true does, then a new directory
    run.mkdir()
    assert run_wandb_id(run, "proj", resume=False) not in (first, path_wandb_id(run, "proj"))
    old = tmp_path / "old"  # a run that logged to W&B before the file: its W&B run holds the path hash
    (old / "wandb" / f"offline-run-20261201_120000-{path_wandb_id(old, 'proj')}").mkdir(parents=True)
    assert run_wandb_id(old, "proj", resume=True) == path_wandb_id(old, "proj") == (old / "wandb_id").read_text()[:-1]
    never = tmp_path / "never"  # resumed with W&B on after a start without it: no W&B run to continue
    never.mkdir()
    assert run_wandb_id(never, "proj", resume=True) != path_wandb_id(never, "proj")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "wandb_id").write_text("../../etc x\n" * 1000)
    assert re.fullmatch(r"[0-9a-f]{16}", run_wandb_id(junk, "proj", resume=True))
    assert (junk / "wandb_id").read_text() != "../../etc x\n" * 1000


def test_validate_gets_a_wandb_id_of_its_own_run(tmp_path):
    """`llm-pg validate` logs to W&B under an id derived from the run's (read, not written): two runs at the same
    path (one overwritten) validate into two W&B runs."""
    from llm_pg.runs.loggers import path_wandb_id, run_wandb_id, validate_wandb_id

    run = tmp_path / "run"
    run.mkdir()
    assert validate_wandb_id(run, "proj") == path_wandb_id(run / "validate", "proj")  # a run without an id
    assert not (run / "wandb_id").exists()  # read, never written
    first_run = run_wandb_id(run, "proj", resume=False)
    first = validate_wandb_id(run, "proj")
    assert first == validate_wandb_id(run, "proj") and first not in (first_run, path_wandb_id(run / "validate", "proj"))
    (run / "wandb_id").write_text("0123456789abcdef\n")  # another run at the same path (after --overwrite true)
    assert validate_wandb_id(run, "proj") not in (first, "0123456789abcdef")


def test_csv_logger_does_not_warn_on_a_fresh_run_dir_and_other_warnings_still_show(tmp_path):
    import warnings

    from llm_pg.runs.loggers import ResumableCSVLogger

    (tmp_path / ".lock").write_text("1 host\n")  # what `llm_pg.runs.directory.claim` leaves in a fresh run dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ResumableCSVLogger(str(tmp_path)).experiment.log_metrics({"train/reward": 1.3}, step=1)
        warnings.warn("a warning of the run's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of the run's own"]


def test_outside_a_terminal_progress_is_plain_lines(tmp_path, random_model_dir, monkeypatch, capsys):
    """Where stdout is no terminal (Modal's logs, CI) a rich bar draws once, at the end: plain lines instead, at
    most one per interval and one after the last iteration, counting from the checkpoint's iteration after a resume."""
    import llm_pg.callbacks.progress as progress

    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    monkeypatch.setattr(progress, "LINE_EVERY_S", 3600.0)  # an hour: only the last iteration's line
    bar = "--trainer.enable_progress_bar=true"
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", "--model.init_args.evaluation.every=2", bar)
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1:3] for line in first] == [["3/3", "(100%)"]]
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a line after every iteration
    resume = ("--ckpt_path=last", "--model.init_args.iterations=5", bar)
    cli = fit(tmp_path, random_model_dir, "--model.init_args.evaluation.every=2", *resume)
    assert isinstance(cli.trainer.progress_bar_callback, progress.IterationLines)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1:3] for line in lines] == [["4/5", "(80%)"], ["5/5", "(100%)"]]  # the resumed attempt
    assert "s/it" in lines[1] and "ETA 0:00:00" in lines[1]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rewards = [float(r["train/reward"]) for r in csv.DictReader(f) if r["train/reward"]]
    assert len(rewards) == 5 and f"reward {rewards[-1]:.3f}" in lines[1] and "eval_em " in lines[1]


def test_validate_a_trained_run_evaluates_its_last_checkpoint(tmp_path, capsys):
    """`validate --ckpt_path last` loads the run's checkpoint (not the base model): its completions are the final
    evaluation's, word for word, and its EM is the run's final EM; they go to validate/eval/, the run's files stay."""
    import json

    common = [
        f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}",
        "--data.task.init_args.eval_size=8",
        f"--runs_root={tmp_path}",
        "--run_name=run",
        "--wandb_project=null",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.lr=0.001",
    ]
    run_cli(["fit", *common, "--model.init_args.iterations=3"])
    run = tmp_path / "run"
    final = [json.loads(line) for line in (run / "eval" / "iter_00003.jsonl").read_text().splitlines()]
    base = [json.loads(line) for line in (run / "eval" / "iter_00000.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in final] != [r["completion"] for r in base]  # training changed the policy
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "validate" not in p.parts}
    cli = run_cli(["validate", *common, "--ckpt_path=last"])
    assert f"evaluating {run / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().out
    validated = [json.loads(line) for line in (run / "validate" / "eval" / "iter_00003.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in validated] == [r["completion"] for r in final]
    em = sum(r["correct"] for r in final) / len(final)
    assert float(cli.trainer.callback_metrics["eval/exact_match"]) == pytest.approx(em)
    assert {p: p.read_bytes() for p in before} == before


def test_validate_without_a_checkpoint_to_load_is_one_line(tmp_path):
    from llm_pg.runs.directory import RunDirError

    args = ["validate", f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}", f"--runs_root={tmp_path}"]
    with pytest.raises(RunDirError, match=r"no checkpoint in .* to validate; .*leave out --ckpt_path"):
        run_cli([*args, "--ckpt_path=last", "--wandb_project=null"])
    with pytest.raises(RunDirError, match="keeps no best checkpoint"):
        run_cli([*args, "--ckpt_path=best", "--wandb_project=null"])


def test_the_default_run_name_is_the_same_from_any_working_directory(tmp_path, monkeypatch):
    """`--config config.yaml` from its own folder used to give `_config` (the relative path has no parent name)."""
    from llm_pg.runs.names import default_run_name

    (tmp_path / "mytask").mkdir()
    config = tmp_path / "mytask" / "config.yaml"
    monkeypatch.chdir(tmp_path / "mytask")
    here = default_run_name("config.yaml", 0)
    monkeypatch.chdir("/")
    elsewhere = default_run_name(str(config), 2)
    assert (here, elsewhere) == ("mytask_config", "mytask_config_seed2")
