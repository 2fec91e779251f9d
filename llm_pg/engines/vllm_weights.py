"""How the policy's weights reach vLLM after each update (`VLLMEngine.load_weights`).

Full fine-tuning: every parameter is pushed under its checkpoint name (`policy_weights`) through vLLM's
`reload_weights`, in the policy's float32 (vLLM casts each to its dtype as it loads it: the same bf16 rounding of
the float32 master weights that the trainer's autocast forward makes).

LoRA: the adapter goes to vLLM's own LoRA support (`AdapterPush`): the adapter files of each iteration are written
as a new version with a new id, and every request names the newest (`LoRARequest`). vLLM then computes
`W x + scale * B (A x)`, as peft does in the trainer, instead of sampling from a merged `W + scale * B A` rounded to
its dtype: in bf16 a delta below half a step of `W` (about 4e-5 at |W| ~ 0.02, most of the updates of the math
runs' 100-iteration warm-up) would vanish in that rounding, every time, and vLLM would sample from the base weights
while the trainer's pi_old had moved. The frozen base weights never change, so nothing else is pushed.
`policy_weights` still merges LoRA for the full push (a vLLM engine started without LoRA support); the tests
compare it with peft's own merge.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the `max_lora_rank` values vLLM 0.32 accepts


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"model.lora.r={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; use rollout_engine: hf")


class AdapterPush:
    """The policy's LoRA adapter as vLLM LoRA requests: one new version (directory and id) per push.

    `push(model)` writes the adapter (`save_pretrained`: adapter_config.json and the float32 factors) to
    `<root>/v<k>` and makes `request` a `LoRARequest` with id k, so vLLM loads it at the next generation (it caches
    adapters by id: a new id is never served stale). The previous version's files are deleted: vLLM holds it in
    memory if it was used, and it is never requested again. The root is a temporary directory (in /dev/shm where
    there is one), removed with this object.
    """

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        self.root = Path(tempfile.mkdtemp(prefix="llm_pg_vllm_lora_", dir=shm if shm.is_dir() else None))
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self.version = 0
        self.request = None

    def push(self, model: nn.Module):
        from vllm.lora.request import LoRARequest

        if not isinstance(model, PeftModel):
            raise TypeError("the vLLM engine was started for LoRA adapters, but the policy has none")
        if any(getattr(config, "use_dora", False) for config in model.peft_config.values()):
            raise ValueError("model.lora: vLLM serves no DoRA adapters; use rollout_engine: hf")
        self.version += 1
        path = self.root / f"v{self.version}"
        model.save_pretrained(path)
        previous, self.request = self.request, LoRARequest(f"policy-v{self.version}", self.version, str(path))
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return self.request


def policy_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """`(name, tensor)` for every weight of `model` under its HF checkpoint name, LoRA adapters merged.

    A peft model yields its base model's names; each LoRA-wrapped layer yields `W + scale * B @ A` (peft's
    `get_delta_weight`, a new tensor) under the plain layer's name, so the training adapter is read, never
    changed. Tied weights appear once, as in `named_parameters()`. Tensors are detached views of the
    parameters (merged ones are new), on the model's device and in its dtype.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    lora_layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, param in base.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if any(part.startswith("lora_") for part in module_name.split(".")):
            continue  # adapter factors: folded into their base layer's weight below
        owner = module_name.removesuffix(".base_layer")
        if owner != module_name and owner in lora_layers:
            name = f"{owner}.{leaf}"
            if leaf == "weight":
                yield name, _merged_weight(lora_layers[owner], param.detach())
                continue
        yield name, param.detach()


def _merged_weight(layer: LoraLayer, weight: Tensor) -> Tensor:
    """`weight + sum over active adapters of scale * B @ A` (as `merge` would compute, without merging)."""
    if layer.merged or layer.disable_adapters:
        return weight  # the adapter is already in the weight, or switched off
    merged = weight
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if layer.use_dora.get(adapter, False):
            raise ValueError("model.lora: DoRA adapters cannot be merged for vLLM; use rollout_engine: hf")
        merged = merged + layer.get_delta_weight(adapter).to(weight.dtype)
    return merged


def repack_tied_lm_head(worker) -> None:
    """Re-run the output layer's post-load step when it shares the embedding matrix (run in vLLM's worker).

    vLLM's CPU build packs each linear weight into a GEMM layout after loading, the output layer's included.
    With tied embeddings the checkpoint has no `lm_head.weight`, so a reload refills the shared matrix but never
    repacks the output layer, whose logits would keep the old embedding. On a GPU the step does nothing.
    """
    if worker.model_config.hf_text_config.tie_word_embeddings:
        head = worker.model_runner.get_model().get_submodule("lm_head")
        head.quant_method.process_weights_after_loading(head)
