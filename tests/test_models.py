"""Model loading: hub ids that cannot be fetched fail at once, with the key and the fix."""

import huggingface_hub
import pytest
from huggingface_hub import constants

from llm_pg.models.loading import check_hub_model, load_policy, load_tokenizer


def test_uncached_hub_id_offline_fails_before_any_request(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("no request when offline"))
    with pytest.raises(RuntimeError, match=r"model.model_name_or_path: 'nobody/no-such-model' is not in the local"):
        load_tokenizer("nobody/no-such-model")


def test_unreachable_hub_fails_without_retries(monkeypatch):
    calls = []

    def no_network(repo_id, timeout=None):
        calls.append(timeout)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", no_network)
    with pytest.raises(RuntimeError, match=r"cannot reach https://huggingface.co to download 'nobody/no-such-model'"):
        load_policy("nobody/no-such-model", dtype=None)
    assert calls == [5]  # one request with a short timeout, no retry loop


def test_local_directory_needs_no_hub(monkeypatch, random_model_dir):
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("a local dir needs no request"))
    check_hub_model(random_model_dir)


@pytest.mark.parametrize("which", ["lora policy", "reference"])
def test_a_frozen_head_gets_a_contiguous_input_and_the_same_logits(random_model_dir, which):
    """transformers slices the kept positions (`hidden[:, -k:, :]`, rows a sequence apart); for a frozen head torch's
    matmul would copy the [V, H] weight once per row. The loaded models' head sees a contiguous input instead, and
    computes the logits the unhooked head computes."""
    import torch

    from llm_pg.models.loading import LoRA, load_reference

    if which == "reference":
        model = load_reference(random_model_dir, torch.float32)
    else:
        model = load_policy(random_model_dir, torch.float32, LoRA(r=4, target_modules=["q_proj"]))
    head = model.get_output_embeddings()
    assert not head.weight.requires_grad  # the case torch does not fold
    seen = []
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kept = model(input_ids=ids, logits_to_keep=2).logits  # [3, 2, V]
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # [3, 9, H], after the norm
    assert seen == [True, True]
    expected = hidden[:, -2:, :].contiguous() @ head.weight.T
    torch.testing.assert_close(kept, expected, rtol=1e-5, atol=1e-5)


def test_a_trained_head_gets_no_hook_and_its_sliced_product_equals_the_contiguous_one(random_model_dir):
    """Full fine-tuning's head requires grad: torch folds the sliced `[b, k, H]` input into one matrix product
    already, so the loader hooks only frozen heads; the unhooked head's logits equal the contiguous product bit for
    bit, under no grad (sampling) and with a graph (training)."""
    import torch

    model = load_policy(random_model_dir, torch.float32)
    head = model.get_output_embeddings()
    assert head.weight.requires_grad and not head._forward_pre_hooks
    hidden = torch.randn(3, 9, head.in_features, generator=torch.Generator().manual_seed(1))
    view = hidden[:, -2:, :]
    assert not view.is_contiguous()
    with torch.no_grad():
        assert torch.equal(head(view), head(view.contiguous()))
    assert torch.equal(head(view).detach(), head(view.contiguous()).detach())
