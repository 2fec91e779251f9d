"""Sequence log-probs of a left-padded rollout equal those of each row scored alone, unpadded."""

import dataclasses

import pytest
import torch
from conftest import DigitTask, stand_in_trainer

from llm_pg.callbacks.rollout import RolloutCallback
from llm_pg.data.batches import PromptBatch
from llm_pg.data.tasks.base import Example
from llm_pg.modules import GRPOModule

# Prompts of different lengths, so the batch is left-padded by different amounts per row.
PROMPTS = ["Say 1", "Say digits, as many as you can: 0123456789", "Digits?"]


def alone_logprobs(model, rollout, row: int, temperature: float) -> torch.Tensor:
    """Log-probs of row `row`'s completion tokens (up to its EOS) from one forward of the row alone:
    its real prompt tokens without padding, then its completion; no attention mask, no position ids."""
    prompt = rollout.input_ids[row, : rollout.prompt_len][rollout.attention_mask[row, : rollout.prompt_len] == 1]
    completion = rollout.completion_ids[row][rollout.completion_mask[row]]
    sequence = torch.cat([prompt, completion])
    with torch.no_grad():
        logits = model(input_ids=sequence[None]).logits[0].float()  # [L, V]
    scored = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)  # positions scoring completion
    return scored.gather(-1, completion[:, None]).squeeze(-1)  # [|completion|]


def sample_rollout(module, examples) -> PromptBatch:
    """One rollout through the real RolloutCallback, with a stand-in trainer."""
    batch = PromptBatch(0, examples)
    RolloutCallback().on_train_batch_start(stand_in_trainer(DigitTask(eval_size=2), examples), module, batch, 0)
    return batch


def end_some_rows_early(module, rollout):
    """The random model rarely samples EOS: end rows 0, 2, 4 with one at columns 2, 4, 6 (pad after it), as
    generate() leaves finished rows, and recompute the frozen log-probs of the edited rows."""
    eos = module.tokenizer.eos_token_id
    for row, column in [(0, 2), (2, 4), (4, 6)]:
        rollout.input_ids[row, rollout.prompt_len + column] = eos
        rollout.input_ids[row, rollout.prompt_len + column + 1 :] = module.tokenizer.pad_token_id
        rollout.completion_mask[row, column + 1 :] = False
        rollout.attention_mask[row, rollout.prompt_len + column + 1 :] = 0
    return dataclasses.replace(
        rollout, old_logp=module.old_logprobs(rollout), ref_logp=module.reference_logprobs(rollout)
    )


@pytest.mark.parametrize(("logprob_temperature", "expected_t"), [(1.0, 1.0), (None, 0.7)])
def test_padded_batch_logprobs_equal_each_row_alone(random_model_dir, logprob_temperature, expected_t):
    module = GRPOModule(
        model_name_or_path=random_model_dir,
        dtype="float32",
        group_size=2,
        prompts_per_step=3,
        minibatch_size=2,
        temperature=0.7,
        logprob_temperature=logprob_temperature,
        max_new_tokens=10,
        kl_coef=0.1,
    )
    module.configure_model()
    rollout = end_some_rows_early(
        module, sample_rollout(module, [Example(prompt=p, answer="") for p in PROMPTS]).rollout.rows
    )
    pads = (rollout.attention_mask[:, : rollout.prompt_len] == 0).sum(1)
    assert len(set(pads.tolist())) == 3  # three padding widths: the test means something
    lengths = rollout.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # completions end at different places (EOS, then right padding)
    module.policy.train()  # dropout is 0: train mode must score as eval mode does
    logp, _ = module.completion_logprobs(module.policy, rollout)
    for row in range(len(rollout)):
        expected = alone_logprobs(module.policy, rollout, row, expected_t)
        mask = rollout.completion_mask[row]
        torch.testing.assert_close(logp[row][mask], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout.old_logp[row][mask], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout.ref_logp[row][mask], expected, atol=1e-5, rtol=0)  # reference = start


@pytest.mark.parametrize("sharded", [False, True])
def test_a_sharded_policy_gets_one_head_call_and_no_prefix_sharing(random_model_dir, monkeypatch, sharded):
    """Under FSDP2 the root forward gathers the embedding and head weights: the module settles once, in `LogProbs`'
    settings, that a sharded policy runs its head in one call and shares no prompt prefix (the log-prob calls no
    longer ask the model)."""
    import llm_pg.modules.components as components

    monkeypatch.setattr(components, "is_sharded", lambda model: sharded)
    module = GRPOModule(
        model_name_or_path=random_model_dir, dtype="float32", group_size=2, prompts_per_step=2, minibatch_size=2
    )
    module.speed = dataclasses.replace(module.speed, logprob_chunk_size=64, share_prompt_prefix=True)
    module.configure_model()
    logprobs = module.logprobs
    assert (logprobs.chunk_size, logprobs.share_prefix) == ((0, False) if sharded else (64, True))
