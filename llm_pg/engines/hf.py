"""HFEngine: the engine interface over the policy's own HF model (`llm_pg.models.generation.generate`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm_pg.models.generation import Conversation, Generation, Sampling, context_length, continue_ids, generate
from llm_pg.models.parallel import unsharded


class HFEngine:
    """Samples with the policy module itself (eval mode, no grad, KV cache): no second copy of the weights.

    `load_weights` only records which module to sample with; weights updated in place by the optimizer are
    seen at once. `autocast` (the module's `autocast`) gives the compute dtype over float32 master weights.
    `share_prompt_prefix` prefills each prompt once for all its samples (`llm_pg.models.generation.prompt_cache`);
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
        self.model = model
        self.tokenizer = tokenizer
        self.autocast = autocast
        self.share_prompt_prefix = share_prompt_prefix
        self.compiled = compiled
        self.context = context_length(model)  # the model's own context, in tokens

    schedules_batches = False  # the rows of a call are one batch: an evaluation sends as many as memory allows

    def describe(self) -> str:
        """One line for the terminal: the engine and how it decodes."""
        how = "compiled decode steps" if self.compiled else "eager decode steps"
        return f"rollout engine: HF, the policy itself ({how}, prompt prefill shared: {self.share_prompt_prefix})"

    def load_weights(self, model: PreTrainedModel) -> None:
        self.model = model

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
        with self.autocast(), unsharded(self.model):
            return generate(
                self.model,
                self.tokenizer,
                conversations,
                sampling,
                num_samples=num_samples,
                seed=seed,
                share_prompt=self.share_prompt_prefix,
                compiled=self.compiled,
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
        with self.autocast(), unsharded(self.model):
            ids = continue_ids(
                self.model,
                self.tokenizer,
                contexts,
                replace(sampling, max_new_tokens=max(budgets)),
                seed=seed,
                compiled=self.compiled,
            )
        return [row[:budget] for row, budget in zip(ids, budgets, strict=True)], None
