"""What `llm-pg` prints besides the run's own lines: the top-level help, and the third-party messages it silences.

`silence_known_noise` is called once, by the `llm-pg` entry point (`llm_pg.cli.main`). Each filter names one
message that a user of this trainer cannot act on, by its text (and category or logger): no blanket filter, so any
other warning, error or log record still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning
from transformers.utils import logging as hf_logging

# llm-pg <command>: (what it does, the module whose `main(argv)` runs it; None: LightningCLI's own subcommand)
COMMANDS: dict[str, tuple[str, str | None]] = {
    "fit": ("train a policy with RL: llm-pg fit --config configs/tiny/format_copy_grpo.yaml", None),
    "validate": ("greedy evaluation on the task's eval set: the pre-RL baseline", None),
    "sweep": ("run a sweep file's runs here, one after another (finished ones skipped)", "llm_pg.sweep"),
    "report": ("plots, a comparison table and sampled generations from run directories", "llm_pg.report"),
    "bundle": ("zip the configs, metrics, generations and final weights of runs", "llm_pg.bundle"),
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

# (message regex, category) of Python warnings that say nothing to a user of this trainer
WARNINGS: list[tuple[str, type[Warning]]] = [
    # The policy is switched to train mode by training_step; the frozen reference stays in eval mode on purpose.
    (r"Found \d+ module\(s\) in eval mode at the start of training", PossibleUserWarning),
    # Lightning 2.6's own pytree helper uses a name torch 2.13 deprecates; nothing here calls it.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
]

# logger name -> message regex of log records that say nothing to a user of this trainer
LOG_RECORDS: dict[str, str] = {
    # Lightning advertises its hosted logger when none is in use; it is not a dependency of this project.
    # The TPU/HPU lines: this trainer runs on CPUs and CUDA GPUs only (the GPU line stays). The checkpoint lines:
    # `llm-pg: resuming from <path>` has said it already.
    "lightning.pytorch.utilities.rank_zero": (
        r"💡 Tip: For seamless cloud logging|(TPU|HPU) available: "
        r"|Restoring states from the checkpoint path at |Restored all states from the checkpoint at "
    ),
    # Written at every checkpoint: this trainer always saves optimizer and data-stream state (weights_only=False).
    "lightning.pytorch.trainer.connectors.checkpoint_connector": r"`weights_only` was not set",
}

# transformers progress bars over a model's tensors: instant for the tiny model, and one line each on a GPU run
QUIET_BARS = ("Loading weights", "Writing model shards")


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def _quiet_bar(factory, args, kwargs):
    """transformers' tqdm hook: the bars named in QUIET_BARS are created disabled; every other bar (downloads) shows."""
    if kwargs.get("desc") in QUIET_BARS:
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def silence_known_noise() -> None:
    """Install the filters above (idempotent: each is installed once)."""
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessages(pattern))
    hf_logging.set_tqdm_hook(_quiet_bar)
