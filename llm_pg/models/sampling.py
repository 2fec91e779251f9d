"""Nucleus (top-p) sampling without sorting the vocabulary: `NucleusSampler` draws each next token of `generate`.

transformers' top-p warper sorts every row's whole vocabulary at every decoded token, and its sampler then draws one
exponential per vocabulary entry (`torch.multinomial`). On a CPU, for a 49,152-word vocabulary and 48 rows, those
two cost about 0.23 s per token, more than the 135 M-parameter model's own forward (docs/algorithms.md, "Speed").
The nucleus of a trained model at T <= 1 is a handful of tokens, so `nucleus_sample` takes the `k` most probable
tokens (`topk`, no full sort), widens `k` only for rows whose top `k` hold less than `top_p` of the mass, and
draws among the nucleus alone.

The nucleus is transformers' (`TopPLogitsWarper`, `min_tokens_to_keep=1`): the most probable tokens up to and
including the one whose cumulative probability reaches `top_p`, i.e. token j (by descending probability) is kept
iff the mass of the tokens before it is below `top_p`. The draw is from the nucleus renormalised, as transformers'
is; only the random stream differs (k draws instead of one per vocabulary entry), so a seed gives other tokens
than transformers' own top-p sampling, and the same tokens at every run.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessor


def nucleus(probs: Tensor, top_p: float, candidates: int = 64) -> tuple[Tensor, Tensor]:
    """`(weights, index)` `[B, k]`: the probabilities of each row's `k` most probable tokens, zero outside the
    row's nucleus, and those tokens' ids. `k` starts at `candidates` and grows (x4) until every row's top `k` hold
    at least `top_p` of its mass, or `k` is the vocabulary."""
    vocab = probs.shape[-1]
    k = min(candidates, vocab)
    while True:
        values, index = probs.topk(k, dim=-1)  # [B, k], descending
        cumulative = values.cumsum(-1)
        if k == vocab or bool((cumulative[:, -1] >= top_p).all()):
            break
        k = min(4 * k, vocab)
    keep = cumulative - values < top_p  # the mass before each token; the first token is always kept
    keep[:, 0] = True
    return values * keep, index


def nucleus_sample(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> Tensor:
    """One token per row `[B]` from `softmax(logits / temperature)` restricted to its top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    weights, index = nucleus(probs, top_p)
    choice = torch.multinomial(weights, 1, generator=generator)  # [B, 1]: multinomial renormalises each row
    return index.gather(1, choice).squeeze(1)


class NucleusSampler(LogitsProcessor):
    """The last logits processor of a greedy `generate` call that samples: it draws the token (`nucleus_sample`, from
    torch's current random stream) and returns scores that are 0 there and -inf elsewhere, so the greedy argmax
    takes it. Processors before it (`min_new_tokens`' EOS block) act on the logits it samples from."""

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        token = nucleus_sample(scores, self.temperature, self.top_p)  # [B]
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, token[:, None], 0.0)
