import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

torch.set_num_threads(2)
if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (family, variant) -> how to build it. Every family has a "base" variant, used by the generic tests.
VARIANTS = {
    ("qwen2_moe", "base"): lambda d: tiny.build_qwen2_moe(d, seed=0),
    ("qwen2_moe", "norm_topk"): lambda d: tiny.build_qwen2_moe(d, seed=1, norm_topk_prob=True),
    ("qwen2_moe", "plain_attn"): lambda d: tiny.build_qwen2_moe(d, seed=2, num_key_value_heads=4),
    ("qwen2_moe", "dense_block"): lambda d: tiny.build_qwen2_moe(d, seed=3, mlp_only_layers=[1]),
    ("qwen2_moe", "tied"): lambda d: tiny.build_qwen2_moe(d, seed=4, tie_word_embeddings=True),
    ("qwen2_moe", "sharded"): lambda d: tiny.build_qwen2_moe(d, seed=7, max_shard_size="100KB"),
    ("qwen2_moe", "fused"): lambda d: tiny.fused(tiny.build_qwen2_moe(d, seed=8)),
    ("hunyuan_v1_moe", "base"): lambda d: tiny.build_hunyuan(d, seed=0),
    ("hunyuan_v1_moe", "untied_biased"): lambda d: tiny.build_hunyuan(d, seed=1, tie_word_embeddings=False, attention_bias=True),
    ("hunyuan_v1_moe", "sharded"): lambda d: tiny.build_hunyuan(d, seed=2, max_shard_size="100KB"),
    ("hunyuan_v1_moe", "fused"): lambda d: tiny.fused(tiny.build_hunyuan(d, seed=3)),
    ("solar_open", "base"): lambda d: tiny.build_solar(d, seed=0),
    ("solar_open", "renormalised"): lambda d: tiny.build_solar(d, seed=1, norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    ("solar_open", "sharded"): lambda d: tiny.build_solar(d, seed=2, max_shard_size="100KB"),
    ("solar_open", "fused"): lambda d: tiny.fused(tiny.build_solar(d, seed=3)),
}
# A family's own test module tests/tiny_<family>.py adds its variants here (a dict VARIANTS like this one).
for _path in sorted(Path(__file__).parent.glob("tiny_*.py")):
    VARIANTS.update(importlib.import_module(_path.stem).VARIANTS)
FAMILIES = ["qwen2_moe", "hunyuan_v1_moe", "solar_open", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe", "minimax_m2", "deepseek_v32", "glm_moe_dsa", "llama4_text", "qwen3_next", "qwen3_5_moe", "glm4_moe_lite", "deepseek_v2", "nemotron_h", "ernie4_5_moe", "flex_olmo"]
# The Triton kernels see a family only through its routing weights' dtype: model dtype (Qwen2-MoE; also
# Qwen3-MoE, OLMoE) or float32 (Hunyuan, softmax; Solar, sigmoid; also Mixtral, DeepSeek-V3). Every family
# runs the Triton backend end to end against the torch one (every hook tensor); the interpreter-heavy
# intervention tests on that backend run on these three, which span what the kernels receive.
KERNEL_FAMILIES = ["qwen2_moe", "hunyuan_v1_moe", "solar_open"]
BACKEND_CASES = [(f, b) for f in FAMILIES for b in ("torch", "triton") if b == "torch" or f in KERNEL_FAMILIES]


def pytest_collection_modifyitems(config, items):
    """Without a GPU, every test that runs the Triton kernels (its id says triton: the kernel tests, the triton
    backend cases) runs them in Triton's CPU interpreter, 10 to 90 s each on a 2-core machine: marked slow, so
    that `pytest -m "not slow"` leaves them out while developing (CI runs everything)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "triton" in item.nodeid.lower():
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(family, variant) -> folder, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {key: build(root / f"{key[0]}-{key[1]}") for key, build in VARIANTS.items()}


@pytest.fixture(scope="session")
def qwen_checkpoints(checkpoints):
    return {("gqa" if v == "base" else v): p for (f, v), p in checkpoints.items() if f == "qwen2_moe"}


@pytest.fixture(scope="session")
def qwen_path(checkpoints):
    return checkpoints["qwen2_moe", "base"]


@pytest.fixture(scope="session")
def qwen_model(qwen_path):
    from moelens import HookedTransformer

    return HookedTransformer.from_pretrained(qwen_path, progress=False)


@pytest.fixture(scope="session")
def family_models(checkpoints):
    from moelens import HookedTransformer

    return {f: HookedTransformer.from_pretrained(checkpoints[f, "base"], progress=False) for f in FAMILIES}


@pytest.fixture
def tokens():
    return torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def copy_checkpoint(tmp_path, checkpoints):
    def copy(family: str, variant: str = "base") -> Path:
        dst = tmp_path / f"{family}-{variant}"
        shutil.copytree(checkpoints[family, variant], dst)
        return dst

    return copy


def shared_parts(model, layer: int | None = None) -> list:
    """Capability read from the model: the shared-expert parts (block.mlp.parts()) of that layer, or of all."""
    layers = [layer] if layer is not None else range(model.cfg.n_layers)
    return [p for l in layers if model.blocks[l].has_ffn for p in model.blocks[l].mlp.parts() if p.kind == "shared"]


def has_shared_expert(model, layer: int | None = None) -> bool:
    """Whether (that layer's) mixture block has a shared expert."""
    return bool(shared_parts(model, layer))


def shared_expert_gated(model, layer: int | None = None) -> bool:
    """Whether (that layer's) shared expert is scaled by a gate (Qwen2-MoE's sigmoid)."""
    return any(p.gate is not None for p in shared_parts(model, layer))


def norm_factor(norm) -> torch.Tensor:
    """What a norm multiplies the normalised stream by, written out per kind as transformers computes it: (1 + w)
    for the zero-centred norms (Qwen3-Next's RMSNorm), w for the others."""
    w = norm.weight.detach()
    return 1 + w if type(norm).__name__ == "ZeroCenteredRMSNorm" else w


def mixer_labels(model, layer: int) -> list[str]:
    """The full decomposition's token-mixer components of a block: its heads (softmax attention), its whole
    output "{l}_attn_out" (a mixer without heads: linear attention, a state-space layer), or none."""
    block = model.blocks[layer]
    if block.has_attention:
        return [f"L{layer}H{h}" for h in range(model.cfg.n_heads)]
    return [f"{layer}_attn_out"] if block.token_mixer is not None else []


def attention_layers(model) -> list[int]:
    return [l for l, block in enumerate(model.blocks) if block.has_attention]


def sublayer_input(model, cache, layer: int, kind: str) -> torch.Tensor:
    """What block `layer`'s `kind` sublayer ("mixer" / "ffn") reads: its norm's output, or, where it reads the
    stream unnormed (a post-norm block), the stream itself (resid_mid for a feed-forward after a token mixer)."""
    block = model.blocks[layer]
    sub = next(s for s in block.sublayers() if s.kind == kind)
    if sub.norm is not None:
        return cache[sub.norm.hook_normalized.name]
    after_mixer = kind == "ffn" and block.token_mixer is not None
    return cache[f"blocks.{layer}.hook_resid_{'mid' if after_mixer else 'pre'}"]


def as_added(model, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
    """A sublayer output x as block `layer` adds it to the stream: through its post-norm where the block has one
    (the model's own norm module, whose arithmetic the equivalence suites check against transformers)."""
    norm = model.blocks[layer].post_norm(kind)
    return x if norm is None else norm(x)


def post_norm_factor(model, cache, layer: int, kind: str):
    """What block `layer` multiplies each part of its `kind` sublayer's output by before the add, written out:
    its post-norm's weight over the scale that norm computed on the whole output (cached), [batch pos d_model];
    1.0 where the block adds the output as it is."""
    norm = model.blocks[layer].post_norm(kind)
    return 1.0 if norm is None else norm_factor(norm) / cache[norm.hook_scale.name]
