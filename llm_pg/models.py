"""Load the policy, the frozen reference and the tokenizer from a hub id or a local directory.

Precision: the policy is loaded in the dtype the optimizer should update (`master_dtype`), and forward
passes run under autocast in the compute dtype. Full fine-tuning in bf16 therefore keeps float32 master
weights (AdamW steps of lr 3e-5 round away on bf16 weights); with LoRA the frozen base is loaded in the
compute dtype and peft (`autocast_adapter_dtype=True`, its default) keeps the adapter weights in float32.

Two transformers names changed inside the range pyproject allows (5.x): 5.23 renamed `gradient_checkpointing_enable`
to `activation_checkpointing_enable`, 5.24 the KV cache argument and output field `past_key_values` to `cache`. The
old names warn from then on (FutureWarning, removed in 6) and the lock's 5.19 has only them, so no name is in both:
`enable_activation_checkpointing`, `kv_cache` and `with_kv_cache` below branch on the version, and nothing else in
llm_pg names either spelling.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from llm_pg import real_model
from llm_pg.tiny import TINY_CHAT_DIR

TINY_MODEL = str(TINY_CHAT_DIR)
_TRANSFORMERS = Version(transformers.__version__).release  # (5, 24, 0) for 5.24.0 and its dev and rc builds
CACHE_NAME = "cache" if _TRANSFORMERS >= (5, 24) else "past_key_values"  # the KV cache's kwarg and output field


def kv_cache(output: Any) -> Any:
    """The KV cache a forward with `use_cache=True` returned (None when the model keeps none)."""
    return getattr(output, CACHE_NAME, None)


def with_kv_cache(cache: Any) -> dict[str, Any]:
    """`{name: cache}` for a forward or `generate` call, under this transformers' name for the KV cache."""
    return {CACHE_NAME: cache}


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant torch checkpointing)."""
    if _TRANSFORMERS >= (5, 23):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether any submodule recomputes its activations in the backward pass: the flag transformers sets on each
    checkpointed layer (what `is_activation_checkpointing`, formerly `is_gradient_checkpointing`, reads), through a
    peft wrapper too; False for a model that has none."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _non_reentrant(module: torch.nn.Module) -> bool:
    """Whether the module's checkpoint function is torch's with `use_reentrant=False` (what transformers builds:
    `functools.partial(checkpoint, **kwargs)`); False when that cannot be told."""
    func = getattr(module, "_gradient_checkpointing_func", None)  # private: absent means unknown
    return isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is False


def cache_survives_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a forward that builds a graph can carry a KV cache through the model's checkpointed layers: each is a
    transformers `GradientCheckpointingLayer`, which keeps the cache when `_can_checkpoint_with_cache` is True
    (`cache_kept_under_checkpointing`), and checkpoints non-reentrantly, the variant whose backward reaches tensors
    that left a layer through the cache (the reentrant one runs the forward without a graph). The other flagged
    modules must be the transformers models themselves (their flag only turns `use_cache` off)."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    layers = [m for m in flagged if isinstance(m, GradientCheckpointingLayer)]
    return (
        bool(layers)
        # private (5.x): a transformers without it drops the cache under checkpointing, so sharing stays off there
        and hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
        and all(isinstance(m, GradientCheckpointingLayer | PreTrainedModel) for m in flagged)
        and all(_non_reentrant(m) for m in flagged)
    )


@contextmanager
def cache_kept_under_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's checkpointed layers pass a KV cache on instead of dropping it (an instance
    `_can_checkpoint_with_cache = True` over the class's False); afterwards, also after an exception, each layer
    reads its class value again. Only for caches that a recompute cannot corrupt (`PromptCache` and its `rows`)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]  # None: no instance value
    try:
        for layer in layers:
            layer._can_checkpoint_with_cache = True
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            if value is None:
                layer.__dict__.pop("_can_checkpoint_with_cache", None)
            else:
                layer._can_checkpoint_with_cache = value


class _RecordingLayer(DynamicLayer):
    """Keeps the keys and values of its first `update` `[u, h, P, d]`; a later call (the backward's recompute of a
    checkpointed layer) stores nothing. Every call returns its own keys and values, as a first update of an empty
    cache would, so the forward and its recompute run the same operations."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PromptRowsLayer(DynamicLayer):
    """Read-only prompt keys and values `[b, h, P, d]`: `update` returns `cat(prompt, new)` along the sequence and
    stores nothing, so `get_seq_length` and `get_mask_sizes` stay the prompt's in the forward and its recompute."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PromptCache(Cache):
    """The KV cache of a prompt pass under gradient checkpointing: each layer records its keys and values once."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=_RecordingLayer)

    def rows(self, index: Tensor) -> Cache:
        """A read-only cache of the recorded prompts copied to rows, `keys[index]` per layer (`index_select`, so
        the rows' gradients flow back into the one prompt pass)."""
        return Cache(
            layers=[
                _PromptRowsLayer(m.keys.index_select(0, index), m.values.index_select(0, index)) for m in self.layers
            ]
        )


@dataclass
class LoRA:
    """LoRA adapter settings (peft). `r = 0` means full fine-tuning."""

    r: int = 0
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def resolve_model_path(name_or_path: str) -> str:
    """`tiny` names the bundled model, `smollm2-135m-instruct` the one `llm-pg real-model` prepared (one line
    giving the command when it has not); a path-like name must exist; anything else is a hub id."""
    if name_or_path == "tiny":
        return TINY_MODEL
    if name_or_path == real_model.NAME:
        return str(real_model.prepared_dir())
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise ValueError(
            f"model.model_name_or_path: no model directory at {name_or_path!r}; give an existing directory "
            "with config.json and weights, a hub id such as 'Qwen/Qwen2.5-Math-1.5B-Instruct', or 'tiny'"
        )
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The compute dtype when none is given: bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def master_dtype(compute_dtype: torch.dtype, lora: LoRA | None) -> torch.dtype:
    """The dtype to load the policy in: float32 for full fine-tuning (the optimizer's master weights), the
    compute dtype with LoRA (the base is frozen; peft keeps the adapter in float32)."""
    return compute_dtype if lora is not None and lora.r > 0 else torch.float32


def check_hub_model(name_or_path: str) -> None:
    """Fail within seconds when a hub id is neither cached nor reachable, instead of after `from_pretrained`'s
    retries (about 50 s without a network). Local directories and cached hub ids pass without a request."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    path = resolve_model_path(name_or_path)
    if Path(path).is_dir() or isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    hint = "pre-download it with `hf download` (then HF_HUB_OFFLINE=1 works) or give a local directory"
    if constants.HF_HUB_OFFLINE:
        raise RuntimeError(
            f"model.model_name_or_path: {path!r} is not in the local hub cache and HF_HUB_OFFLINE is set; {hint}"
        )
    try:
        model_info(path, timeout=5)
    except RepositoryNotFoundError:
        raise ValueError(
            f"model.model_name_or_path: no model {path!r} on {constants.ENDPOINT} (or it is private: `hf auth login`); "
            "check the hub id"
        ) from None
    except HfHubHTTPError:
        return  # the hub answered (gated, rate-limited, ...): from_pretrained reports it precisely
    except Exception as err:  # DNS, refused or timed-out connection: the hub cannot be reached
        raise RuntimeError(
            f"model.model_name_or_path: cannot reach {constants.ENDPOINT} to download {path!r} "
            f"({err.__class__.__name__}: {err}); {hint}"
        ) from None


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
    check_hub_model(name_or_path)
    tokenizer = _load(AutoTokenizer.from_pretrained, resolve_model_path(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str, dtype: torch.dtype, lora: LoRA | None = None, gradient_checkpointing: bool = False
) -> PreTrainedModel:
    """The trainable policy in `dtype`: the full model, or the base model wrapped with a fresh LoRA adapter
    (whose weights peft keeps in float32 whatever `dtype` is)."""
    check_hub_model(name_or_path)
    model = _load(AutoModelForCausalLM.from_pretrained, resolve_model_path(name_or_path), dtype=dtype)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
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


def load_reference(name_or_path: str, dtype: torch.dtype) -> PreTrainedModel:
    """A frozen copy of the base model for the KL reference, in the compute dtype: eval mode, no gradients.

    Loaded anew rather than copied from the policy, whose float32 master weights would double its memory."""
    reference = _load(AutoModelForCausalLM.from_pretrained, resolve_model_path(name_or_path), dtype=dtype)
    reference.eval()
    reference.requires_grad_(False)
    return reference
