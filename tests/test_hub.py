"""Hub ids resolve through huggingface_hub, and work offline from its local cache (no network in tests)."""

import shutil

import huggingface_hub.constants as hub_constants
import pytest
import torch

from moelens import HookedTransformer
from moelens.loaders.hub import resolve_checkpoint


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, qwen_path):
    """A Hub cache holding 'tiny-org/qwen2-moe' at one revision, as snapshot_download leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--qwen2-moe"
    shutil.copytree(qwen_path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_hub_id_loads_offline_from_the_cache(offline_cache, qwen_model, tokens):
    assert resolve_checkpoint("tiny-org/qwen2-moe") == offline_cache
    model = HookedTransformer.from_pretrained("tiny-org/qwen2-moe", progress=False)
    assert torch.equal(model(tokens), qwen_model(tokens))
    # TransformerLens's cfg.original_architecture, from the config.json the load read (a Hub id included)
    assert model.cfg.original_architecture == "Qwen2MoeForCausalLM" and model.cfg.model_name == "qwen2-moe"


def test_unknown_hub_id_offline_is_a_clear_error(offline_cache):
    with pytest.raises(FileNotFoundError, match="tiny-org/absent"):
        resolve_checkpoint("tiny-org/absent")
