"""`llm_pg.models.sampling`: the nucleus is transformers' top-p set, and draws follow the renormalised nucleus."""

import pytest
import torch
from transformers import TopPLogitsWarper

from llm_pg.models.sampling import NucleusSampler, nucleus, nucleus_sample


def transformers_kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[B, V]` True where transformers' TopPLogitsWarper keeps the token."""
    return TopPLogitsWarper(top_p)(None, logits.clone()) > float("-inf")


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0], ids=["flat", "natural", "peaked"])
def test_the_nucleus_is_transformers_top_p_set_to_float_rounding(top_p, scale):
    # Flat rows need far more than the first 64 candidates (the widening path), peaked ones fewer.
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(0)) * scale
    weights, index = nucleus(torch.softmax(logits, -1), top_p)
    ours = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, weights > 0)
    theirs = transformers_kept(logits, top_p)
    # Equal, but where a token's preceding mass (float64) is within float32 rounding of top_p: there the ascending
    # sum transformers takes and our descending one may round to either side.
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(-1, descending=True)
    before = probs.gather(1, order).cumsum(-1) - probs.gather(1, order)
    boundary = torch.zeros_like(ours).scatter_(1, order, (before - top_p).abs() < 1e-5)
    assert torch.equal(ours & ~boundary, theirs & ~boundary)
    assert int((ours != theirs).sum()) <= 2  # at most a boundary token here and there
    if scale == 0.1:
        assert index.shape[1] > 64  # widened


def test_a_row_whose_top_token_holds_top_p_keeps_it_alone():
    logits = torch.tensor([[10.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    weights, index = nucleus(torch.softmax(logits, -1), 0.9)
    assert int((weights[0] > 0).sum()) == 1 and int(index[0, 0]) == 0
    assert int((weights[1] > 0).sum()) == 4  # four equal tokens: 0.9 needs all of them


def test_draws_follow_the_renormalised_nucleus():
    # 40,000 draws from one row: each kept token's frequency within 4 standard errors of its renormalised
    # probability at T 0.8, and no token outside the nucleus drawn.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0, -5.0])
    probs = torch.softmax(logits / 0.8, -1)
    kept = transformers_kept((logits / 0.8)[None], 0.9)[0]
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    gen = torch.Generator().manual_seed(0)
    draws = nucleus_sample(logits.expand(40_000, -1), 0.8, 0.9, generator=gen)
    freq = torch.bincount(draws, minlength=len(logits)).double() / len(draws)
    assert bool((freq[~kept] == 0).all())
    stderr = (expected * (1 - expected) / len(draws)).sqrt().double()
    assert bool(((freq - expected.double()).abs() <= 4 * stderr + 1e-12).all()), (freq, expected)


def test_the_sampler_hands_generate_a_one_hot_score_row_and_respects_earlier_processors():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[:, 7] = float("-inf")  # as min_new_tokens' EOS block leaves it
    torch.manual_seed(0)
    scores = NucleusSampler(1.0, 0.95)(None, logits)
    token = scores.argmax(-1)
    assert bool((scores.isfinite().sum(-1) == 1).all()) and not bool((token == 7).any())
    torch.manual_seed(0)
    assert torch.equal(NucleusSampler(1.0, 0.95)(None, logits).argmax(-1), token)  # the same stream, the same tokens
