"""Granite MoE (HookedGraniteMoe): what is special about the family. The generic suites (conftest FAMILIES)
compare every site with transformers in float32 and bfloat16, generation, hooks and analyses; here: each muP
multiplier read from config.json as transformers reads it and applied where transformers applies it (checked by
hand from the hooked tensors), the router's rule, the checkpoint spellings, config errors, the plan's count at
full size and the embedded default."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import tiny_granitemoe
from flagships import flagship
from family_harness import References, build_checkpoints, check_report, rewrite_tensors, stored_keys, tokens

from moelens import HookedTransformer
from moelens.loaders.errors import CheckpointError
from moelens.models.granitemoe import HookedGraniteMoe
from moelens.verify import compare

MULTIPLIERS = tiny_granitemoe.MULTIPLIERS


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    wanted = {k: v for k, v in tiny_granitemoe.VARIANTS.items() if k[1] in ("base", "fused")}
    return build_checkpoints(tmp_path_factory, "granitemoe", wanted)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


@pytest.fixture(scope="module")
def run(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens(shape=(2, 12)))
    return model, logits, cache


def every_site(layer):
    return ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post", "attn.hook_z",
            "mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


# ---- the multipliers --------------------------------------------------------------------------------------------

def test_variants_are_what_they_claim(ckpts):
    cfg = HookedTransformer.from_pretrained(ckpts["base"], progress=False).cfg
    assert {name: getattr(cfg, name) for name in MULTIPLIERS} == MULTIPLIERS
    assert cfg.attention_multiplier != cfg.d_head**-0.5
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in stored_keys(ckpts["base"])  # the Hub's spelling
    fused = stored_keys(ckpts["fused"])  # transformers 5's names
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in fused
    assert "model.layers.0.block_sparse_moe.router.weight" in fused


@pytest.mark.parametrize("field", list(MULTIPLIERS))
def test_each_multiplier_is_read_as_transformers_reads_it(ckpts, tmp_path, field):
    """config.json with one multiplier changed: moelens follows transformers site for site, and the logits move,
    so the field is read and used (absent fields: test_family_config_fields' defaults)."""
    with torch.no_grad():
        before = HookedTransformer.from_pretrained(ckpts["base"], progress=False)(tokens(shape=(1, 8)))
    value = MULTIPLIERS[field] * 1.7
    folder = shutil.copytree(ckpts["base"], tmp_path / field)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, field: value}))
    model = HookedTransformer.from_pretrained(folder, progress=False)
    assert getattr(model.cfg, field) == value
    check_report(compare(model, References({"x": folder})("x"), tokens()), model, every_site)
    with torch.no_grad():
        assert (model(tokens(shape=(1, 8))) - before).abs().max() > 1e-3


def test_stream_sites_add_up_exactly(run):
    """hook_embed is what enters the stream; each sublayer's output hook is what the stream receives, so the sums
    hold bit for bit on every block; the sites inside the sublayers hold the modules' own outputs."""
    model, _, cache = run
    m = MULTIPLIERS["residual_multiplier"]
    assert torch.equal(cache["hook_embed"], cache["blocks.0.hook_resid_pre"])
    assert torch.equal(cache["hook_embed"], F.embedding(tokens(shape=(2, 12)), model.embed.weight) * 6.0)
    for l, block in enumerate(model.blocks):
        assert torch.equal(cache["resid_pre", l] + cache["attn_out", l], cache["resid_mid", l])
        assert torch.equal(cache["resid_mid", l] + cache["mlp_out", l], cache["resid_post", l])
        z = cache[f"blocks.{l}.attn.hook_z"].flatten(-2)
        assert torch.equal(cache["attn_out", l], block.attn.o_proj(z) * m)
        assert torch.equal(cache["mlp_out", l], cache["routed_out", l] * m)


def test_attention_scores_use_the_attention_multiplier(run):
    model, _, cache = run
    q, k = cache["blocks.1.attn.hook_rot_q"], cache["blocks.1.attn.hook_rot_k"]  # [b p h d], [b p kv d]
    k = k.repeat_interleave(model.cfg.n_heads // model.cfg.n_kv_heads, dim=2)
    by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) * MULTIPLIERS["attention_multiplier"]
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    scores = cache["blocks.1.attn.hook_attn_scores"]
    assert torch.allclose(scores[..., causal], by_hand[..., causal], atol=1e-6)


def test_logits_are_divided_by_logits_scaling(run):
    model, logits, cache = run
    by_hand = cache["ln_final.hook_normalized"] @ model.unembed.weight.T / MULTIPLIERS["logits_scaling"]
    assert torch.allclose(logits, by_hand, atol=1e-6)
    # the weight views are the maps the model applies: the normed stream times W_U is the logits
    assert torch.allclose(cache["ln_final.hook_normalized"] @ model.W_U, logits, atol=1e-6)
    directions = model.tokens_to_residual_directions(torch.tensor([5, 7]))
    assert torch.allclose(cache["ln_final.hook_normalized"] @ directions.T, logits[..., [5, 7]], atol=1e-6)
    assert torch.allclose(model.W_E, model.embed.weight * MULTIPLIERS["embedding_multiplier"])


def test_direct_logit_attribution_sums_to_the_logit(run):
    """The decomposition's components carry the residual multiplier and the directions the logits divisor: their
    attributions sum to the model's logit."""
    model, logits, cache = run
    stack = cache.get_full_resid_decomposition(expand_neurons=False)
    attrs = cache.logit_attrs(stack, tokens=5)
    assert torch.allclose(attrs.sum(0), logits[..., 5], atol=1e-5)
    heads = cache.stack_head_results()  # every head as the stream receives it (the base has no o_proj bias)
    assert torch.allclose(heads.sum(0), sum(cache["attn_out", l] for l in range(model.cfg.n_layers)), atol=1e-5)


def test_router_rule(run):
    """Top-k of the float32 logits; the weights a float32 softmax over the k chosen logits."""
    _, _, cache = run
    logits = cache["router_logits", 0]
    assert logits.dtype == torch.float32
    top = logits.topk(3, dim=-1)
    assert torch.equal(cache["expert_indices", 0], top.indices)
    assert torch.equal(cache["expert_weights", 0], torch.softmax(top.values, dim=-1))


def test_transformers_names_load_and_match(ckpts, refs):
    model = HookedTransformer.from_pretrained(ckpts["fused"], progress=False)
    check_report(compare(model, refs("fused"), tokens()), model, every_site)


# ---- bad checkpoints and configs -------------------------------------------------------------------------------

def test_missing_input_linear_is_named(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["base"], tmp_path / "missing")
    key = "model.layers.1.block_sparse_moe.input_linear.weight"
    rewrite_tensors(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


def test_wrong_expert_count_is_named(ckpts, tmp_path):
    folder = shutil.copytree(ckpts["fused"], tmp_path / "count")
    key = "model.layers.0.block_sparse_moe.experts.gate_up_proj"
    rewrite_tensors(folder, lambda t: t.update({key: t[key][:7].clone()}))
    with pytest.raises(CheckpointError, match="num_local_experts") as info:
        HookedTransformer.from_pretrained(folder, progress=False)
    assert key in str(info.value)


@pytest.mark.parametrize("field", list(MULTIPLIERS))
@pytest.mark.parametrize("value", [0, -1.0, "2", None])
def test_bad_multiplier_is_named(field, value):
    raw = {**GRANITE_1B, field: value}
    with pytest.raises((ValueError, TypeError), match=field):
        HookedGraniteMoe.config_from_hf(raw)


def test_partial_rotary_is_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        HookedGraniteMoe.config_from_hf({**GRANITE_1B, "partial_rotary_factor": 0.5})


# ---- plan, default ----------------------------------------------------------------------------------------------

GRANITE_1B = flagship("granitemoe", "ibm-granite/granite-3.0-1b-a400m-base")


def test_embedded_default_loads_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELENS_CACHE", str(tmp_path))
    model = HookedTransformer.from_pretrained("tiny-granitemoe", progress=False)
    assert type(model) is HookedGraniteMoe and model.cfg.residual_multiplier != 1.0
    logits = model(model.to_tokens("Hello granite"))
    assert logits.shape[-1] == 260 and torch.isfinite(logits).all()
    stored = [k for path in (tmp_path / "defaults").rglob("model.safetensors") for k in stored_keys(path.parent)]
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in stored  # written in the Hub's spelling
