"""VLLMEngine: rollouts with vLLM colocated in the training process, fed the policy's weights after each update.

vLLM (`llm-pg[vllm]`, 0.32) runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no second process, no
`__main__` guard, and weight tensors reach the worker as tensors, not lists. Prompts are encoded by our own
`encode_prompts` and handed to vLLM as token ids, and vLLM never loads a tokenizer (`skip_tokenizer_init`), so
the prompt tokens, padding, EOS ids and decoded texts are those of `llm_pg.models.generation.generate`.

Sampled-token log-probs (`Generation.sampled_logp`) come in one of two modes (`logprobs_mode`):
- `raw_logprobs`: `log_softmax(logits)[token]`, temperature 1, before any masking: equal to the trainer's
  log-probs at `logprob_temperature: 1.0` (the course's default).
- `processed_logprobs`: after temperature scaling, top-p truncation and the min-tokens EOS mask: equal to the
  trainer's log-probs at the sampling temperature (`logprob_temperature: null`) where top_p is 1 and the row
  is past `min_new_tokens`; elsewhere they are the log-probs of what vLLM actually sampled from.

As HF sampling does (`unused_token_ids`), vLLM never samples the head's rows past the tokenizer's vocabulary
(Qwen2.5: 271 padding rows): each request biases them by -100, vLLM's lowest logit bias (`unused_logit_bias`),
which leaves them e^-100 of their probability, below float32's smallest number after the softmax. The bias is
applied after `raw_logprobs` are taken, so those stay the full softmax the trainer scores.

Under DDP every rank builds its own engine (tensor parallel 1) on its own device, as TRL's colocate mode does:
vLLM's `external_launcher` executor adopts the trainer's process group (`init_distributed_environment` skips
`init_process_group` when one exists) and makes one single-rank tensor-parallel group per rank, so no collective
runs while sampling. Making groups is collective: all ranks start their engines together, at the first generation.
It reads RANK (Lightning's launcher sets none) and LOCAL_RANK (the GPU index it samples on), set while it starts.
Verified on CPU processes over gloo only (`tests/test_vllm_ddp.py`); NCCL and GPU placement are untested.

Weights (`llm_pg.engines.vllm_weights`): with LoRA vLLM serves the adapter itself, a new version per iteration
(`lora_rank`), so no update is lost to rounding a merged weight; full fine-tuning pushes every parameter through
`reload_weights(weights_iterator=...)` (loading from a path gave wrong log-probs in version 0.32). The prefix cache
is reset after every push, as cached prompt blocks hold keys and values of the old weights. vLLM's own log goes to
a file (`log_file`, `llm_pg.engines.vllm_log`).

Caveat: on the CPU vLLM binds the process's OpenMP threads when it starts, after which `torch.set_num_threads` is
ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from llm_pg.core.rollout import derive_seed
from llm_pg.engines.vllm_log import route_vllm_log
from llm_pg.engines.vllm_weights import AdapterPush, policy_weights, repack_tied_lm_head, vllm_max_lora_rank
from llm_pg.models.generation import (
    Conversation,
    Generation,
    Sampling,
    encode_prompts,
    pad_token_id,
    rows_past_tokenizer,
    single_turn,
)
from llm_pg.models.loading import resolve_model_path

__all__ = [
    "VLLMEngine",
    "checkpoint_eos_ids",
    "policy_weights",
    "unused_logit_bias",
    "vllm_logprobs_mode",
]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def vllm_logprobs_mode(logprob_temperature: float | None, temperature: float) -> str:
    """The vLLM `logprobs_mode` whose log-probs are the trainer's at `logprob_temperature` (None: `temperature`)."""
    if logprob_temperature == 1.0:
        return "raw_logprobs"
    if logprob_temperature is None or logprob_temperature == temperature:
        return "processed_logprobs"
    raise ValueError(
        f"model.logprob_temperature={logprob_temperature}: vLLM reports log-probs at temperature 1 or at the "
        f"sampling temperature ({temperature}); set logprob_temperature to 1.0 or null, or use rollout_engine: hf"
    )


def checkpoint_eos_ids(path: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The EOS ids `eos_token_ids(model, tokenizer)` gives, read from the model's files instead of a model."""
    try:
        configured = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: transformers falls back to the model config's EOS
        configured = AutoConfig.from_pretrained(path).eos_token_id
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def unused_logit_bias(path: str, tokenizer: PreTrainedTokenizerBase) -> dict[int, float] | None:
    """`{id: -100.0}` for each row of the checkpoint's head past the tokenizer's vocabulary (`unused_token_ids`,
    read from the model's config instead of a model), None when there is none (the tiny model, SmolLM2)."""
    unused = rows_past_tokenizer(AutoConfig.from_pretrained(path).get_text_config().vocab_size, tokenizer)
    return dict.fromkeys(unused, -100.0) if unused else None


@contextmanager
def _launcher_environment(device: torch.device) -> Iterator[None]:
    """RANK, LOCAL_RANK and WORLD_SIZE as `external_launcher` reads them, while the engine starts; restored after,
    as Lightning reads its own LOCAL_RANK. LOCAL_RANK is the rank's CUDA device index (vLLM samples on
    `cuda:LOCAL_RANK`; with `trainer.devices=[2, 3]` not the trainer's local rank); on the CPU the rank."""
    rank = torch.distributed.get_rank()
    local = device.index if device.type == "cuda" and device.index is not None else rank
    values = {"RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": torch.distributed.get_world_size()}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class VLLMEngine:
    """vLLM sampling in the training process, behind the interface of `llm_pg.engines` (see its docstring).

    Args:
        model_name_or_path: what the policy was loaded from (hub id, directory or `tiny`); vLLM loads it once,
            then receives the policy's weights through `load_weights`.
        tokenizer: the trainer's tokenizer (`load_tokenizer`): prompts, padding and texts use it.
        dtype: the policy's dtype (`torch.bfloat16`, "float32", ...); "auto" reads the checkpoint's.
        max_model_len: longest prompt plus completion, `max_prompt_tokens + max_new_tokens`; None: the model's.
        gpu_memory_utilization: share of the GPU vLLM may take (weights, activations, KV cache). 0.3 of an
            80 GB H100 is 24 GB: Qwen2.5-1.5B's bf16 weights (3.1 GB) and KV cache for ~700k tokens (28 KB each:
            28 layers x K,V x 2 heads x 128 x 2 bytes) where one math_hard rollout needs 64 x 1024 = 65k;
            the other 56 GB hold the LoRA policy, its activations under gradient checkpointing and the float32
            log-softmax of 8 x 1024 tokens over 152k words (5 GB). On the CPU: the share of the NUMA node's memory,
            less what the process already uses, goes to the KV cache (0.3 of 12.5 GB: 3 GB on the test machine).
        kv_cache_memory_bytes: fixed KV cache size; overrides `gpu_memory_utilization` (on the CPU, the
            default is `gpu_memory_utilization`'s share of memory).
        seed: vLLM's own seed; `generate(seed=...)` seeds each request instead, which is what replays a run.
        logprobs_mode: `raw_logprobs` or `processed_logprobs` (module docstring; `vllm_logprobs_mode` picks it
            from `logprob_temperature`).
        eos_token_ids: ids that end a completion; default `checkpoint_eos_ids` (as `eos_token_ids` does).
        enforce_eager: no CUDA graphs / compilation: faster start, slower decoding.
        max_num_batched_tokens: tokens per engine step (None: vLLM's default). On the CPU, give at least the
            rollout's prompt tokens (rows x padded prompt length): vLLM 0.32 cannot rewind a seeded CPU generator
            when it splits a prompt across steps and fails with "CPU Generator does not use offset".
        device: where the returned tensors go (default: the GPU when there is one). Under DDP also where vLLM
            runs: `cuda:k` samples on GPU k, whose memory `gpu_memory_utilization` is a share of.
        lora_rank: the policy's LoRA rank: vLLM serves the adapter itself (`enable_lora`), pushed as a new version
            per `load_weights`; None: full weights are pushed (full fine-tuning).
        log_file: where vLLM's own log goes (None: vLLM's stderr handler).
    """

    def __init__(
        self,
        model_name_or_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: torch.dtype | str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        logprobs_mode: str = "raw_logprobs",
        eos_token_ids: Sequence[int] | None = None,
        enforce_eager: bool = False,
        max_num_batched_tokens: int | None = None,
        device: torch.device | str | None = None,
        lora_rank: int | None = None,
        log_file: str | Path | None = None,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {LOGPROBS_MODES}")
        if not 0 < gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: give a fraction in (0, 1), e.g. 0.3")
        # In-process engine core: set before vLLM reads its environment (it reads it lazily, at engine start).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log_file = Path(log_file) if log_file is not None else None
        route_vllm_log(self.log_file)
        from vllm import LLM

        path = resolve_model_path(model_name_or_path)
        self.tokenizer = tokenizer
        self.eos = sorted(set(eos_token_ids)) if eos_token_ids is not None else checkpoint_eos_ids(path, tokenizer)
        self.unused_bias = unused_logit_bias(path, tokenizer)
        self.logprobs_mode = logprobs_mode
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype, self.gpu_memory_utilization, self.kv_cache_memory_bytes = (
            dtype,
            gpu_memory_utilization,
            kv_cache_memory_bytes,
        )
        self.adapter = AdapterPush() if lora_rank is not None else None
        lora = (
            {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora_rank), "max_loras": 1} if lora_rank else {}
        )
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        with _launcher_environment(self.device) if distributed else nullcontext():
            self.llm = LLM(
                model=path,
                dtype=str(dtype).removeprefix("torch."),
                seed=seed,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                logprobs_mode=logprobs_mode,
                enforce_eager=enforce_eager,
                max_num_batched_tokens=max_num_batched_tokens,
                skip_tokenizer_init=True,  # prompts arrive as ids; texts are decoded by our tokenizer
                generation_config="vllm",  # no sampling defaults from the checkpoint: every setting is ours
                enable_prefix_caching=True,  # the G rows of a group share their prompt's blocks
                # DDP: one engine per rank inside the trainer's process group (module docstring); else one process.
                distributed_executor_backend="external_launcher" if distributed else None,
                use_tqdm_on_load=False,  # its progress bar would print past the log file
                **lora,
            )
        self.context = max_model_len or getattr(getattr(self.llm, "model_config", None), "max_model_len", None)

    schedules_batches = True  # vLLM schedules its own batches: an evaluation sends the whole set in one call

    @property
    def pad(self) -> int:
        """The id after each completion's EOS: the tokenizer's pad token, else the first EOS id (as HF generate)."""
        return pad_token_id(self.tokenizer, self.eos)

    def describe(self) -> str:
        """One line for the terminal at start: the engine, its dtype, its memory and how weights reach it."""
        import vllm

        if self.kv_cache_memory_bytes is not None:
            memory = f"KV cache {self.kv_cache_memory_bytes / 2**20:.0f} MiB"
        elif self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory / 2**30
            memory = f"{self.gpu_memory_utilization:g} of the GPU's {total:.0f} GiB"
        else:
            memory = f"{self.gpu_memory_utilization:g} of free memory for its KV cache"
        push = "LoRA adapter served by vLLM, new version per iteration" if self.adapter else "full weights pushed"
        log = f"; its log: {self.log_file}" if self.log_file else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"rollout engine: vLLM {vllm.__version__} on {self.device.type}, {dtype}, {memory}; {push}{log}"

    def _params(self, sampling: Sampling, max_tokens: int, seed: int | None, row: int):
        """One request's `SamplingParams`: plain temperature/top-p (greedy: temperature 0), ending on our EOS ids,
        seeded with `derive_seed(seed, row)`, returning the sampled token's log-prob; the head's unused rows biased
        out (`unused_logit_bias`)."""
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0,
            max_tokens=max_tokens,
            min_tokens=min(sampling.min_new_tokens, max_tokens),
            stop_token_ids=self.eos,
            seed=None if seed is None or sampling.greedy else derive_seed(seed, row),
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            logit_bias=self.unused_bias,
        )

    def continue_ids(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        budgets: Sequence[int],
        rows: Sequence[int],
        seed: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One continuation per token-id context (`llm_pg.engines.episodes`): at most `budgets[i]` new ids, up to and
        including the first EOS; request i seeded with `derive_seed(seed, rows[i])` (its episode's row, so a row's
        tokens do not depend on which other rows are still running). Also each sampled token's log-prob."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in contexts]
        params = [self._params(sampling, budget, seed, row) for budget, row in zip(budgets, rows, strict=True)]
        lora_request = self.adapter.request if self.adapter is not None else None
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
        ids, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            ids.append(tokens)
            logprobs.append([completion.logprobs[t][token].logprob for t, token in enumerate(tokens)])
        return ids, logprobs

    @torch.no_grad()
    def load_weights(self, model: nn.Module) -> None:
        """Make vLLM sample from `model`'s current weights: a new adapter version (LoRA), or every weight pushed
        (full fine-tuning); then drop the stale prefix cache."""
        if self.adapter is not None:
            self.adapter.push(model)  # the base weights never change; vLLM loads the adapter at the next request
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
            self.llm.collective_rpc(repack_tied_lm_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after new weights (requests still running?)")

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: Sampling,
        *,
        num_samples: int = 1,
        seed: int | None = None,
    ) -> Generation:
        """`num_samples` completions per conversation, as `llm_pg.models.generation.generate`, plus sampled log-probs.

        Plain temperature/top-p sampling (no top-k, no penalties). Row r (= i*G + j) is one request seeded
        with `derive_seed(seed, r)`: the same seed gives the same tokens, in any process; `seed=None` draws
        from vLLM's own generator.
        """
        from vllm.inputs import TokensPrompt

        encoded = encode_prompts(
            self.tokenizer,
            conversations,
            sampling.max_prompt_tokens,
            sampling.chat_template,
            self.context,
            sampling.max_new_tokens,
        )
        prompt_ids = encoded["input_ids"].repeat_interleave(num_samples, dim=0)  # [N, P]
        prompt_mask = encoded["attention_mask"].repeat_interleave(num_samples, dim=0)  # [N, P]
        requests = [
            TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist())
            for ids, mask in zip(prompt_ids, prompt_mask, strict=True)
        ]
        params = [self._params(sampling, sampling.max_new_tokens, seed, row) for row in range(len(requests))]
        lora_request = self.adapter.request if self.adapter is not None else None
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
        completions = [out.outputs[0] for out in outputs]
        width = max(len(c.token_ids) for c in completions)  # C: the longest completion, as HF generate pads
        completion_ids = torch.full((len(completions), width), self.pad, dtype=torch.long)  # [N, C]
        sampled_logprobs = torch.zeros((len(completions), width), dtype=torch.float32)  # [N, C]
        for row, completion in enumerate(completions):
            ids = list(completion.token_ids)
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            steps = completion.logprobs
            sampled_logprobs[row, : len(ids)] = torch.tensor([steps[t][tok].logprob for t, tok in enumerate(ids)])
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return single_turn(
            prompt_ids.to(self.device),
            prompt_mask.to(self.device),
            completion_ids.to(self.device),
            texts,
            self.eos,
            sampled_logprobs.to(self.device),
        )
