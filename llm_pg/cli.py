"""`llm-pg`: LightningCLI for `fit` / `validate`, plus the project's own commands.

llm-pg fit --config configs/tiny/format_copy_grpo.yaml [--model.init_args.kl_coef 0.1] [--seed 1]
llm-pg validate --config configs/tiny/format_copy_grpo.yaml     # the pre-RL baseline alone
llm-pg pretrain-tiny [--out DIR]                                # remake the bundled tiny model
llm-pg eval-tiny                                                # base metrics of the tiny model
llm-pg sweep FILE | report RUN_DIR... | bundle RUN_DIR... --out FILE.zip
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from llm_pg.callbacks import IterationCheckpoint
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.loggers import default_loggers
from llm_pg.modules.base import PolicyGradientModule


class LLMPGCLI(LightningCLI):
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

    def before_instantiate_classes(self) -> None:
        from lightning.pytorch import seed_everything

        config = self.config[self.subcommand] if self.subcommand else self.config
        seed_everything(config.seed, workers=True, verbose=False)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if config.run_name is None:
            config.run_name = _default_run_name(config)
        config.trainer.default_root_dir = str(Path(config.runs_root) / config.run_name)
        if self.subcommand == "fit":  # evaluation during fit is the EvalCallback's, by iteration
            config.trainer.limit_val_batches = 0
            config.trainer.num_sanity_val_steps = 0

    def instantiate_trainer(self, **kwargs):
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if config.trainer.logger in (None, True):
            resume = self.subcommand == "fit" and config.get("ckpt_path") is not None
            kwargs["logger"] = default_loggers(
                config.trainer.default_root_dir, config.run_name, config.wandb_project, resume
            )
        return super().instantiate_trainer(**kwargs)


def _default_run_name(config) -> str:
    """`tiny_format_copy_grpo` for configs/tiny/format_copy_grpo.yaml, seed appended when not 0."""
    paths = [str(p) for p in (config.get("config") or [])]
    if paths:
        path = Path(paths[-1])
        name = f"{path.parent.name}_{path.stem}" if path.parent.name != "configs" else path.stem
    else:
        name = "run"
    return name if config.seed == 0 else f"{name}_seed{config.seed}"


def run_cli(args: list[str] | None = None) -> LLMPGCLI:
    return LLMPGCLI(
        PolicyGradientModule,
        PromptGroupDataModule,
        subclass_mode_model=True,
        seed_everything_default=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"log_every_n_steps": 1, "max_epochs": -1, "enable_model_summary": False},
        args=args,
    )


COMMANDS = {  # llm-pg <command>: the project's own commands beside LightningCLI's fit/validate
    "pretrain-tiny": "llm_pg.tiny.pretrain",
    "eval-tiny": "llm_pg.tiny.evaluate",
    "sweep": "llm_pg.sweep",
    "report": "llm_pg.report",
    "bundle": "llm_pg.bundle",
}


def main(argv: list[str] | None = None) -> None:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in COMMANDS:
        import importlib

        sys.exit(importlib.import_module(COMMANDS[words[0]]).main(words[1:]))
    run_cli(argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
