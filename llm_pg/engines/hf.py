"""HFEngine: the engine interface over the policy's own HF model (`llm_pg.models.generation.generate`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm_pg.models.generation import Conversation, Generation, Sampling, continue_ids, generate, model_tokens
from llm_pg.models.parallel import is_sharded, unsharded


class HFEngine:
    """Samples with the policy module itself (eval mode, no grad, KV cache): no second copy of the weights.

    `load_weights` only records which module to sample with; weights updated in place by the optimizer are
    seen at once. `autocast` (the module's `autocast`) gives the compute dtype over float32 master weights.
    `share_prompt_prefix` prefills each prompt once for all its samples (`llm_pg.models.generation.prompt_cache`),
    and an episode's turns after the ids all their contexts share (`prefix_cache`);
    `compiled` runs the decode steps through `torch.compile` (`llm_pg.models.decoding.compiled_forward`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        share_prompt_prefix: bool = True,
        compiled: bool = False,
    ) -> None:
        self.model: PreTrainedModel | None = None
        self.tokenizer = tokenizer
        self.autocast = autocast
        self.share_prompt_prefix = share_prompt_prefix
        self.compiled = compiled
        self.load_weights(model)

    schedules_batches = False  # the rows of a call are one batch: an evaluation sends as many as memory allows

    def describe(self) -> str:
        """One line for the terminal: the engine and how it decodes."""
        how = "compiled decode steps" if self.compiled else "eager decode steps"
        return f"rollout engine: HF, the policy itself ({how}, prompt prefill shared: {self.share_prompt_prefix})"

    def load_weights(self, model: PreTrainedModel) -> None:
        """Sample with `model` (the policy, whose weights the optimizer updates in place: nothing to copy)."""
        if model is not self.model:
            self.tokens = model_tokens(model, self.tokenizer)  # EOS, pad, unused rows and context, once per model
            self.context = self.tokens.context
            self.sharded = is_sharded(model)
        self.model = model

    def _gathered(self) -> AbstractContextManager:
        """A model sharded by FSDP2 gathered once for a whole call (`unsharded`), not once per decoded token, so its
        ranks may stop decoding at different steps; nothing to do for a whole model."""
        return unsharded(self.model) if self.sharded else nullcontext()

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: Sampling,
        *,
        num_samples: int = 1,
        seed: int | None = None,
    ) -> Generation:
        """`llm_pg.models.generation.generate` with this engine's model and tokenizer (same arguments), under
        `autocast`.

        A model sharded with FSDP2 is gathered once for the whole call (`unsharded`), not once per decoded token,
        so its ranks may stop decoding at different steps."""
        with self.autocast(), self._gathered():
            return generate(
                self.model,
                self.tokenizer,
                conversations,
                sampling,
                num_samples=num_samples,
                seed=seed,
                share_prompt=self.share_prompt_prefix,
                compiled=self.compiled,
                tokens=self.tokens,
            )

    def continue_ids(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        budgets: Sequence[int],
        rows: Sequence[int],
        seed: int | None = None,
    ) -> tuple[list[list[int]], None]:
        """One continuation per token-id context (`llm_pg.engines.episodes`), all rows in one batch seeded with
        `seed` (`rows` is unused: HF draws a batch from one stream): at most `budgets[i]` new ids, up to and
        including the first EOS (the batch samples to the largest budget; a row is cut to its own). No engine
        log-probs (the policy is the sampler)."""
        with self.autocast(), self._gathered():
            ids = continue_ids(
                self.model,
                self.tokenizer,
                contexts,
                replace(sampling, max_new_tokens=max(budgets)),
                seed=seed,
                compiled=self.compiled,
                tokens=self.tokens,
                share_prefix=self.share_prompt_prefix,
            )
        return [row[:budget] for row, budget in zip(ids, budgets, strict=True)], None
