"""A tiny chat model of llm_pg's own: byte-level tokenizer, pretraining on noisy task demonstrations, metrics.

The committed checkpoint (`TINY_CHAT_DIR`) is a weak but non-trivial base policy for the tiny tasks, so the
whole RL pipeline runs and visibly learns on a CPU with nothing to download.
"""

from pathlib import Path

TINY_CHAT_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-chat"

__all__ = ["TINY_CHAT_DIR"]
