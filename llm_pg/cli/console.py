"""The third-party messages `llm-pg` silences: each one a user of this trainer cannot act on.

`silence_known_noise` is called by the commands that load models, after their arguments are parsed:
`llm_pg.cli.fit.main` (fit, validate) and `eval-tiny` (`pretrain-tiny` turns transformers' bars off itself); never by
`llm-pg --help` or the other commands (`llm_pg.cli.entry`), since this module imports Lightning and transformers.
Each filter names one message by its text (and category or logger): no blanket filter, so any other warning, error
or log record still shows. The top-level help and the command table live in `llm_pg.cli.entry`.
"""

from __future__ import annotations

import logging
import re
import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning
from transformers.utils import logging as hf_logging

# (message regex, category) of Python warnings that say nothing to a user of this trainer
WARNINGS: list[tuple[str, type[Warning]]] = [
    # The policy is switched to train mode by training_step; the frozen reference stays in eval mode on purpose.
    (r"Found \d+ module\(s\) in eval mode at the start of training", PossibleUserWarning),
    # Lightning 2.6's own pytree helper uses a name torch 2.13 deprecates; nothing here calls it.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # transformers >= 5.23 renamed it; peft 0.21's PeftModel still reads the old name when it wraps a LoRA model.
    # llm_pg names neither (llm_pg.models.cache.activation_checkpointing).
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
]

# logger name -> message regex of log records that say nothing to a user of this trainer
LOG_RECORDS: dict[str, str] = {
    # Lightning advertises its hosted logger when none is in use; it is not a dependency of this project.
    # The TPU/HPU lines: this trainer runs on CPUs and CUDA GPUs only (the GPU line stays). The checkpoint lines:
    # `llm-pg: resuming from <path>` has said it already.
    "lightning.pytorch.utilities.rank_zero": (
        r"💡 Tip: For seamless cloud logging|(TPU|HPU) available: "
        r"|Restoring states from the checkpoint path at |Restored all states from the checkpoint at "
        r"|Loaded model weights from the checkpoint at "
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
