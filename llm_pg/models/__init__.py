"""Models and decoding: loading the policy, the frozen reference and the tokenizer (`loading`, with LoRA and the
real model's offline cache, `real_model`), the KV cache and activation checkpointing across transformers versions
(`cache`), sampling with HF `generate` (`generation`, `decoding`, `sampling`) and FSDP2 wrapping (`parallel`).
Imports `llm_pg.core` and `llm_pg.assets` only.
"""
