"""What planning asks of each part: the parameter terms a recipe's classes declare from the config (no module
built) against transformers' models and against the model loading builds, tensor by tensor; the mixers' state
tensors in their own dtypes against the states a forward leaves; a 671B plan with nothing built."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from flagships import flagship
from test_mixer_mamba2 import BATCH, Root, copy_of, hf_config, mixer_config, random_reference, stream
from test_plan import hf_weights

from moelens import defaults
from moelens.families import family_for
from moelens.models.base import HookedTransformer
from moelens.models.mixers.gated_deltanet import FusedProjectionsGatedDeltaNet
from moelens.models.mixers.mamba2 import Mamba2Mixer
from moelens.models.qwen3_next import HookedQwen3Next
from moelens.models.terms import ParamTerm
from moelens.plan import count_model, plan
from moelens.plan.fit import needs_of
from moelens.plan.terms import count_terms, model_terms

# the embedded defaults' configs, one per family, by model_type
CONFIGS = {c["model_type"]: c for c in (json.loads((Path(defaults.__file__).parent / f).read_text()) for f in defaults.CONFIGS.values())}
# the same families with what changes a count: a dense layer among mixture ones, tied embeddings
VARIANTS = {
    "qwen3_next_dense_layer": {**CONFIGS["qwen3_next"], "mlp_only_layers": [1]},
    "qwen2_moe_tied": {**CONFIGS["qwen2_moe"], "tie_word_embeddings": True},
    # no experts: the shared MLP is each layer's dense MLP (granite-4.0-h-micro)
    "granitemoehybrid_dense": {**CONFIGS["granitemoehybrid"], "num_local_experts": 0},
    # one expert: no mixture at all, every feed-forward the dense MLP
    "jamba_dense": {**CONFIGS["jamba"], "num_experts": 1},
}


def cfg_of(raw: dict, dtype: torch.dtype):
    family = family_for(raw["model_type"], "test")
    return family, dataclasses.replace(family.config_from_hf(raw), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", [*CONFIGS, *VARIANTS])
def test_declared_terms_are_the_built_models_tensors(name, dtype):
    """Each parameter and buffer the recipe's parts declare is one the model loading builds has, with its shape
    and dtype (float32 routers and norms included), and none is left out."""
    family, cfg = cfg_of({**CONFIGS, **VARIANTS}[name], dtype)
    model = family.build(cfg)
    built = {n: (tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    terms = family.recipe(cfg).param_terms(cfg)
    declared = {t.name: (t.shape, t.dtype(dtype)) for t in terms}
    assert len(declared) == len(terms)  # no name twice
    assert declared == built
    assert {t.name for t in terms if t.buffer} == {n for n, _ in model.named_buffers()}
    # counting the built model (loading's device map) and counting the terms (plan) agree
    assert count_model(model) == count_terms(cfg, terms)


@pytest.mark.parametrize("name", [*CONFIGS, *VARIANTS])
def test_plan_counts_transformers_parameters(name):
    """The plan of each embedded default's config counts transformers' own model built from it."""
    raw = {**CONFIGS, **VARIANTS}[name]
    p = plan(dict(raw), dtype="float32", cpu_memory="1GB")
    hf = hf_weights(raw, torch.float32)
    # LongCat-Flash: transformers' fused gate_up_proj allocates [2 * d_expert, d_model] for each identity expert
    # too (zero_expert_num per layer), which no checkpoint stores and which computes nothing: not a parameter
    unstored = 0
    if raw.get("model_type") == "longcat_flash":
        unstored = raw["zero_expert_num"] * 2 * raw["expert_ffn_hidden_size"] * raw["hidden_size"] * raw["num_layers"]
        assert hf["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == raw["n_routed_experts"] + raw["zero_expert_num"]
    # MiniMax: transformers keeps each lightning layer's decay tables as buffers, which moelens derives from the config
    if raw.get("model_type") == "minimax":
        kinds = raw.get("layer_types") or ["full_attention", "linear_attention"] * raw["num_hidden_layers"]
        block = raw.get("block_size", 256)
        per_layer = raw["num_attention_heads"] * (1 + 2 * block + block * block)
        unstored = per_layer * kinds[: raw["num_hidden_layers"]].count("linear_attention")
    assert p.parameters == sum(t.numel() for t in hf.values()) - unstored


def test_the_linear_mixers_terms_are_transformers_modules():
    """Gated DeltaNet's and Mamba-2's declared parameters are transformers' modules' own, name by name."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    import tiny_qwen3_next

    hc = tiny_qwen3_next.qwen3_next_config()
    cfg = HookedQwen3Next.config_from_hf(hc.to_dict())
    with torch.device("meta"):
        theirs = Qwen3NextGatedDeltaNet(hc, layer_idx=0)
    assert {t.name: t.shape for t in FusedProjectionsGatedDeltaNet.param_terms(cfg, 0)} == {
        n: tuple(p.shape) for n, p in theirs.named_parameters()}
    reference = random_reference()
    assert {t.name: t.shape for t in Mamba2Mixer.param_terms(mixer_config(hf_config()), 0)} == {
        n: tuple(p.shape) for n, p in reference.named_parameters()}


def test_mamba2_state_tensors_are_the_states_a_forward_leaves_in_bfloat16():
    """The recurrent state stays float32 in a bfloat16 mixer; the convolution window is in bfloat16: the bytes
    state_tensors count are the state's own."""
    mixer = copy_of(random_reference()).to(torch.bfloat16)
    state = mixer.new_state()
    Root(mixer)(stream(20, torch.bfloat16, 3), None, state)
    tensors = {t.name: t for t in Mamba2Mixer.state_tensors(mixer_config(hf_config()))}
    assert state.recurrent.dtype == torch.float32 and state.conv.dtype == torch.bfloat16
    assert BATCH * tensors["recurrent"].nbytes(torch.bfloat16, 20) == state.recurrent.numel() * 4
    assert BATCH * tensors["conv"].nbytes(torch.bfloat16, 20) == state.conv.numel() * 2


def test_a_tensor_the_terms_leave_out_is_named():
    """A part that holds a tensor its param_terms do not declare: counting the built model names it."""
    family, cfg = cfg_of(CONFIGS["qwen3_moe"], torch.float32)
    model = family.build(cfg)
    model.blocks[1].mlp.register_buffer("extra", torch.zeros(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"do not name 'blocks\.1\.mlp\.extra'"):
        count_model(model)
    with pytest.raises(ValueError, match="component 'experts' is not one of"):
        ParamTerm("w", (1,), "experts")


def test_a_part_that_says_nothing_is_named():
    """A new mixer class without param_terms: planning names it instead of failing on an attribute."""
    class Silent(torch.nn.Module):
        block_attribute = "mixer"

    family, cfg = cfg_of(CONFIGS["qwen3_moe"], torch.float32)
    recipe = family.recipe(cfg)
    layers = (dataclasses.replace(recipe.layers[0], mixer=Silent), *recipe.layers[1:])
    with pytest.raises(TypeError, match="the token mixer Silent has no param_terms"):
        dataclasses.replace(recipe, layers=layers).param_terms(cfg)


def test_a_671b_plan_builds_nothing(monkeypatch):
    """DeepSeek-V3.2 at full size (671.9B) planned from its config alone, with building a model forbidden."""
    def refuse(*args, **kwargs):
        raise AssertionError("plan built a model")

    monkeypatch.setattr(HookedTransformer, "build", classmethod(refuse))
    model_terms.cache_clear()
    p = plan(flagship("deepseek_v32"), dtype="bfloat16", cpu_memory="2TB")
    assert p.parameters / 1e9 == pytest.approx(671.9, abs=0.1)


def test_each_layer_places_its_own_cache():
    """A hybrid's layers cache differently (keys per token, a fixed state per sequence): the placement weighs
    each block's own, summing to the plan's cache."""
    raw = CONFIGS["qwen3_next"]
    family, cfg = cfg_of(raw, torch.bfloat16)
    components, layers = count_terms(cfg, model_terms(family, cfg))
    needs = needs_of(cfg, family, components, layers, batch=2, seq=100)
    kinds = cfg.layer_types
    attention = [kv for kv, kind in zip(needs.kv_by_layer, kinds, strict=True) if kind == "full_attention"]
    linear = [kv for kv, kind in zip(needs.kv_by_layer, kinds, strict=True) if kind != "full_attention"]
    assert attention and linear
    longer = needs_of(cfg, family, components, layers, batch=2, seq=200)
    assert [b - a for a, b in zip(needs.kv_by_layer, longer.kv_by_layer, strict=True)] == [
        kv if kind == "full_attention" else 0 for kv, kind in zip(needs.kv_by_layer, kinds, strict=True)]
    assert needs.kv == plan(dict(raw), dtype="bfloat16", batch=2, seq=100, cpu_memory="1GB").kv_cache["bytes"]


def test_forward_flops_by_hand_and_the_published_activated_sizes():
    """Solar-Open-100B by hand: per layer q, k, v, o, the router, 8 of 128 experts and the shared expert, then
    the unembedding, 2 FLOPs per multiply-add. DeepSeek-V3.2 and Qwen3-Next against their published activated
    sizes (37B; "A3B"), which count the same matrices."""
    solar = plan(flagship("solar_open"), dtype="bfloat16", cpu_memory="1TB", batch=2, seq=100)
    layer = 4096 * (8192 + 1024 + 1024) + 8192 * 4096 + 128 * 4096 + 8 * 3 * 4096 * 1280 + 3 * 4096 * 1280
    assert solar.flops["per_token"] == 2 * (48 * layer + 196608 * 4096) == 22_498_246_656
    assert solar.flops["forward"] == 200 * solar.flops["per_token"]
    activated = plan(flagship("deepseek_v32"), dtype="bfloat16", cpu_memory="2TB").flops["per_token"] / 2
    assert activated / 1e9 == pytest.approx(37, abs=0.5)
    assert 3e9 < plan(flagship("qwen3_next"), dtype="bfloat16", cpu_memory="2TB").flops["per_token"] / 2 < 4e9


def test_tying_the_embedding_changes_the_parameters_not_the_flops():
    untied = plan(dict(CONFIGS["qwen2_moe"], tie_word_embeddings=False), cpu_memory="1GB")
    tied = plan(dict(VARIANTS["qwen2_moe_tied"]), cpu_memory="1GB")
    assert tied.parameters < untied.parameters and tied.flops == untied.flops
