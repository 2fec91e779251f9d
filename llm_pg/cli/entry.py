"""`llm-pg`, the console script: answers `--help` and the project's own commands without loading the trainer.

`llm-pg --help`, `llm-pg sweep|report|bundle|pretrain-tiny|eval-tiny ...` import only the command's own module
(each keeps torch, Lightning and transformers inside the functions that need them), so their help answers at once.
`fit` and `validate` go to `llm_pg.cli.fit.main` (LightningCLI), which is imported only then. This module imports
nothing but the standard library (tests/test_entry.py checks `sys.modules`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# llm-pg <command>: (what it does, the module whose `main(argv)` runs it; None: LightningCLI's own subcommand)
COMMANDS: dict[str, tuple[str, str | None]] = {
    "fit": ("train a policy with RL: llm-pg fit --config configs/tiny/format_copy_grpo.yaml", None),
    "validate": ("greedy evaluation on the task's eval set: the pre-RL baseline", None),
    "sweep": ("run a sweep file's runs here, one after another (finished ones skipped)", "llm_pg.cli.sweep"),
    "report": ("plots, a comparison table and sampled generations from run directories", "llm_pg.cli.report"),
    "bundle": ("zip the configs, metrics, generations and final weights of runs", "llm_pg.cli.bundle"),
    "real-model": (
        "prepare the real model offline: model_name_or_path: smollm2-135m-instruct",
        "llm_pg.models.real_model",
    ),
    "pretrain-tiny": ("remake the bundled tiny CPU model (llm_pg/assets/tiny-chat)", "llm_pg.tiny.pretrain"),
    "eval-tiny": ("measure the tiny model's base metrics on the tiny tasks", "llm_pg.tiny.evaluate"),
}

HELP = (
    "usage: llm-pg <command> [options]      llm-pg <command> --help: the command's options\n\n"
    "RL fine-tuning of language models from verifiable rewards (GR-REINFORCE, GRPO) on PyTorch Lightning.\n\n"
    "commands:\n"
    + "".join(f"  {name:<15}{text}\n" for name, (text, _) in COMMANDS.items())
    + "\nA config error prints one line and exits 2 (--debug, or LLM_PG_DEBUG=1: the traceback)."
)

# Printed above LightningCLI's `fit --help` / `validate --help`: the model is chosen by class_path, so its keys
# (the RL settings) are not in that listing, which is mostly `trainer.*`.
SUBCOMMAND_HINT = (
    "The RL keys are model.init_args.* of the algorithm's class (each with its help text and default):\n"
    "  llm-pg {command} --model.help llm_pg.modules.GRPOModule         GRPO\n"
    "  llm-pg {command} --model.help llm_pg.modules.ReinforceModule    GR-REINFORCE\n"
    "  llm-pg {command} --data.task.help llm_pg.data.tasks.FormatCopyTask   a task's keys (MathHardTask, ArithTask)\n"
    "  llm-pg {command} --config FILE --print_config                  every key of a config, resolved\n"
    "Below: the data, checkpoint and top-level keys, then Lightning's trainer.* keys.\n"
)


def is_own(words: Sequence[str]) -> bool:
    """Whether `words` (argv without the program) ask for the top-level help or one of the project's commands,
    which `run_own` answers without LightningCLI."""
    return not words or words[0] in ("-h", "--help") or COMMANDS.get(words[0], (None, None))[1] is not None


def run_own(words: Sequence[str]) -> int:
    """The exit status of the top-level help (0; 2 with no command at all) or of the command's `main(argv)`."""
    if not words or words[0] in ("-h", "--help"):
        print(HELP)
        return 0 if words else 2
    module = COMMANDS[words[0]][1]
    return importlib.import_module(module).main(list(words[1:]))


def main(argv: Sequence[str] | None = None) -> None:
    """`llm-pg ...`: the project's commands here, `fit` / `validate` (and any other word) via `llm_pg.cli.fit.main`."""
    words = list(sys.argv[1:] if argv is None else argv)
    if is_own(words):
        sys.exit(run_own(words))
    if words[0] in COMMANDS and ("-h" in words or "--help" in words):
        print(SUBCOMMAND_HINT.format(command=words[0]), flush=True)
    from llm_pg.cli.fit import main as cli_main  # torch, Lightning, transformers: seconds, so only now

    cli_main(words)


if __name__ == "__main__":
    main()
