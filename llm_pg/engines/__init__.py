"""Rollout engines: prompts in, `Generation` out, behind one interface.

Every engine has

- `generate(conversations, *, num_samples, max_new_tokens, min_new_tokens, temperature, top_p, greedy, seed,
  max_prompt_tokens, chat_template) -> Generation`: `num_samples` completions per conversation, group-contiguous
  (row `i*G + j` answers prompt i), prompts left-padded with the tokenizer's pad id by `encode_prompts`,
  completions right-padded with the pad id after their first EOS, texts decoded without special tokens;
- `load_weights(model)`: make the engine sample from `model`'s current weights.

`HFEngine` (default) samples with the policy itself through HF `generate`; `VLLMEngine` (optional, `llm-pg[vllm]`)
runs vLLM colocated in the training process and also returns vLLM's log-prob of every sampled token. It is
imported from `llm_pg.engines.vllm` only when asked for, because importing vLLM is slow and it is not installed
by default.
"""

from llm_pg.engines.hf import HFEngine

__all__ = ["HFEngine"]
