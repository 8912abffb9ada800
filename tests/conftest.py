import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

torch.set_num_threads(2)

QWEN_VARIANTS = {
    "gqa": dict(),
    "norm_topk": dict(norm_topk_prob=True),
    "plain_attn": dict(num_key_value_heads=4),
    "dense_block": dict(mlp_only_layers=[1]),
    "tied": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def qwen_checkpoints(tmp_path_factory):
    """variant -> folder, built once per session."""
    root = tmp_path_factory.mktemp("qwen2_moe")
    out = {name: tiny.build_qwen2_moe(root / name, seed=i, **kw) for i, (name, kw) in enumerate(QWEN_VARIANTS.items())}
    out["sharded"] = tiny.build_qwen2_moe(root / "sharded", seed=7, max_shard_size="100KB")
    fused = tiny.build_qwen2_moe(root / "fused", seed=8)
    tiny.fuse_experts(fused)
    out["fused"] = fused
    return out


@pytest.fixture(scope="session")
def qwen_path(qwen_checkpoints):
    return qwen_checkpoints["gqa"]


@pytest.fixture(scope="session")
def qwen_model(qwen_path):
    from moelens import HookedTransformer

    return HookedTransformer.from_pretrained(qwen_path, progress=False)


@pytest.fixture
def tokens():
    return torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
