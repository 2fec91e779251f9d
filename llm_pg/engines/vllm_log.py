"""vLLM's own log goes to a file in the run directory; the terminal keeps what a user can act on.

vLLM logs through the `vllm` logger (its handler prints to stderr): at start about thirty lines, and about six per
iteration (the weight reload, the prefix-cache reset). `route_vllm_log(path)` moves all of it, every level from
INFO, to `path` before the engine starts, and the terminal gets one line from the trainer instead
(`VLLMEngine.describe`).

Two WARNINGs of a full-weight reload read like failures but are expected, and are rewritten at their source
(`ExpectedReloadNotes`) to INFO lines that say why:
- `RotaryEmbedding: Failed to load weights`: the rotary layer's only tensor is its cos/sin cache, computed at start
  and in no checkpoint, so a reload has nothing to give it; vLLM keeps the cache it computed, which is correct.
- `ParallelLMHead: Failed to load weights` (tied embeddings): the output layer shares the embedding matrix, which
  the push refills under `embed_tokens`; nothing arrives under `lm_head`, and the layer is repacked after the push
  (`llm_pg.engines.vllm_weights.repack_tied_lm_head`), as the log-prob tests check.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

EXPECTED_RELOAD_NOTES = {
    "RotaryEmbedding": "no weights to reload (its cos/sin cache is computed at start, in no checkpoint): expected",
    "ParallelLMHead": "no weights of its own to reload (tied to the embedding, which was reloaded; repacked after "
    "the push): expected",
}
_FAILED = "%s: Failed to load weights"


class ExpectedReloadNotes(logging.Filter):
    """Rewrites vLLM's 'Failed to load weights' WARNING for a layer in `EXPECTED_RELOAD_NOTES` to an INFO note saying
    why it is expected; any other layer's stays a WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _FAILED and record.args:
            layer = str(record.args[0])
            note = next((text for name, text in EXPECTED_RELOAD_NOTES.items() if layer.endswith(name)), None)
            if note is not None:
                record.msg, record.args = "%s: %s", (layer, note)
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def route_vllm_log(path: Path | None) -> None:
    """Send the `vllm` logger's records (INFO and up) to `path` only, with the reload notes rewritten; called before
    vLLM is imported, so that its import-time lines go there too and it installs no stderr handler of its own
    (`VLLM_CONFIGURE_LOGGING=0`). None: leave vLLM's own handler (stderr) and only add the rewrite. Its import-time
    FutureWarnings about torch APIs it still uses are dropped: nothing a user of this project can change."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)
    logger = logging.getLogger("vllm")
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, ExpectedReloadNotes) for f in reload_logger.filters):
        reload_logger.addFilter(ExpectedReloadNotes())
    if path is None:
        return
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
