"""Files shipped inside the package: the bundled tiny chat model (`TINY_CHAT_DIR`, made by `llm_pg.tiny.pretrain`)
and its tool-aware fine-tune (`TINY_TOOLS_DIR`, made by `llm_pg.tiny.pretrain_tools`)."""

from pathlib import Path

TINY_CHAT_DIR = Path(__file__).resolve().parent / "tiny-chat"
TINY_TOOLS_DIR = Path(__file__).resolve().parent / "tiny-chat-tools"

__all__ = ["TINY_CHAT_DIR", "TINY_TOOLS_DIR"]
