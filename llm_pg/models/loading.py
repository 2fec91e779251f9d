"""Load the policy, the frozen reference and the tokenizer from a hub id or a local directory.

Precision: the policy is loaded in the dtype the optimizer should update (`master_dtype`), and forward
passes run under autocast in the compute dtype. Full fine-tuning in bf16 therefore keeps float32 master
weights (AdamW steps of lr 3e-5 round away on bf16 weights); with LoRA the frozen base is loaded in the
compute dtype and peft (`autocast_adapter_dtype=True`, its default) keeps the adapter weights in float32.
Under autocast peft's own cast of each adapter's input to float32 is turned off (`autocast_forward`): autocast casts
the adapter's matmul inputs to the compute dtype anyway, so the cast was a copy there and back, exact both ways.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from llm_pg.assets import TINY_CHAT_DIR, TINY_TOOLS_DIR
from llm_pg.models import real_model
from llm_pg.models.cache import enable_activation_checkpointing

TINY_MODEL = str(TINY_CHAT_DIR)
TINY_TOOLS_MODEL = str(TINY_TOOLS_DIR)  # `tiny-tools`: the tiny model taught the calculator


@dataclass
class LoRA:
    """LoRA adapter settings (peft). `r = 0` means full fine-tuning."""

    r: int = 0
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def resolve_model_path(name_or_path: str) -> str:
    """`tiny` names the bundled model (`tiny-tools` its tool-aware fine-tune), a name of `real_model.MODELS`
    (`smollm2-135m-instruct`, `qwen2.5-coder-0.5b-instruct`, ...) the one `llm-pg real-model` prepared (one line giving
    the command when it has not); a path-like name must exist; anything else is a hub id."""
    if name_or_path == "tiny":
        return TINY_MODEL
    if name_or_path == "tiny-tools":
        return TINY_TOOLS_MODEL
    if name_or_path in real_model.MODELS:
        return str(real_model.prepared_dir(name_or_path))
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


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 instructions that make CPU bf16 matmuls faster than float32


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        with open(path) as info:
            return {flag for line in info if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def auto_dtype(device: torch.device | str, flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """`dtype: auto`: the faster compute dtype here, and why. bf16 on a GPU; on a CPU, bf16 where it has bf16
    matmul instructions (two cores with avx512_bf16 ran 896x4864 matmuls at 851 GFLOP/s in bf16 against 196 in
    float32) and float32 elsewhere (one without ran bf16 at 14.5 GFLOP/s, emulated)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "a GPU"
    found = [flag for flag in BF16_CPU_FLAGS if flag in (cpu_flags() if flags is None else flags)]
    if found:
        return torch.bfloat16, f"this CPU has {found[0]}"
    return torch.float32, f"this CPU has none of {', '.join(BF16_CPU_FLAGS)}: bf16 would be emulated, slower"


@contextmanager
def autocast_forward(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Forwards of `model` under autocast in `dtype`, with a LoRA adapter's input cast to its float32 weights off
    (peft's `disable_input_dtype_casting`): autocast runs the adapter's matmuls in `dtype`, so casting a bf16 input to
    float32 first only copied it (an `[n, 4864]` copy per down projection, forward and backward, on the Qwen) and
    gave the same bf16 operands, bit for bit."""
    from peft import PeftModel
    from peft.helpers import disable_input_dtype_casting

    with torch.autocast(device_type, dtype=dtype), disable_input_dtype_casting(model, isinstance(model, PeftModel)):
        yield


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
    contiguous_head_input(model)
    return model


def load_reference(name_or_path: str, dtype: torch.dtype) -> PreTrainedModel:
    """A frozen copy of the base model for the KL reference, in the compute dtype: eval mode, no gradients.

    Loaded anew rather than copied from the policy, whose float32 master weights would double its memory."""
    reference = _load(AutoModelForCausalLM.from_pretrained, resolve_model_path(name_or_path), dtype=dtype)
    reference.eval()
    reference.requires_grad_(False)
    contiguous_head_input(reference)
    return reference


def contiguous_head_input(model: PreTrainedModel) -> None:
    """Give the model's LM head a contiguous input (a forward pre-hook; its output is unchanged).

    transformers keeps `logits_to_keep` positions by slicing, `hidden[:, -k:, :]`: a view whose rows are a whole
    sequence apart. On such a 3-D view torch's matmul folds the rows into one matrix product only when the weight
    requires grad; for a frozen head (LoRA's, the reference model's) it broadcasts the `[V, H]` weight to every row
    and copies it (pytorch/pytorch#186148). One prefill's head call on Qwen2.5-0.5B at 32 rows took 19.8 s and
    8.5 GB instead of 39 ms (`benchmarks/head_input.py`), at every rollout turn and no-grad pass. The hook copies
    the kept positions (`[b, k, H]`, small), so the product is one matrix product. A trained head (full
    fine-tuning's policy) gets no hook: its product is already the folded one, the same values bit for bit."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(head, torch.nn.Module) and not (isinstance(weight, torch.Tensor) and weight.requires_grad):
        head.register_forward_pre_hook(_contiguous_input)


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None
