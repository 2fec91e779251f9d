"""PolicyGradientModule: the manual-optimization loop that ReinforceModule and GRPOModule share.

One Lightning training step is one RL iteration: the RolloutCallback has already sampled and scored
a rollout (`batch["rollout"]`); `training_step` runs `epochs` shuffled passes over it in micro-batches
of `minibatch_size` rows, accumulating `grad_accum_steps` micro-batches per clipped optimizer step.
Subclasses define only `epochs` and `loss`.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod

import lightning as L
import torch
from torch import Tensor

from llm_pg.callbacks.evaluation import evaluate, run_dir
from llm_pg.losses import masked_mean, token_entropy, token_logprobs
from llm_pg.models import LoRA, default_dtype, frozen_copy, load_policy, load_tokenizer, resolve_model_path
from llm_pg.rollout import RolloutBatch, derive_seed


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class PolicyGradientModule(L.LightningModule, ABC):
    """Shared settings (the YAML keys under `model.init_args`).

    Args:
        model_name_or_path: hub id, local directory, or `tiny` for the bundled CPU model.
        iterations: RL iterations to train (one rollout and its update each).
        lora: LoRA settings; `lora.r = 0` trains every weight and keeps a frozen copy as the reference.
        dtype: `bfloat16`, `float32`, ...; default bf16 on a GPU and float32 on the CPU.
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        chat_template: wrap prompts in the tokenizer's chat template.
        group_size: completions sampled per prompt (G).
        prompts_per_step: prompts per iteration (linked from `data.prompts_per_step`).
        minibatch_size: rows per forward/backward pass.
        grad_accum_steps: micro-batches whose gradients make one optimizer step.
        kl_coef: weight of the KL penalty; 0 loads and runs no reference model.
        lr, weight_decay, warmup_steps: AdamW (betas 0.9, 0.95); the learning rate ramps linearly over the first
            `warmup_steps` RL iterations (`lr * min(1, (iteration + 1) / warmup_steps)`, as in the course).
        max_grad_norm: gradient-norm clip per optimizer step.
        adv_clip: advantages are clipped to +-adv_clip after group normalisation.
        temperature, top_p, max_new_tokens, min_new_tokens, max_prompt_tokens: sampling.
        eval_every: greedy evaluation every this many iterations (and at iteration 0 and the end).
        eval_max_new_tokens: generation budget for evaluation (default: max_new_tokens).
        logprob_batch_size: rows per no-grad forward pass for old/reference log-probs and evaluation.
        log_generations_every: iterations between sampled-completion tables (0: never).
        seed: derives sampling, shuffling and dropout seeds (linked from the top-level `seed`).
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        iterations: int = 51,
        lora: LoRA | None = None,
        dtype: str | None = None,
        gradient_checkpointing: bool = False,
        chat_template: bool = True,
        group_size: int = 6,
        prompts_per_step: int = 8,
        minibatch_size: int = 8,
        grad_accum_steps: int = 6,
        kl_coef: float = 0.05,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float = 0.5,
        adv_clip: float = 5.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 24,
        min_new_tokens: int = 0,
        max_prompt_tokens: int | None = None,
        eval_every: int = 10,
        eval_max_new_tokens: int | None = None,
        logprob_batch_size: int = 32,
        log_generations_every: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold trainable weights only (the reference never)
        self.lora = lora
        _check(iterations >= 1, f"model.iterations must be >= 1, got {iterations}")
        _check(group_size >= 2, f"model.group_size must be >= 2 to normalise rewards in a group, got {group_size}")
        _check(prompts_per_step >= 1, f"data.prompts_per_step must be >= 1, got {prompts_per_step}")
        _check(minibatch_size >= 1, f"model.minibatch_size must be >= 1, got {minibatch_size}")
        _check(grad_accum_steps >= 1, f"model.grad_accum_steps must be >= 1, got {grad_accum_steps}")
        rows = prompts_per_step * group_size
        _check(
            minibatch_size <= rows,
            f"model.minibatch_size={minibatch_size} is larger than one iteration's {rows} rows "
            f"(prompts_per_step {prompts_per_step} x group_size {group_size}); lower minibatch_size",
        )
        _check(kl_coef >= 0, f"model.kl_coef must be >= 0, got {kl_coef}")
        _check(temperature > 0, f"model.temperature must be > 0 (use eval for greedy decoding), got {temperature}")
        _check(0 < top_p <= 1, f"model.top_p must be in (0, 1], got {top_p}")
        _check(max_new_tokens >= 1, f"model.max_new_tokens must be >= 1, got {max_new_tokens}")
        _check(warmup_steps >= 0, f"model.warmup_steps must be >= 0, got {warmup_steps}")
        _check(max_grad_norm > 0, f"model.max_grad_norm must be > 0, got {max_grad_norm}")
        _check(eval_every >= 1, f"model.eval_every must be >= 1, got {eval_every}")
        resolve_model_path(model_name_or_path)  # a missing local directory fails here, before any loading
        self.iteration = 0  # RL iterations completed; saved in checkpoints
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.optimizer_steps = 0
        self.latest_eval: dict[str, float] = {}
        self.elapsed_before = 0.0  # training seconds of earlier attempts (resume)
        self._clock = time.perf_counter()
        self.policy = None
        self.tokenizer = None
        self._reference: list[torch.nn.Module] = []  # a list, so the reference is not a submodule

    # ---- what the algorithms define -------------------------------------------------------------------

    @property
    @abstractmethod
    def epochs(self) -> int:
        """Passes over each rollout."""

    @property
    def needs_old_logp(self) -> bool:
        return False

    @abstractmethod
    def loss(self, logp: Tensor, rollout: RolloutBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one micro-batch from its policy log-probs `[b, C]`."""

    # ---- models ---------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        dtype = getattr(torch, hp.dtype) if hp.dtype else default_dtype(self.device)
        self.tokenizer = load_tokenizer(hp.model_name_or_path)
        self.policy = load_policy(hp.model_name_or_path, dtype, self.lora, hp.gradient_checkpointing)
        if hp.kl_coef > 0 and not self.uses_lora:
            self._reference = [frozen_copy(self.policy)]

    @property
    def uses_lora(self) -> bool:
        return self.lora is not None and self.lora.r > 0

    @property
    def reference(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    def on_train_start(self) -> None:
        self._clock = time.perf_counter() - self.elapsed_before
        # One training step runs many backward passes and optimizer steps after a single forward of the
        # DDP-wrapped module, which DDP's reducer cannot follow; gradients are averaged explicitly instead
        # (`_average_gradients_across_ranks`), so the reducer is switched off.
        wrapped = self.trainer.strategy.model
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            wrapped.require_backward_grad_sync = False

    def configure_callbacks(self):
        from llm_pg.callbacks import EvalCallback, GenerationsCallback
        from llm_pg.callbacks.rollout import RolloutCallback

        return [RolloutCallback(), EvalCallback(), GenerationsCallback()]

    def sequence_logprobs(
        self, model: torch.nn.Module, rollout: RolloutBatch, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Completion log-probs `[b, C]` at the sampling temperature, and optionally the token entropy `[b, C]`."""
        mask = rollout.attention_mask
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
        completion_len = rollout.input_ids.shape[1] - rollout.prompt_len
        # Only the last C+1 positions' logits are needed: position P-1 scores the first completion token.
        logits = model(
            input_ids=rollout.input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            logits_to_keep=completion_len + 1,
        ).logits  # [b, C+1, V]
        logp = token_logprobs(logits, rollout.input_ids[:, rollout.prompt_len - 1 :], self.hparams.temperature)
        return logp, token_entropy(logits[:, :-1], self.hparams.temperature) if with_entropy else None

    @torch.no_grad()
    def frozen_logprobs(self, rollout: RolloutBatch, reference: bool) -> Tensor:
        """Log-probs `[N, C]` under pi_old (the policy now) or pi_ref, in no-grad micro-batches."""
        model = self.policy if not reference else (self.reference or self.policy)
        was_training = self.policy.training
        self.policy.eval()
        chunks = []
        for start in range(0, len(rollout), self.hparams.logprob_batch_size):
            part = rollout.select(torch.arange(start, min(start + self.hparams.logprob_batch_size, len(rollout))))
            if reference and self.uses_lora:
                with self.policy.disable_adapter():
                    chunks.append(self.sequence_logprobs(model, part)[0])
            else:
                chunks.append(self.sequence_logprobs(model, part)[0])
        self.policy.train(was_training)
        return torch.cat(chunks)

    # ---- optimisation ---------------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        hp = self.hparams
        optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.95), weight_decay=hp.weight_decay)
        warmup = hp.warmup_steps
        # Stepped once per RL iteration (in training_step), so its step count is the iteration.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda iteration: min(1.0, (iteration + 1) / warmup) if warmup > 0 else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch: dict, batch_idx: int) -> None:
        rollout: RolloutBatch = batch["rollout"].to(self.device)
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        rank = self.global_rank
        torch.manual_seed(derive_seed(hp.seed, self.iteration, rank, "dropout"))
        shuffle = torch.Generator().manual_seed(derive_seed(hp.seed, self.iteration, rank, "shuffle"))
        self.policy.train()
        start_time = time.perf_counter()
        totals: dict[str, float] = {}
        ratio_max, grad_norms, micro_count = 0.0, [], 0
        for _ in range(self.epochs):
            micro = list(rollout.minibatches(hp.minibatch_size, shuffle))
            for first in range(0, len(micro), hp.grad_accum_steps):
                group = micro[first : first + hp.grad_accum_steps]
                for part in group:
                    logp, entropy = self.sequence_logprobs(self.policy, part, with_entropy=True)
                    loss, stats = self.loss(logp, part)
                    # Divide by the micro-batches actually accumulated, so a short last group is a mean too.
                    self.manual_backward(loss / len(group))
                    stats = {"loss": loss.detach(), "entropy": masked_mean(entropy, part.completion_mask), **stats}
                    ratio_max = max(ratio_max, float(stats.pop("ratio_max", 1.0)))
                    for name, value in stats.items():
                        totals[name] = totals.get(name, 0.0) + float(value)
                    micro_count += 1
                grad_norms.append(self._clipped_step(optimizer))
        metrics = {f"train/{k}": v / micro_count for k, v in totals.items()}
        finite_norms = [g for g in grad_norms if math.isfinite(g)]
        metrics.update(
            {
                "train/ratio_max": ratio_max,
                "train/grad_norm": sum(finite_norms) / max(len(finite_norms), 1),
                "train/lr": scheduler.get_last_lr()[0],  # the rate this iteration's steps used
                "train/optimizer_steps": float(self.optimizer_steps),
                "train/skipped_steps": float(self.skipped_steps),
                "time/update": time.perf_counter() - start_time,
                "time/elapsed": time.perf_counter() - self._clock,  # training wall time, resumes included
                **batch.get("rollout_metrics", {}),
            }
        )
        scheduler.step()
        self.iteration += 1
        self.trainer.datamodule.mark_consumed(batch["index"])
        if self.iteration >= hp.iterations:
            self.trainer.should_stop = True
        self.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=self.trainer.world_size > 1)
        self.log("step", float(self.iteration), on_step=True, on_epoch=False)  # x-axis: RL iterations
        self.log("reward", metrics["train/reward"], prog_bar=True, on_step=True, on_epoch=False, logger=False)
        if "exact_match" in self.latest_eval:
            self.log("eval_em", self.latest_eval["exact_match"], prog_bar=True, on_step=True, logger=False)

    def validation_step(self, batch: list, batch_idx: int) -> None:
        """`llm-pg validate`: greedy eval metrics of the current policy, averaged over the eval set."""
        metrics, _ = evaluate(self, self.trainer.datamodule.task, batch)
        logged = {f"eval/{k}": v for k, v in metrics.items()}
        self.log_dict(logged, batch_size=len(batch), on_epoch=True, sync_dist=self.trainer.world_size > 1)

    def _clipped_step(self, optimizer) -> float:
        """Clip the accumulated gradient and step, or skip (and count) when it is not finite."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self._average_gradients_across_ranks(params)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.hparams.max_grad_norm))
        if math.isfinite(norm):
            optimizer.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        return norm

    def _average_gradients_across_ranks(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce the accumulated gradients (mean over ranks) in one flat buffer.

        DDP's reducer is off (see `on_train_start`): one flat all-reduce per optimizer step instead.
        """
        world = self.trainer.world_size
        if world == 1 or not torch.distributed.is_initialized():
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= world
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def on_train_end(self) -> None:
        """The trained policy (the adapter alone with LoRA) and tokenizer, loadable by transformers/peft."""
        if self.trainer.is_global_zero:
            out = run_dir(self.trainer) / "final"
            self.policy.save_pretrained(out)
            self.tokenizer.save_pretrained(out)

    # ---- checkpoints ----------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {f"policy.{n}" for n, p in self.policy.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["llm_pg"] = {
            "iteration": self.iteration,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
            "latest_eval": dict(self.latest_eval),
            "elapsed": time.perf_counter() - self._clock,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("llm_pg", {})
        self.iteration = state.get("iteration", 0)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.optimizer_steps = state.get("optimizer_steps", 0)
        self.latest_eval = dict(state.get("latest_eval", {}))
        self.elapsed_before = state.get("elapsed", 0.0)
