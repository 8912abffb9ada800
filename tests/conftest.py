import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# two threads; one per worker when the suite runs in pytest-xdist's workers (-n auto: one per core), so that the
# workers never ask for more threads than there are cores
torch.set_num_threads(1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2)
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
# The generic suites' families: every family with a base variant, found from the tiny_<family>.py files (no list
# to edit); tests/test_registry.py holds it equal to the registered families
FAMILIES = [family for family, variant in VARIANTS if variant == "base"]
# The Triton kernels see a family only through its routing weights' dtype: model dtype (Qwen2-MoE; also
# Qwen3-MoE, OLMoE) or float32 (Hunyuan, softmax; Solar, sigmoid; also Mixtral, DeepSeek-V3). Every family
# runs the Triton backend end to end against the torch one (every hook tensor); the interpreter-heavy
# intervention tests on that backend run on these three, which span what the kernels receive.
KERNEL_FAMILIES = ["qwen2_moe", "hunyuan_v1_moe", "solar_open"]
BACKEND_CASES = [(f, b) for f in FAMILIES for b in ("torch", "triton") if b == "torch" or f in KERNEL_FAMILIES]
# Families whose norms are LayerNorms (Phi-3.5-MoE's with a bias, DBRX's without): they centre their input, so the
# cache analyses that apply a norm to a stack of components refuse them (NormNotDecomposable); the tests of those
# analyses expect the refusal there, strictly. fold_ln refuses only the biased ones (BIASED_NORM_FAMILIES).
LAYER_NORM_FAMILIES = {"phimoe", "dbrx", "cohere2_moe"}
BIASED_NORM_FAMILIES = {"phimoe"}


# Families whose blocks carry another stream than resid_pre plus the sublayers' outputs (Beam's depth-scaled adds
# rescale it; MiniMax's blocks keep each sublayer's normed input, scaled, plus its output; block.stream_is_sum False):
# the decompositions into sublayer outputs refuse them (StreamNotDecomposable, a ValueError naming the block); their
# tests expect the refusal, strictly. Beam's logits are also softcapped: center_unembed refuses it, the logits are
# not a linear map of W_U.
STREAM_NOT_SUM_FAMILIES = {"beam", "minimax"}
# Families whose transformers cache (5.24) miscounts the cached tokens when layer 0 holds no keys (MiniMax's
# MiniMaxCache with a lightning layer 0): a left-padded decode or a multi-token forward after a cached prefix is
# wrong or fails there; their own suites check moelens against each row alone and against given positions.
CACHE_MISCOUNTING_FAMILIES = {"minimax"}
SOFTCAPPED_LOGITS_FAMILIES = {"beam"}


def refused_for(cases, families: set[str], reason: str):
    """Parameters (a family, or a pytest.param of one) with those of `families` marked to raise ValueError
    (strict: passing fails), keeping any marks they have."""
    refused = pytest.mark.xfail(raises=ValueError, strict=True, reason=reason)
    out = []
    for case in cases:
        values, marks = (case.values, case.marks) if hasattr(case, "values") else ((case,), ())
        family = values[0] if isinstance(values[0], str) else values[0][0]
        out.append(pytest.param(*values, marks=(*marks, refused)) if family in families else case)
    return out


def decomposition_refused(cases):
    """The cases with a family whose stream is no sum of sublayer outputs marked to raise (see above)."""
    return refused_for(cases, STREAM_NOT_SUM_FAMILIES, "the stream is not the sum of the sublayer outputs")


def uncapped(model, logits: torch.Tensor) -> torch.Tensor:
    """The unembedding's output before a family's logit softcap (Beam's cap * tanh(x / cap)), by inverting the cap:
    what the direct logit attributions sum to; the logits themselves elsewhere."""
    cap = model.unembed.softcap
    return logits if cap is None else cap * torch.atanh(logits.double() / cap).to(logits.dtype)


def routed_scale(model, layer: int) -> float:
    """The routed part's scale: what the mixture multiplies its slots' summed outputs by (Beam's
    routed_scaling_factor, applied after the sum; 1 elsewhere)."""
    return next(p for p in model.blocks[layer].mlp.parts() if p.kind == "routed").scale


def families_applying_norms():
    """FAMILIES as parameters, a LayerNorm family's marked to raise NormNotDecomposable (strict: passing fails)."""
    from moelens.cache_analysis import NormNotDecomposable

    refused = pytest.mark.xfail(raises=NormNotDecomposable, strict=True, reason="a LayerNorm (centring) is refused")
    return [pytest.param(f, marks=refused) if f in LAYER_NORM_FAMILIES else f for f in FAMILIES]


# Families whose checkpoints store the routed experts flat, all experts in one tensor (DBRX's w1 / v1 / w2): they are
# not read one expert at a time, so expert_offload, expert_parallel and expert_storage refuse them (CheckpointError)
FLAT_EXPERT_FAMILIES = {"dbrx"}


def families_reading_experts_one_at_a_time():
    """FAMILIES as parameters, a flat-expert family's marked to raise CheckpointError (strict: passing fails)."""
    from moelens.loaders.errors import CheckpointError

    refused = pytest.mark.xfail(raises=CheckpointError, strict=True, reason="experts stored flat are read whole")
    return [pytest.param(f, marks=refused) if f in FLAT_EXPERT_FAMILIES else f for f in FAMILIES]


def lineage(family: str) -> list[str]:
    """The family and the registered families it derives from, nearest first (Sarvam's MLA family is
    DeepSeek-V3's blocks: a fact the suites know of deepseek_v3 holds for sarvam_mla unless it says otherwise)."""
    from moelens.families import FAMILIES as REGISTERED

    names = {cls: cls.__module__.rsplit(".", 1)[1] for cls in REGISTERED.values()}
    return [names[cls] for cls in REGISTERED[family].__mro__ if cls in names]


def family_fact(table: dict, family: str):
    """A per-family table's entry for the family, or for the nearest family it derives from; a KeyError naming the
    table's missing entry where neither has one."""
    for name in lineage(family):
        if name in table:
            return table[name]
    raise KeyError(f"no entry for {family} (nor for the families it derives from, {lineage(family)[1:]})")


def fold_ln_refused(cases):
    """Parameters (a family, or a (family, variant) key) with a biased LayerNorm family's marked to raise: fold_ln
    refuses its biased norms (a ValueError naming the norm; strict: passing fails)."""
    refused = pytest.mark.xfail(raises=ValueError, strict=True, reason="fold_ln refuses a LayerNorm with bias")
    family = lambda case: case if isinstance(case, str) else case[0]  # noqa: E731
    return [pytest.param(c, marks=refused) if family(c) in BIASED_NORM_FAMILIES else c for c in cases]


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


def mixer_labels(model, layer: int, before_ffn: bool = False) -> list[str]:
    """The full decomposition's token-mixer components of a block: each softmax attention's heads ("L{l}H{h}"; a
    block's further attention "L{l}.{name}.H{h}", LongCat-Flash's "L{l}.attn_1.H{h}"), a headless mixer's whole
    output "{l}_attn_out" (linear attention, a state-space layer), or none. before_ffn: only the mixers before the
    block's first feed-forward (what its ln2 reads; none where it reads resid_pre, as a parallel block's does)."""
    labels = []
    if before_ffn and not model.blocks[layer].has_resid_mid:
        return labels
    for sub in model.blocks[layer].sublayers():
        if sub.kind == "ffn":
            if before_ffn:
                break
            continue
        if sub.is_attention:
            prefix = f"L{layer}" if sub.name == "attn" else f"L{layer}.{sub.name}."
            labels += [f"{prefix}H{h}" for h in range(model.cfg.n_heads)]
        else:
            labels.append(f"{layer}_{sub.name}_out")
    return labels


def attention_layers(model) -> list[int]:
    return [l for l, block in enumerate(model.blocks) if block.has_attention]


def attentions(model) -> list[tuple[int, str]]:
    """(block, name) of every softmax-attention sublayer, in order: blocks.{l}.{name} is the module ("attn";
    LongCat-Flash's blocks have "attn_1" too)."""
    return [(l, sub.name) for l, block in enumerate(model.blocks) for sub in block.attention_sublayers()]


def ffn_stream(block) -> str:
    """The cache name of the stream a block's ln2 reads: resid_mid, or resid_pre in a block of a feed-forward alone."""
    return "resid_mid" if block.has_resid_mid else "resid_pre"


def routable_experts(model) -> int:
    """How many experts a slot may name: the real ones and the identity (zero-computation) ones after them."""
    return model.cfg.n_experts + model.cfg.expert_spec().n_identity
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
    (the model's own norm module, whose arithmetic the equivalence suites check against transformers), times the
    block's output multiplier (Granite's residual multiplier, Beam's depth scale; 1 elsewhere)."""
    norm, m = model.blocks[layer].post_norm(kind), model.blocks[layer].output_multiplier(kind)
    x = x if norm is None else norm(x)
    return x if m == 1.0 else x * m


def stream_factor(model, cache, layer: int, kind: str):
    """What block `layer` multiplies each part of its `kind` sublayer's output by before the add, written out:
    its residual multiplier (Granite's; 1 elsewhere) times, where the block has a post-norm, the norm's weight over
    the scale it computed on the whole output (cached, [batch pos d_model]); 1.0 where the output is added as is."""
    norm, m = model.blocks[layer].post_norm(kind), model.blocks[layer].output_multiplier(kind)
    return m if norm is None else m * norm_factor(norm) / cache[norm.hook_scale.name]
