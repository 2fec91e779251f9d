"""What a fit's module builds once, as a mixin of `PolicyGradientModule`: its models (`configure_model`), its rollout
engine (`engine`), and the typed contexts its stages receive instead of the module (`rollout_context`,
`update_context`, `eval_context`, over `logprobs` and `sampler`). Each reads the module's settings (`hparams`) here,
so that nothing below the module does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from llm_pg.callbacks.rollout import OldPass, RolloutContext, Variants
from llm_pg.callbacks.sharded_eval import EvalContext
from llm_pg.core.rollout import RolloutBatch
from llm_pg.engines import Engine, EngineSettings, build_engine
from llm_pg.engines.episodes import Sampler
from llm_pg.models.generation import Sampling, eos_token_ids, pad_token_id
from llm_pg.models.loading import (
    auto_dtype,
    autocast_forward,
    default_dtype,
    load_policy,
    load_reference,
    load_tokenizer,
    master_dtype,
)
from llm_pg.models.parallel import is_sharded
from llm_pg.modules.distributed import backward_sync_off, shard_for_strategy
from llm_pg.modules.logprobs import LogProbs, prefix_sharing_in_graph
from llm_pg.modules.update import UpdateContext
from llm_pg.runs.directory import run_dir
from llm_pg.runs.guards import Ranks, scorer_of


class FitComponents:
    """The models, the engine and the contexts of a fit (see the module docstring); mixed into
    `llm_pg.modules.base.PolicyGradientModule`, whose attributes (`hparams`, `policy`, `lora`, ...) it reads."""

    # ---- models ---------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        # Not self.device: the module moves to its device only after this hook.
        device = self._trainer.strategy.root_device if self._trainer is not None else self.device
        if hp.dtype == "auto":
            self.compute_dtype, why = auto_dtype(device)
            rank_zero_info(f"llm-pg: dtype auto: {str(self.compute_dtype).removeprefix('torch.')} ({why})")
        else:
            self.compute_dtype = getattr(torch, hp.dtype) if hp.dtype else default_dtype(device)
        self.tokenizer = load_tokenizer(hp.model_name_or_path)
        weights = master_dtype(self.compute_dtype, self.lora)
        self.policy = load_policy(hp.model_name_or_path, weights, self.lora, self.speed.gradient_checkpointing)
        if hp.kl_coef > 0 and not self.uses_lora:
            self._reference = [load_reference(hp.model_name_or_path, self.compute_dtype)]
        if self._trainer is not None:  # FSDP2 (ModelParallelStrategy): policy and reference sharded over the ranks
            r = self.lora.r if self.uses_lora else 0
            strategy = self._trainer.strategy
            shard_for_strategy(
                strategy, self.policy, self.reference, self.device_mesh, self.compute_dtype, r, hp.rollout_engine
            )

    @property
    def engine(self) -> Engine:
        """The rollout engine (`rollout_engine`), holding the policy's weights of the current iteration.

        Built on first use (after `configure_model` and any checkpoint restore). When an update has happened since
        the engine last received weights, they are pushed first: once per iteration, before the first generation
        that follows the update (the end-of-iteration evaluation, else the next rollout). HF samples with the policy
        itself, so it has nothing to copy; vLLM receives every weight (LoRA merged) and drops its prefix cache.
        """
        if self._engine is None:
            self._engine = build_engine(
                self.hparams.rollout_engine, self.policy, self.tokenizer, self.engine_settings()
            )
        if self._engine_iteration != self.iteration:
            self._engine.load_weights(self.policy)
            self._engine_iteration = self.iteration
        return self._engine

    def engine_settings(self) -> EngineSettings:
        """What the rollout engine is built from (`llm_pg.engines.EngineSettings`): the compute dtype, this rank's
        device and seed, `max_model_len = max_prompt_tokens + the larger of max_new_tokens and
        evaluation.max_new_tokens` (the model's own limit when prompts are not cut), the log-prob mode that matches
        `logprob_temperature`, the policy's EOS ids, the `vllm` group, and vLLM's log file, `<run dir>/vllm.log`
        (`vllm_rank<k>.log` under DDP; none outside a trainer's run)."""
        hp, trainer = self.hparams, self._trainer
        longest_new = max(hp.max_new_tokens, self.evaluation.max_new_tokens or 0)
        log_file = None
        if trainer is not None:
            log_file = run_dir(trainer) / (
                "vllm.log" if trainer.world_size == 1 else f"vllm_rank{self.global_rank}.log"
            )
        return EngineSettings(
            model_name_or_path=hp.model_name_or_path,
            eos=tuple(eos_token_ids(self.policy, self.tokenizer)),
            dtype=self.compute_dtype,
            device=self.device,
            autocast=self.autocast,
            share_prompt_prefix=self.speed.share_prompt_prefix,
            compiled=self.speed.compile_generation,
            max_model_len=hp.max_prompt_tokens + longest_new if hp.max_prompt_tokens is not None else None,
            seed=hp.seed + self.global_rank,  # unseeded requests differ by rank
            logprob_temperature=hp.logprob_temperature,
            temperature=hp.temperature,
            lora_rank=self.lora.r if self.uses_lora else None,
            gpu_memory_utilization=self.vllm.gpu_memory_utilization,
            kv_cache_memory_bytes=self.vllm.kv_cache_memory_bytes,
            max_num_batched_tokens=self.vllm.max_num_batched_tokens,
            log_file=log_file,
            world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            strategy=trainer.strategy if trainer is not None else None,
        )

    def sampling(self, evaluation: bool = False) -> Sampling:
        """How the rollouts are sampled; with `evaluation`, how the evaluation samples (`evaluation.max_new_tokens`,
        `evaluation.temperature` for `evaluation.samples`, no minimum length; `.greedy_version()` for its greedy
        pass)."""
        hp = self.hparams
        if evaluation:
            return Sampling(
                max_new_tokens=self.evaluation.max_new_tokens or hp.max_new_tokens,
                temperature=self.evaluation.temperature,
                top_p=hp.top_p,
                max_prompt_tokens=hp.max_prompt_tokens,
                chat_template=hp.chat_template,
            )
        return Sampling(
            max_new_tokens=hp.max_new_tokens,
            min_new_tokens=hp.min_new_tokens,
            temperature=hp.temperature,
            top_p=hp.top_p,
            max_prompt_tokens=hp.max_prompt_tokens,
            chat_template=hp.chat_template,
        )

    def autocast(self) -> AbstractContextManager:
        """Forward passes in the compute dtype: autocast casts float32 weights per op (nothing to do in float32), and
        a LoRA adapter's inputs are not cast to float32 first (`llm_pg.models.loading.autocast_forward`)."""
        if self.compute_dtype in (None, torch.float32):
            return nullcontext()
        return autocast_forward(self.policy, self.device.type, self.compute_dtype)

    @property
    def logprob_temperature(self) -> float:
        """The T of every log-prob and the entropy: `logprob_temperature`, or the sampling temperature when null."""
        hp = self.hparams
        return hp.temperature if hp.logprob_temperature is None else hp.logprob_temperature

    @property
    def uses_lora(self) -> bool:
        return self.lora is not None and self.lora.r > 0

    @property
    def reference(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    @property
    def logprobs(self) -> LogProbs:
        """How completion log-probs are computed (`llm_pg.modules.logprobs.LogProbs`): at `logprob_temperature`, in
        the compute dtype, with the `speed` group's `logprob_chunk_size`, `share_prompt_prefix` and
        `logprob_batch_size`. Built once, after `configure_model`. A policy sharded by FSDP2 (its reference is sharded
        with it) runs its head in one call and shares no prompt prefix: its root forward gathers the weights."""
        if self._logprobs is None:
            speed = self.speed
            sharded = is_sharded(self.policy)
            self._logprobs = LogProbs(
                policy=self.policy,
                reference=self.reference,
                lora=self.uses_lora,
                temperature=self.logprob_temperature,
                chunk_size=0 if sharded else speed.logprob_chunk_size,
                share_prefix=speed.share_prompt_prefix and not sharded,
                shared_dropout=speed.share_prompt_dropout,
                batch_size=speed.logprob_batch_size,
                autocast=self.autocast,
                pack=speed.pack_sequences,
            )
        return self._logprobs

    @property
    def update_context(self) -> UpdateContext:
        """What every update of this fit needs (`llm_pg.modules.update.UpdateContext`), built at the first one."""
        if self._update is None:
            hp, speed = self.hparams, self.speed
            world = self.trainer.world_size
            sharing = prefix_sharing_in_graph(self.policy, self.logprobs.share_prefix, speed.share_prompt_dropout)
            self._update = UpdateContext(
                policy=self.policy,
                logprobs=self.logprobs,
                objective=self.objective,
                epochs=self.epochs,
                minibatch_size=hp.minibatch_size,
                grad_accum_steps=hp.grad_accum_steps,
                max_grad_norm=hp.max_grad_norm,
                grouped=speed.share_prompt_prefix,
                by_length=speed.group_by_length and not sharing,
                world_size=world,
                sharded=is_sharded(self.policy),
                backward=self.manual_backward,
                no_sync=partial(backward_sync_off, self.trainer) if world > 1 else nullcontext,
            )
        return self._update

    def sampler(self, datamodule) -> Sampler:
        """How this fit's prompts become completions (`llm_pg.engines.episodes.Sampler`): `datamodule`'s task,
        scored by its reward workers, with the policy's tokenizer and EOS ids."""
        task = datamodule.task
        return Sampler(
            task=task,
            scorer=scorer_of(datamodule, task),
            tokenizer=self.tokenizer,
            eos=tuple(eos_token_ids(self.policy, self.tokenizer)),
            policy=self.policy,
            device=self.device,
        )

    @property
    def ranks(self) -> Ranks:
        """This process's rank and the data-parallel ranks a failure stops together
        (`llm_pg.runs.guards.stop_together`)."""
        return Ranks(self.global_rank, self._trainer.world_size if self._trainer is not None else 1, self.device)

    def rollout_context(self, datamodule) -> RolloutContext:
        """What every rollout of this fit needs (`llm_pg.callbacks.rollout.RolloutContext`), built once by the
        rollout callback at the fit's first rollout."""
        hp = self.hparams
        sampler = self.sampler(datamodule)
        if self.needs_pi_old:
            old_pass = OldPass.NEVER if self.pi_old_from_first_pass else OldPass.ALWAYS
        else:
            old_pass = OldPass.WITH_ENGINE_LOGPROBS  # no ratio: pi_old only to compare with the engine's log-probs
        return RolloutContext(
            sampler=sampler,
            sampling=self.sampling(),
            variants=Variants(
                group_size=hp.group_size,
                advantage=hp.advantage,
                adv_clip=hp.adv_clip,
                filter_zero_std_groups=hp.filter_zero_std_groups,
                max_sampling_rounds=hp.max_sampling_rounds,
                mask_truncated=hp.mask_truncated,
                overlong_buffer=hp.overlong_buffer,
                overlong_penalty=hp.overlong_penalty,
            ),
            prompts_per_step=hp.prompts_per_step,
            seed=hp.seed,
            ranks=self.ranks,
            pad=pad_token_id(self.tokenizer, sampler.eos),
            pi_old=self.logprobs.no_grad,
            pi_ref=partial(self.logprobs.no_grad, reference=True) if hp.kl_coef > 0 else None,
            old_pass=old_pass,
        )

    def eval_context(self, datamodule) -> EvalContext:
        """What every evaluation of this fit needs (`llm_pg.callbacks.sharded_eval.EvalContext`)."""
        return EvalContext(
            sampler=self.sampler(datamodule),
            sampling=self.sampling(evaluation=True),
            samples=self.evaluation.samples,
            batch_rows=self.evaluation.generate_batch_size,
            whole_set=self.engine.schedules_batches,
            fallback_rows=self.speed.logprob_batch_size,
            seed=self.hparams.seed,
            ranks=self.ranks,
        )

    def completion_logprobs(
        self, model: torch.nn.Module, rollout: RolloutBatch, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Completion log-probs `[b, C]` at `logprob_temperature`, and optionally the token entropy `[b, C]`
        (`LogProbs.__call__`)."""
        return self.logprobs(model, rollout, with_entropy, entropy_grad)

    def old_logprobs(self, rollout: RolloutBatch) -> Tensor:
        """pi_old: log-probs `[N, C]` of the completions under the policy as it is now (before the update), no grad."""
        return self.logprobs.no_grad(rollout)

    def reference_logprobs(self, rollout: RolloutBatch) -> Tensor:
        """pi_ref: log-probs `[N, C]` under the frozen reference (the base model: LoRA's adapter switched off, or
        the frozen copy), no grad."""
        return self.logprobs.no_grad(rollout, reference=True)
