"""Files shipped inside the package: the bundled tiny chat model (`TINY_CHAT_DIR`, made by `llm_pg.tiny.pretrain`)."""

from pathlib import Path

TINY_CHAT_DIR = Path(__file__).resolve().parent / "tiny-chat"

__all__ = ["TINY_CHAT_DIR"]
