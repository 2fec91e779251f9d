"""A tiny chat model of llm_pg's own: byte-level tokenizer, pretraining on noisy task demonstrations, metrics.

The committed checkpoint (`llm_pg.assets.TINY_CHAT_DIR`) is a weak but non-trivial base policy for the tiny tasks, so
the whole RL pipeline runs and visibly learns on a CPU with nothing to download. This package is a tool (the
`pretrain-tiny` and `eval-tiny` commands), in the top layer beside `llm_pg.cli`.
"""
