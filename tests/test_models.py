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
