"""`llm-pg`: LightningCLI for `fit` / `validate`, plus the project's own commands.

llm-pg fit --config configs/tiny/format_copy_grpo.yaml [--model.init_args.kl_coef 0.1] [--seed 1]
llm-pg fit --config ... --ckpt_path last        # continue the run from its newest checkpoint that verifies
llm-pg fit --config ... --overwrite true        # start afresh; the old run is moved to <run dir>.old-<time>
llm-pg validate --config configs/tiny/format_copy_grpo.yaml     # the pre-RL baseline alone
llm-pg sweep FILE | report RUN_DIR... | bundle RUN_DIR... --out FILE.zip | pretrain-tiny | eval-tiny
llm-pg --help                                                   # every command, one line each

A config error prints one line and exits 2 (`--debug` or LLM_PG_DEBUG=1: the traceback); SIGTERM / SIGINT
save the finished iteration and exit 143 / 130 with the command that resumes the run.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import set_loader
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException

from llm_pg.callbacks import IterationCheckpoint, progress_bar
from llm_pg.callbacks.checkpoint import (
    NoChecksum,
    VerifiedCheckpointIO,
    check_checkpoint_dir,
    newest_verified,
    read_header,
    stored_data_fingerprint,
    usable,
    usable_header,
    verify,
)
from llm_pg.cli.console import silence_known_noise
from llm_pg.cli.summary import finish_run
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.data.user_code import add_config_dirs
from llm_pg.modules.base import PolicyGradientModule
from llm_pg.modules.settings import grpo_key_hint
from llm_pg.runs.config import class_defaults, config_changes, plain_config
from llm_pg.runs.directory import RunDirError, RunLock, claim, is_rank_zero, mark_complete, trained_contents
from llm_pg.runs.guards import RunStopped
from llm_pg.runs.loggers import default_loggers, run_wandb_id, uses_wandb, validate_wandb_id
from llm_pg.runs.logs import trim_logs
from llm_pg.runs.names import checked_run_path, default_run_name
from llm_pg.runs.preflight import check_model, check_task_data, not_a_mapping, one_line
from llm_pg.runs.spelling import load_config, upgrade_args, upgrade_config

# Config files through the spelling shim: a config from before the settings were grouped loads, with a note.
set_loader("llm_pg", load_config, exceptions=(yaml.YAMLError,))
PARSER_KWARGS = {"parser_mode": "llm_pg", **{command: {"parser_mode": "llm_pg"} for command in ("fit", "validate")}}


def _debug() -> bool:
    return os.environ.get("LLM_PG_DEBUG", "") not in ("", "0")


class OneLineErrorParser(LightningArgumentParser):
    """Parse errors as one line on stderr and exit 2, instead of the usage text and the whole config."""

    def error(self, message: str, ex: Exception | None = None):
        if _debug() or not self.exit_on_error:
            return super().error(message, ex)
        if str(message).startswith("Unexpected config"):
            message = not_a_mapping(sys.argv[1:]) or message
        message = grpo_key_hint(one_line(message))
        sys.stderr.write(f"llm-pg: error: {message} (--debug: details)\n")
        sys.exit(2)


def without_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` without each of `flags` and its value, given as `--flag value` or `--flag=value`."""
    kept: list[str] = []
    skip_value = False
    for word in args:
        if skip_value:
            skip_value = False
        elif word in flags:
            skip_value = True
        elif not word.startswith(tuple(f"{flag}=" for flag in flags)):
            kept.append(word)
    return kept


LIGHTNING_LIMITS = {  # the Trainer arguments that end `fit` early, and the value that sets no limit
    "max_steps": -1,
    "max_time": None,
    "max_epochs": -1,
    "fast_dev_run": False,
}


def check_no_lightning_limit(trainer: Any, iterations: int) -> None:
    """Refuse a Lightning limit that would end `fit` before `iterations`: the run would stop with exit 0 and
    `final/`, looking finished. A run's length is `model.init_args.iterations`; stopping early is SIGTERM's job."""
    for key, unlimited in LIGHTNING_LIMITS.items():
        value = trainer.get(key, unlimited)
        if value in (unlimited, None) or (isinstance(value, int) and value < 0):  # a negative: Lightning's error
            continue
        raise ValueError(
            f"trainer.{key}={value!r} would stop the run before its model.init_args.iterations={iterations} and "
            f"leave it looking finished; a run's length is model.init_args.iterations: set that, and drop "
            f"trainer.{key} (to stop a run and continue it later, send SIGTERM or Ctrl-C: it saves, then resume "
            "with --ckpt_path last)"
        )


class RunInterrupted(Exception):
    """SIGTERM/SIGINT stopped `fit` between iterations, after saving the last finished one."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RunSession:
    """What one `llm-pg fit` holds besides the trainer: the run dir's lock and the checkpoint callback."""

    def __init__(self, args: list[str] | None) -> None:
        self.args = list(sys.argv[1:] if args is None else args)
        self.locks: list[RunLock] = []
        self.checkpoint: IterationCheckpoint | None = None
        self.resume_iteration: int | None = None
        self.run_config: dict[str, Any] | None = None
        self.fitting = False  # past set-up: a ValueError now is a bug to show in full, not a config error

    def interrupted(self, default_signal: int = signal.SIGINT) -> RunInterrupted:
        signum = (self.checkpoint.received_signal if self.checkpoint else None) or default_signal
        name = signal.Signals(signum).name
        words = without_flags(self.args, ("--ckpt_path", "--overwrite"))
        saved = self.checkpoint.saved_iteration if self.checkpoint else None
        where = f"iteration {saved} is saved in last.ckpt" if saved is not None else "no iteration finished"
        message = f"llm-pg: stopped by {name}; {where}. Resume: llm-pg {shlex.join(words)} --ckpt_path last"
        return RunInterrupted(message, 128 + signum)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()


class LLMPGCLI(LightningCLI):
    def __init__(self, *args, session: RunSession | None = None, **kwargs) -> None:
        if kwargs.get("args") is not None:  # a command line from before the settings were grouped, for every caller
            kwargs["args"] = upgrade_args(list(kwargs["args"]))
        self.session = session or RunSession(kwargs.get("args"))
        self.summary: dict[str, Any] | None = None  # the end-of-run numbers (`llm_pg.cli.summary.summarize_run`)
        kwargs.setdefault("parser_class", OneLineErrorParser)
        kwargs.setdefault("parser_kwargs", PARSER_KWARGS)  # config files through the spelling shim
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """`fit` and `validate` only: this trainer's steps need a rollout, which `test` and `predict` never make."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--seed", type=int, default=0, help="Derives every seed of the run (data, sampling, init).")
        parser.add_argument(
            "--run_name",
            type=str | None,
            default=None,
            help="Run dir: <runs_root>/<run_name> (default: from the config).",
        )
        parser.add_argument("--runs_root", type=str, default="runs", help="Folder that holds the run directories.")
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help="fit into a run dir that holds a run: move the old run to <dir>.old-<time> and start afresh.",
        )
        parser.add_argument(
            "--wandb_project",
            type=str | None,
            default="llm_pg",
            help="W&B project, offline without a key; null: no W&B.",
        )
        parser.add_argument(
            "--torch_threads", type=int | None, default=None, help="CPU threads for torch (tiny runs: 1 is fastest)."
        )
        parser.link_arguments("seed", "data.seed")
        parser.link_arguments("seed", "model.init_args.seed")
        parser.link_arguments("data.prompts_per_step", "model.init_args.prompts_per_step")
        parser.add_lightning_class_args(IterationCheckpoint, "checkpoint")

    def _parse_ckpt_path(self) -> None:
        """Lightning copies a checkpoint file's saved hyperparameters over the command line here (`--ckpt_path
        FILE`), so a run would train with the checkpoint's `lr` and length, not the user's, and the settings check
        would compare the checkpoint with itself. Not here: the command line is what a run trains with, for a file
        as for `last`, and `_prepare_run` refuses a checkpoint trained under other settings, naming the keys."""
        return

    def before_instantiate_classes(self) -> None:
        from lightning.pytorch import seed_everything

        config = self.config[self.subcommand] if self.subcommand else self.config
        seed_everything(config.seed, workers=True, verbose=False)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if config.run_name is None:
            config.run_name = default_run_name((config.get("config") or [None])[-1], config.seed)
        directory = checked_run_path(config.runs_root, config.run_name, bool(config.get("overwrite")))  # a name, inside
        config.trainer.default_root_dir = str(directory)
        check_checkpoint_dir(config.get("checkpoint"), directory)
        if config.trainer.get("logger") not in (None, True, False):  # its directory would be where the run writes
            raise RunDirError(
                "trainer.logger: a run logs into its own directory (metrics.csv, and W&B with --wandb_project), which "
                "a logger of your own would move elsewhere; leave trainer.logger unset (false: no metrics.csv)"
            )
        if config.get("ckpt_path") is not None and not str(config.ckpt_path).strip():
            raise RunDirError("--ckpt_path is empty; give last (the run's newest checkpoint) or a checkpoint file")
        if self.subcommand == "fit":  # evaluation during fit is the EvalCallback's, by iteration
            check_no_lightning_limit(config.trainer, config.model.init_args.iterations)
            config.trainer.limit_val_batches = 0
            config.trainer.num_sanity_val_steps = 0
        elif self.subcommand == "validate" and config.ckpt_path is not None:  # a trained run's checkpoint
            self._validate_checkpoint(config)

    def _validate_checkpoint(self, config) -> None:
        """`llm-pg validate --ckpt_path last` (or a path): the run's newest usable checkpoint, trained under this
        config; Lightning's own `last`/`best` look for a ModelCheckpoint this trainer does not keep."""
        directory = Path(config.trainer.default_root_dir)
        if str(config.ckpt_path) == "best":
            raise RunDirError("--ckpt_path best: this trainer keeps no best checkpoint; give last or a checkpoint path")
        path = _resolve_checkpoint(str(config.ckpt_path), directory / "checkpoints", True, "evaluating")
        if path is None:
            raise RunDirError(
                f"no checkpoint in {directory / 'checkpoints'} to validate; check --run_name / --runs_root, or leave "
                "out --ckpt_path to evaluate the base model"
            )
        self._check_trained_with(path, plain_config(config))
        config.ckpt_path = str(path)

    @staticmethod
    def _check_trained_with(path: Path, current: dict[str, Any]) -> int:
        """The iteration of checkpoint `path`; RunDirError when it was trained under other settings than `current`."""
        iteration, stored = read_header(path)
        if stored is not None:
            upgrade_config(stored, stored=True)  # a checkpoint from before the groups: its keys in today's spelling
            changes = config_changes(stored, current, class_defaults(current))
            if changes:
                raise RunDirError(
                    f"{path} was trained with other settings: {'; '.join(changes)}. Resume with the settings it was "
                    "trained with, or start a new run (--run_name)"
                )
        return iteration

    def _check_same_data(self, path: Path) -> None:
        """RunDirError when the task's data (its fingerprint, `Task.data_fingerprint`) differs from the data the
        checkpoint was trained on: the rest of the run would train on other rows than its first part."""
        task = self.datamodule.task
        stored, current = stored_data_fingerprint(path), task.data_fingerprint()
        if stored is not None and stored != current:
            raise RunDirError(
                f"data.task: the data ({task.data_source()}) is not the data {path} was trained on (its rows' "
                f"fingerprint {stored[:12]} is now {str(current)[:12]}); resume with the data it was trained on, or "
                "start a new run (--run_name)"
            )

    def _preflight(self, config) -> None:
        """Before the run dir is touched (the module's and the datamodule's constructors have checked their keys):
        the task's data, the tokenizer and the LoRA targets (`llm_pg.runs.preflight`), each failure one line."""
        check_task_data(self.datamodule.task)
        check_model(self.model.hparams, self.model.lora, self.datamodule.task)

    def _prepare_run(self, config) -> None:
        """Own the run dir, pick the checkpoint to resume from, check it was trained under this config, and
        drop what iterations after it logged. DDP ranks other than zero only pick the same checkpoint."""
        directory = Path(config.trainer.default_root_dir)
        owner = is_rank_zero()
        if owner:
            self.session.locks.append(claim(directory, config.ckpt_path is not None, config.overwrite))
        self.session.run_config = plain_config(config)
        if config.ckpt_path is None:
            return
        path = _resolve_checkpoint(str(config.ckpt_path), directory / "checkpoints", announce=owner)
        if path is None:
            trained = trained_contents(directory, _first_save(config.checkpoint, directory))
            if trained:  # never start afresh over a trained run: its results would be replaced
                raise RunDirError(
                    f"run dir {directory} holds a trained run ({', '.join(trained)}) but no checkpoint to continue "
                    "from; --overwrite true moves it aside and starts afresh, or pick a new --run_name"
                )
            config.ckpt_path = None
            if owner:
                print(f"llm-pg: no checkpoint in {directory / 'checkpoints'}: starting afresh", flush=True)
                trim_logs(directory, None)
            return
        foreign = path.resolve().parent != (directory / "checkpoints").resolve()
        if foreign and trained_contents(directory, _first_save(config.checkpoint, directory)):
            raise RunDirError(  # resuming another run's checkpoint here would trim and overwrite this run
                f"--ckpt_path {path} is not this run's, and run dir {directory} holds a trained run; continue from it "
                "in a new --run_name"
            )
        config.ckpt_path = str(path)
        iteration = self._check_trained_with(path, self.session.run_config)
        self._check_same_data(path)
        self.session.resume_iteration = iteration
        if owner:
            trim_logs(directory, iteration, final=iteration >= config.model.init_args.iterations)

    def instantiate_trainer(self, **kwargs):
        """Settings first (the module's and datamodule's constructors have run; the trainer's keys are checked by
        building it), then the task's data, and only then the run directory (`_prepare_run`)."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if self.subcommand == "fit":
            self._preflight(config)
        if config.trainer.logger in (None, True):
            log_dir = Path(config.trainer.default_root_dir)
            if self.subcommand not in (None, "fit"):  # `validate` must not replace a trained run's metrics.csv
                log_dir = log_dir / self.subcommand
                log_dir.mkdir(parents=True, exist_ok=True)  # before W&B starts in it (it warns of a missing dir)
            run_id = None
            if self.subcommand == "validate" and uses_wandb(config.wandb_project):
                run_id = validate_wandb_id(config.trainer.default_root_dir, config.wandb_project)
            kwargs["logger"] = default_loggers(str(log_dir), config.run_name, config.wandb_project, run_id)
        if not config.trainer.get("plugins"):
            kwargs["plugins"] = [VerifiedCheckpointIO()]
        if config.trainer.get("enable_progress_bar") is not False:
            kwargs["callbacks"] = [*(config.trainer.get("callbacks") or []), progress_bar()]
        try:
            trainer = super().instantiate_trainer(**kwargs)  # writes nothing to the run dir yet
        except (MisconfigurationException, TypeError, ValueError) as error:  # Lightning's check of a trainer key
            message = one_line(str(error))
            accelerator = config.trainer.get("accelerator")
            if "`" not in message and accelerator not in (None, "auto"):  # e.g. "No supported gpu backend found!"
                message = f"accelerator={accelerator}: {message} Use --trainer.accelerator auto (or cpu) here"
            raise ValueError(f"trainer.{message}; see `llm-pg fit --help` for the trainer keys") from None
        if self.subcommand == "fit":
            self._prepare_run(self.config[self.subcommand])  # the parsed config (plain values), not the objects
            config.ckpt_path = self.config[self.subcommand].ckpt_path  # what fit resumes from, as resolved
            if config.trainer.logger in (None, True) and is_rank_zero() and uses_wandb(config.wandb_project):
                # the run's own W&B id, now that the run dir is ours and it is known whether the run resumes
                run_id = run_wandb_id(log_dir, config.wandb_project, resume=config.ckpt_path is not None)
                trainer.loggers = default_loggers(str(log_dir), config.run_name, config.wandb_project, run_id)
        checkpoint = config.get("checkpoint")
        if isinstance(checkpoint, IterationCheckpoint):
            checkpoint.run_config = self.session.run_config
            self.session.checkpoint = checkpoint
        if self.session.checkpoint is not None:
            trainer.callbacks.insert(0, self.session.checkpoint.save_before_rollout)
        return trainer

    def before_fit(self) -> None:
        self.session.fitting = True

    def after_fit(self) -> None:
        """`COMPLETE` once the run reached its final iteration and wrote `final/`; then the run's report and summary."""
        trainer, module = self.trainer, self.model
        directory = Path(trainer.default_root_dir)
        if module.stop_reason is not None:  # diverged: saved and logged, but neither final/ nor COMPLETE
            raise RunStopped(module.stop_reason)
        if not trainer.is_global_zero or trainer.state.status != TrainerStatus.FINISHED:
            return
        if module.iteration >= module.hparams.iterations and (directory / "final").is_dir():
            mark_complete(directory, module.iteration)
        self.summary = finish_run(trainer, directory)


def _resolve_checkpoint(ckpt_path: str, directory: Path, announce: bool, verb: str = "resuming from") -> Path | None:
    """`last`: the newest checkpoint in `directory` that verifies (None when there is none at all); a path: that
    file, if it verifies. Lightning's other names (`best`, `hpc`) are not used by these runs. `announce`: print the
    damaged ones passed over and `llm-pg: <verb> <path>`."""
    if ckpt_path != "last":
        reason = verify(ckpt_path)
        if isinstance(reason, NoChecksum):
            reason = usable_header(ckpt_path)
        elif reason is None:
            reason = usable(ckpt_path)
        if reason is not None:
            raise RunDirError(f"--ckpt_path {ckpt_path}: {reason}; give another checkpoint or --ckpt_path last")
        return Path(ckpt_path)
    path, skipped = newest_verified(directory)  # verified, and its header passes the safe loader
    if announce:
        for note in skipped:
            print(f"llm-pg: {note}", flush=True)
    if path is None and skipped:
        raise RunDirError(f"no checkpoint in {directory} verifies; start afresh with --overwrite true")
    if announce and path is not None:
        print(f"llm-pg: {verb} {path}", flush=True)
    return path


def _first_save(cadence, directory: Path) -> int:
    """The first iteration the run in `directory` wrote a checkpoint for: the smaller of `last_every_n_iterations`
    and `every_n_iterations`, the larger of this command's value and the run's own (its config.yaml: the cadence
    may change on resume), so a run killed in its first checkpoint write is replayed, not refused."""
    import yaml

    first = min(cadence.last_every_n_iterations, cadence.every_n_iterations)
    try:
        stored = yaml.safe_load((directory / "config.yaml").read_text()).get("checkpoint") or {}
        first = max(first, min(int(stored["last_every_n_iterations"]), int(stored["every_n_iterations"])))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError):
        pass  # no readable config.yaml: this command's cadence
    return first


def run_cli(args: list[str] | None = None, session: RunSession | None = None) -> LLMPGCLI:
    """LightningCLI on `args` (None: sys.argv). Raises RunInterrupted when SIGTERM/SIGINT stopped `fit`."""
    session = session or RunSession(args)
    try:
        return LLMPGCLI(
            PolicyGradientModule,
            PromptGroupDataModule,
            subclass_mode_model=True,
            seed_everything_default=False,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"log_every_n_steps": 1, "max_epochs": -1, "enable_model_summary": False},
            args=args,
            session=session,
        )
    except SIGTERMException as error:
        raise session.interrupted(signal.SIGTERM) from error
    except SystemExit as error:  # Lightning's exit(1) after a second Ctrl-C
        if session.checkpoint is not None and session.checkpoint.received_signal is not None:
            raise session.interrupted() from error
        raise
    finally:
        session.release()


def main(argv: list[str] | None = None) -> None:
    words = sys.argv[1:] if argv is None else list(argv)
    silence_known_noise()
    if "--debug" in words:
        words.remove("--debug")
        os.environ["LLM_PG_DEBUG"] = "1"
    try:
        words = upgrade_args(words)  # a command line from before the settings were grouped
    except ValueError as error:
        print(f"llm-pg: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    add_config_dirs(words)  # modules named in a config resolve beside it (llm_pg.data.user_code)
    session = RunSession(words)
    sys.argv[1:] = words  # LightningCLI reads sys.argv itself (and warns when given args that differ from it)
    try:
        run_cli(None, session)
    except RunInterrupted as stop:
        print(stop, file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except RunStopped as stop:  # diverged, or a reward that is not a finite number: nothing marked complete
        if _debug():
            raise
        print(f"llm-pg: run stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except ValueError as error:  # a constructor's check, a run-dir or checkpoint refusal: the sentence is enough
        if _debug() or session.fitting:
            raise
        print(f"llm-pg: error: {one_line(str(error))} (--debug: details)", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
