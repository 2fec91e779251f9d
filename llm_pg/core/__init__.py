"""The RL math and the rollout container: pure functions of tensors (torch only; no Lightning, no transformers).

`losses` (advantages, the REINFORCE and clipped GRPO objectives, the KL estimate, aggregations), `rollout` (the
`Rollout` a rollout batch travels in, seeds), `chunked_logprobs` (log-probs through the LM head in chunks). Every other
layer may import this one; it imports none of them.
"""
