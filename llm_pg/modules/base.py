"""PolicyGradientModule: the manual-optimization loop that ReinforceModule and GRPOModule share.

One Lightning training step is one RL iteration: the RolloutCallback has already sampled and scored a rollout
(`batch.rollout`, a `llm_pg.data.batches.ScoredRollout`); `training_step` runs `epochs` shuffled passes
over it in micro-batches of `minibatch_size` rows, accumulating `grad_accum_steps` micro-batches per clipped
optimizer step (`llm_pg/modules/update.py`). Subclasses define only `epochs` and `objective`.

Precision: `dtype` is the compute dtype. Forward passes (rollout, log-probs, training, eval) run under
`self.autocast()`; the optimizer updates float32 master weights (full fine-tuning) or float32 LoRA
adapters over a frozen base in the compute dtype; the frozen full-fine-tuning reference is held in the
compute dtype. Under DDP each backward runs with the reducer off and the accumulated gradient is
all-reduced once per optimizer step.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from llm_pg.callbacks import EvalCallback, GenerationsCallback
from llm_pg.callbacks.rollout import RolloutCallback
from llm_pg.callbacks.sharded_eval import evaluate
from llm_pg.core.advantages import Advantage
from llm_pg.core.correction import SamplerCorrection
from llm_pg.core.objectives import ClippedSurrogate, LossTerms, Objective, ObjectiveFactory
from llm_pg.core.rollout import derive_seed
from llm_pg.core.schedule import LrSchedule, lr_factor
from llm_pg.data.batches import PromptBatch
from llm_pg.engines import Engine, SamplerHealth
from llm_pg.models.loading import (
    LoRA,
    resolve_model_path,
)
from llm_pg.models.parallel import full_state_dict, is_sharded, unsharded
from llm_pg.modules.components import FitComponents
from llm_pg.modules.groups import (
    GROUPS,
    Correction,
    Evaluation,
    GenerationTables,
    Speed,
    VLLMSettings,
    as_group,
    flat_settings,
)
from llm_pg.modules.logprobs import LogProbs, has_dropout
from llm_pg.modules.settings import (
    RolloutEngine,
    check_objective,
    check_off_policy_mask,
    check_settings,
    objective_config,
    objective_factory,
)
from llm_pg.modules.update import UpdateContext, run_update, steps_per_pass
from llm_pg.runs.directory import run_dir
from llm_pg.runs.guards import DivergenceGuard, RunStopped, weights_finite


class PolicyGradientModule(FitComponents, L.LightningModule, ABC):
    """Shared settings (the YAML keys under `model.init_args`): the course's keys at the top level, the rest in typed
    groups (`llm_pg.modules.groups`; each group's own docstring lists its keys). Below, in order: the model; the
    iteration and the optimizer; sampling; DAPO's rollout variants (off by default, as in the course); the groups; the
    run.

    Args:
        model_name_or_path: hub id, local directory, or `tiny` for the bundled CPU model.
        iterations: RL iterations to train (one rollout and its update each).
        lora: LoRA settings; `lora.r = 0` trains every weight and keeps a frozen copy as the reference.
        dtype: compute dtype, `bfloat16` or `float32` (null: bf16 on a GPU, float32 on the CPU; `auto`: bf16 on a
            GPU and on a CPU with avx512_bf16 or amx_bf16, float32 elsewhere, said at the start). Trainable
            weights are float32 whatever it is: full fine-tuning keeps float32 master weights, LoRA float32 adapters.
        chat_template: wrap prompts in the tokenizer's chat template.

        group_size: completions sampled per prompt (G).
        prompts_per_step: prompts per iteration (linked from `data.prompts_per_step`).
        minibatch_size: rows per forward/backward pass.
        grad_accum_steps: micro-batches whose gradients make one optimizer step.
        kl_coef: weight of the KL penalty; 0 loads and runs no reference model.
        clip_eps: the ratio's clip range `[1 - clip_eps, 1 + clip_eps]`, for an objective with a ratio.
        lr: AdamW's peak learning rate (betas 0.9, 0.95).
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: RL iterations over which the learning rate ramps linearly,
            `lr * min(1, (iteration + 1) / warmup_steps)`, as in the course (0: the full rate at once).
        lr_schedule: after warmup, `constant` (the course) | `linear` | `cosine` decay from `lr` to
            `min_lr_ratio * lr` over the remaining iterations (`llm_pg.core.schedule`), stepped per iteration.
        min_lr_ratio: the floor of a `linear` or `cosine` decay, as a share of `lr` (0: decay to 0).
        max_grad_norm: gradient-norm clip per optimizer step.
        adv_clip: advantages are clipped to +-adv_clip after group normalisation.
        advantage: estimator `grpo` (course) | `dr_grpo` | `rloo` | `reinforce_pp`; `adv_clip` applies after it.

        temperature: sampling temperature of the rollouts.
        top_p: nucleus sampling of the rollouts: the smallest set of tokens whose probability reaches top_p (1: off).
        max_new_tokens: most tokens sampled per completion; a completion that reaches it without EOS is truncated.
        min_new_tokens: EOS is not sampled before this many completion tokens.
        max_prompt_tokens: a longer prompt keeps its last this many tokens, with a warning (null: whole prompts).
        logprob_temperature: T in `log_softmax(logits / T)` for pi_theta, pi_old, pi_ref and the entropy. 1.0 (the
            course): the raw model distribution; null: the sampling temperature (TRL). See docs/algorithms.md.
        rollout_engine: `hf` (HF generate with the policy itself) | `vllm` (vLLM colocated in this process, fed the
            policy's weights after every update; `llm-pg[vllm]`). Every rollout and evaluation samples through it.

        filter_zero_std_groups: drop groups whose rewards are all equal from the update (dynamic sampling). Under
            DDP every rank keeps the fewest groups any rank has (`llm_pg.callbacks.rollout`).
        max_sampling_rounds: with `filter_zero_std_groups`, the refill: while fewer than `prompts_per_step` groups
            have reward spread, sample the data stream's next batch of prompts too, up to this many batches per
            iteration; the update trains on the first `prompts_per_step` groups with spread (fewer when the rounds
            run out: `train/groups_kept`). 1: no refill. Logs `train/sampling_rounds` and `train/prompts_drawn`.
        mask_truncated: completions that end without an EOS are left out of the loss (overlong filtering).
        overlong_buffer: soft overlong punishment: a completion longer than `max_new_tokens - overlong_buffer`
            tokens gets a reward term falling linearly to `-overlong_penalty` at `max_new_tokens`, the column
            `reward_overlong` (0: off). Added to any task's rollout reward, before the advantages; the evaluation's
            reward stays the task's own.
        overlong_penalty: the largest overlong punishment, at `max_new_tokens` tokens.

        objective: the policy objective, by class (`llm_pg.core.objectives`: `ClippedSurrogate`, `GSPO`, `CISPO`,
            `SequenceMean`, or their short names `clip`, `gspo`, `cispo`, `sequence_mean`) with its own settings
            (`aggregation`, `entropy_coef`, `clip_eps_high`, ...). Each module has its default.
        evaluation: when and how the policy is evaluated (`groups.Evaluation`).
        correction: the importance correction against the rollout engine's sampler (`groups.Correction`).
        speed: levers that change the cost, not the result (`groups.Speed`).
        vllm: the vLLM engine's memory and batching (`groups.VLLMSettings`).
        log_generations: the sampled-completion tables (`groups.GenerationTables`).

        max_skipped_iterations: stop the run (exit 1, no `final/`, no `COMPLETE`) after this many consecutive
            iterations in which every optimizer step was skipped as non-finite (or the loss was not finite); a
            non-finite weight stops it at once (`llm_pg.runs.guards`).
        seed: derives sampling, shuffling and dropout seeds (linked from the top-level `seed`).
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        iterations: int = 51,
        lora: LoRA | None = None,
        dtype: str | None = None,
        chat_template: bool = True,
        group_size: int = 6,
        prompts_per_step: int = 8,
        minibatch_size: int = 8,
        grad_accum_steps: int = 6,
        kl_coef: float = 0.05,
        clip_eps: float = 0.2,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: LrSchedule = "constant",
        min_lr_ratio: float = 0.0,
        max_grad_norm: float = 0.5,
        adv_clip: float = 5.0,
        advantage: Advantage = "grpo",
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 24,
        min_new_tokens: int = 0,
        max_prompt_tokens: int | None = None,
        logprob_temperature: float | None = 1.0,
        rollout_engine: RolloutEngine = "hf",
        filter_zero_std_groups: bool = False,
        max_sampling_rounds: int = 1,
        mask_truncated: bool = False,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        objective: ObjectiveFactory = ClippedSurrogate,
        evaluation: Evaluation = Evaluation(),
        correction: Correction = Correction(),
        speed: Speed = Speed(),
        vllm: VLLMSettings = VLLMSettings(),
        log_generations: GenerationTables = GenerationTables(),
        max_skipped_iterations: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["objective"])  # a class with its settings: recorded by `record_objective`
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold trainable weights only (the reference never)
        self.lora = lora
        self.objective_factory = objective_factory(objective)
        self.evaluation = as_group(Evaluation, evaluation, "evaluation")
        self.correction = as_group(Correction, correction, "correction")
        self.speed = as_group(Speed, speed, "speed")
        self.vllm = as_group(VLLMSettings, vllm, "vllm")
        self.log_generations = as_group(GenerationTables, log_generations, "log_generations")
        groups = {name: getattr(self, name) for name in GROUPS}
        # hparams may hold the CLI's dict form of `lora` and of the groups
        check_settings({**self.hparams, "lora": lora, **flat_settings(groups)})
        check_objective(self.objective)
        check_off_policy_mask(self.hparams, self.correction, self.needs_pi_old)
        resolve_model_path(model_name_or_path)  # a missing local directory fails here, before any loading
        self.record_objective()
        self._start_state(max_skipped_iterations)

    def record_objective(self) -> None:
        """The objective and the groups in `hparams` (what the loggers, W&B and `hparams.yaml` show of a run's
        settings) as a config spells them: the objective's class path and its own settings, each group a mapping."""
        groups = {name: asdict(getattr(self, name)) for name in GROUPS}
        self.save_hyperparameters({"objective": objective_config(self.objective), **groups})  # merged

    def _start_state(self, max_skipped_iterations: int) -> None:
        """The run's state before any iteration (what checkpoints save and restore), and the fit's components, built
        on first use."""
        self.iteration = 0  # RL iterations completed; saved in checkpoints
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.optimizer_steps = 0
        self.divergence = DivergenceGuard(max_skipped_iterations)
        self.stop_reason: str | None = None  # set when the run must stop as failed (`llm_pg.runs.guards.RunStopped`)
        self.latest_eval: dict[str, float] = {}
        self.elapsed_before = 0.0  # training seconds of earlier attempts (resume)
        self._clock = time.perf_counter()
        self.policy = None
        self.tokenizer = None
        self.compute_dtype: torch.dtype | None = None  # set by configure_model
        self._reference: list[torch.nn.Module] = []  # a list, so the reference is not a submodule
        self._engine: Engine | None = None  # built on first use (`engine`)
        self._engine_iteration: int | None = None  # the iteration whose weights the engine holds
        self.sampler_health = SamplerHealth(self.sampler_correction, rank_zero_warn)  # rollout/ mismatch and TIS
        self._logprobs: LogProbs | None = None  # built once the policy is loaded (`logprobs`)
        self._update: UpdateContext | None = None  # built at the first update of a fit (`update_context`)

    @property
    def sampler_correction(self) -> SamplerCorrection | None:
        """The importance correction against the sampler (`correction.mode` with its bounds), or None (off)."""
        return self.correction.sampler()

    @property
    def total_iterations(self) -> int:
        """The iterations this run trains (`iterations`): what the progress bar and the checkpoint callback count to."""
        return self.hparams.iterations

    @property
    def iteration_in_progress(self) -> int:
        """The iteration being sampled and trained now, 1-based: one past `iteration` (those completed, saved in
        checkpoints), so the number that its metrics row's `step` and its generations rows will carry."""
        return self.iteration + 1

    # ---- what the algorithms define -------------------------------------------------------------------

    @property
    @abstractmethod
    def epochs(self) -> int:
        """Passes over each rollout."""

    @property
    def objective(self) -> Objective:
        """The policy objective (`llm_pg.core.objectives`): the configured class with its own settings, given the
        module's `LossTerms` (`kl_coef`, `clip_eps`, `max_new_tokens`, the correction against the sampler)."""
        terms = LossTerms(
            kl_coef=self.hparams.kl_coef,
            clip_eps=self.hparams.clip_eps,
            max_new_tokens=self.hparams.max_new_tokens,
            correction=self.sampler_correction,
            off_policy_threshold=self.correction.off_policy_mask_threshold,
        )
        return self.objective_factory(terms)

    @property
    def needs_pi_old(self) -> bool:
        """Whether the objective has a ratio, so the update needs pi_old."""
        return self.objective.needs_old_logp

    @property
    def pi_old_from_first_pass(self) -> bool:
        """pi_old from the update's first pass instead of a separate no-grad pass: when one optimizer step covers a
        whole pass, no weight changes before every row's first forward, so the first pass's detached log-probs are
        pi_old, exactly when the policy has no dropout (`speed.reuse_first_pass_logp` accepts it with dropout)."""
        hp = self.hparams
        if not self.needs_pi_old:
            return False
        if steps_per_pass(hp.prompts_per_step * hp.group_size, hp.minibatch_size, hp.grad_accum_steps) != 1:
            return False
        return self.speed.reuse_first_pass_logp or not has_dropout(self.policy)

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)
        self._update = None  # the update's context holds the trainer it was built under: one per fit

    def on_train_start(self) -> None:
        if self.stop_reason is not None or not weights_finite(self.policy):  # never train on, or finish, a diverged run
            raise RunStopped(
                f"this checkpoint is of a run that stopped ({self.stop_reason or 'a trainable weight is not finite'}); "
                "it cannot be continued or completed: start a new --run_name (a resume keeps the settings that "
                f"diverged); iter_*.ckpt files of iteration {self.divergence.healthy_iteration} or earlier, if kept, "
                "hold the policy from before"
            )
        self._clock = time.perf_counter() - self.elapsed_before
        if self.iteration >= self.hparams.iterations:  # resumed from the final checkpoint
            rank_zero_info(
                f"run complete: {self.iteration} of model.iterations={self.hparams.iterations} iterations are done; "
                "nothing to train (raise model.iterations to continue)"
            )
            self.trainer.should_stop = True

    def configure_callbacks(self):
        hp = self.hparams
        tables = GenerationsCallback(self.log_generations.every, self.log_generations.rows, hp.group_size)
        return [RolloutCallback(), EvalCallback(self.evaluation.every), tables]

    # ---- optimisation ---------------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        hp = self.hparams
        optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.95), weight_decay=hp.weight_decay)
        # Stepped once per RL iteration (in training_step), so its step count is the iteration.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, hp.warmup_steps, hp.iterations, hp.lr_schedule, hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        scored = batch.rollout  # the RolloutCallback's ScoredRollout of these prompts
        rollout = scored.rows.to(self.device)
        hp = self.hparams
        scheduler = self.lr_schedulers()
        rank = self.global_rank
        torch.manual_seed(derive_seed(hp.seed, self.iteration, rank, "dropout"))
        shuffle = torch.Generator().manual_seed(derive_seed(hp.seed, self.iteration, rank, "shuffle"))
        self.policy.train()
        start_time = time.perf_counter()
        optimizer = self.optimizers()
        update = run_update(self.update_context, rollout, optimizer, shuffle)
        self.optimizer_steps += update.steps_taken
        self.skipped_steps += update.steps_skipped
        grad_norms = update.grad_norms
        if not grad_norms:
            rank_zero_info(
                f"iteration {self.iteration_in_progress}: every group was settled and filtered "
                "(filter_zero_std_groups): no optimizer step; the iteration still counts"
            )
        metrics = dict(update.metrics)
        finite_norms = [g for g in grad_norms if math.isfinite(g)]
        metrics.update(
            {
                "train/grad_norm": sum(finite_norms) / max(len(finite_norms), 1),
                "train/lr": scheduler.get_last_lr()[0],  # the rate this iteration's steps used
                "train/optimizer_steps": float(self.optimizer_steps),
                "train/skipped_steps": float(self.skipped_steps),
                "time/update": time.perf_counter() - start_time,
                "time/elapsed": time.perf_counter() - self._clock,  # training wall time, resumes included
                **scored.metrics,
            }
        )
        if rollout.sampled_logp is not None or self.sampler_health.correction is not None:  # else nothing to compare
            metrics |= self.sampler_health(rollout, update.old_logp)  # pi_old may come from the update's first pass
        scheduler.step()
        self.iteration += 1
        self._check_divergence(grad_norms, metrics.get("train/loss", 0.0), metrics["train/lr"])
        if self.iteration >= hp.iterations:
            self.trainer.should_stop = True
        distributed = self.trainer.world_size > 1
        maxima = {"train/ratio_max": update.ratio_max}  # the largest over ranks, not the mean
        if "rollout/logprob_mismatch_max" in metrics:
            maxima["rollout/logprob_mismatch_max"] = metrics.pop("rollout/logprob_mismatch_max")
        self.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=distributed)  # means over ranks
        self.log_dict(maxima, on_step=True, on_epoch=False, sync_dist=distributed, reduce_fx="max")
        self.log("step", float(self.iteration), on_step=True, on_epoch=False)  # x-axis: RL iterations
        self.log("reward", metrics["train/reward"], prog_bar=True, on_step=True, on_epoch=False, logger=False)
        if "exact_match" in self.latest_eval:
            self.log("eval_em", self.latest_eval["exact_match"], prog_bar=True, on_step=True, logger=False)

    def _check_divergence(self, grad_norms: list[float], loss: float, lr: float) -> None:
        """Stop the run (after this iteration is logged and saved) when it diverged (`llm_pg.runs.guards`)."""
        try:
            self.divergence.check(self.iteration, grad_norms, float(loss), weights_finite(self.policy), lr)
        except RunStopped as stop:
            self.stop_reason = str(stop)
            self.trainer.should_stop = True

    def validation_step(self, batch: list, batch_idx: int) -> None:
        """`llm-pg validate`: greedy eval metrics of the current policy, averaged over the eval set; every completion
        goes to `<run dir>/validate/eval/iter_XXXXX.jsonl` (the iteration of the checkpoint, 0 for the base model)."""
        from llm_pg.callbacks.evaluation import write_eval_rows

        context = self.eval_context(self.trainer.datamodule)
        with unsharded(self.policy):  # FSDP2: one gather, however many examples this rank decodes
            evaluation = evaluate(context, self.engine, batch, self.iteration)
        if self.trainer.is_global_zero:
            out = run_dir(self.trainer) / "eval" / f"iter_{self.iteration:05d}.jsonl"
            write_eval_rows(out, batch, evaluation, append=batch_idx > 0)
        logged = {f"eval/{k}": v for k, v in evaluation.metrics.items()}
        self.log_dict(logged, batch_size=len(batch), on_epoch=True, sync_dist=self.trainer.world_size > 1)

    def on_train_end(self) -> None:
        """The trained policy (the adapter alone with LoRA) and tokenizer, loadable by transformers/peft."""
        if self.stop_reason is not None:  # a failed run leaves no trained policy behind to be mistaken for one
            return
        state = full_state_dict(self.policy) if is_sharded(self.policy) else None  # FSDP2: every rank gathers
        if self.trainer.is_global_zero:
            out = run_dir(self.trainer) / "final"
            self.policy.save_pretrained(out, state_dict=state)
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
            "divergence": {"streak": self.divergence.streak, "healthy_iteration": self.divergence.healthy_iteration},
            "stop_reason": self.stop_reason,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("llm_pg", {})
        self.iteration = state.get("iteration", 0)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.optimizer_steps = state.get("optimizer_steps", 0)
        self.latest_eval = dict(state.get("latest_eval", {}))
        self.elapsed_before = state.get("elapsed", 0.0)
        divergence = state.get("divergence", {})
        self.divergence.streak = int(divergence.get("streak", 0))
        self.divergence.healthy_iteration = int(divergence.get("healthy_iteration", self.iteration))
        self.stop_reason = state.get("stop_reason")
