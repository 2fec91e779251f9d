"""Load the policy, the frozen reference and the tokenizer from a hub id or a local directory."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from llm_pg.tiny import TINY_CHAT_DIR

TINY_MODEL = str(TINY_CHAT_DIR)


@dataclass
class LoRA:
    """LoRA adapter settings (peft). `r = 0` means full fine-tuning."""

    r: int = 0
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def resolve_model_path(name_or_path: str) -> str:
    """`tiny` names the bundled model; a path-like name must exist; anything else is a hub id."""
    if name_or_path == "tiny":
        return TINY_MODEL
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise ValueError(
            f"model.model_name_or_path: no model directory at {name_or_path!r}; give an existing directory "
            "with config.json and weights, a hub id such as 'Qwen/Qwen2.5-Math-1.5B-Instruct', or 'tiny'"
        )
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _load(fn, name: str, **kwargs):
    try:
        return fn(name, **kwargs)
    except OSError as err:  # offline with nothing cached, or a wrong id: say so in one line
        raise RuntimeError(
            f"could not load {name!r} ({err.__class__.__name__}: {str(err).splitlines()[0]}). Check the hub id, "
            "or point model.model_name_or_path at a local directory; offline, pre-download it with "
            "`huggingface-cli download` and set HF_HUB_OFFLINE=1"
        ) from None


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer, left-padded for generation, with a pad token (the EOS token when it has none)."""
    tokenizer = _load(AutoTokenizer.from_pretrained, resolve_model_path(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str, dtype: torch.dtype, lora: LoRA | None = None, gradient_checkpointing: bool = False
) -> PreTrainedModel:
    """The trainable policy: the full model, or the base model wrapped with a fresh LoRA adapter."""
    model = _load(AutoModelForCausalLM.from_pretrained, resolve_model_path(name_or_path), dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # generate() turns the cache back on in eval mode
    if lora is not None and lora.r > 0:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
        if gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of `model` for the reference: eval mode, no gradients."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference
