"""Llama 4's text model (HookedLlama4) against transformers' Llama4ForCausalLM: site by site in float32, bit for
bit in bfloat16, the router weight on the expert's input, the interleaved-pair rotary (llama3 scaling), the
NoPE layers' temperature, chunked attention, left padding as transformers runs it, greedy generation, the flat
and the Hub's nested config and key spellings, per-expert and fused experts, bad checkpoints and configs, the
plan at full size (Scout, Maverick), support(), verify and the embedded default."""

import json
import shutil

import pytest
import torch
import family_harness as harness
import tiny_llama4_text as tiny_l4
from flagships import flagship
from family_harness import (
    MODEL_SITES, References, build_checkpoints, check_bit_exact, check_greedy_generation, copy_checkpoint,
    left_padded, rewrite_tensors, stored_keys, tokens,
)

from moelens import CheckpointError, HookedTransformer
from moelens.cli import main
from moelens.config import HFConfig
from moelens.experts.spec import GLU, ExpertSpec
from moelens.models.components import SharedExpertMoe
from moelens.models.components.rotary import inverse_frequencies
from moelens.models.llama4_text import (
    HookedLlama4, Llama4Attention, PairRotaryAttention, PairRotaryL2NormAttention, SigmoidOfChosenLogits,
    TemperatureNoRopeAttention,
)
from moelens.plan import plan
from moelens.verify import compare, load_reference

VARIANTS = [v for (_, v) in tiny_l4.OWN_VARIANTS]
REFERENCED = ["base", "interleaved", "sharded", "plain"]  # transformers loads these as they are


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "llama4_text", tiny_l4.OWN_VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def load(path, **kwargs):
    return HookedTransformer.from_pretrained(path, progress=False, **kwargs)


ATTENTION = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
             "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post")


def block_sites(model):
    def sites(layer):
        if model.cfg.moe_layers[layer]:
            return ATTENTION + (
                "mlp.hook_router_logits", "mlp.hook_expert_indices", "mlp.hook_expert_weights", "mlp.hook_routed_out",
                "mlp.shared_expert.hook_post", "mlp.shared_expert.hook_out", "mlp.hook_shared_out",
            )
        return ATTENTION + ("mlp.hook_post",)

    return sites


def check_report(report, model, tol=1e-5):
    harness.check_report(report, model, block_sites(model), tol, MODEL_SITES)


def reference_routing(ref, toks, mask=None):
    """transformers' routing per mixture layer: the dense sigmoid scores its router returns ([tokens, experts],
    zero where not chosen), as (chosen experts sorted, their weights in that order)."""
    seen = {}
    hooks = [
        layer.feed_forward.router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0]))
        for i, layer in enumerate(ref.model.layers) if layer.is_moe_layer
    ]
    try:
        with torch.no_grad():
            ref(toks, attention_mask=mask, position_ids=None if mask is None else harness_positions(mask))
    finally:
        for h in hooks:
            h.remove()
    return seen


def harness_positions(mask):
    from moelens.positions import positions_from_mask

    return positions_from_mask(mask)


# ---- float32: every site -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", REFERENCED)
def test_float32_every_site(ckpts, refs, variant):
    model = load(ckpts[variant])
    assert type(model) is HookedLlama4
    check_report(compare(model, refs(variant), tokens()), model)


@pytest.mark.parametrize("variant", ["base", "interleaved"])
def test_float32_left_padded_and_fused_attention(ckpts, refs, variant):
    """transformers' padded run (positions from the mask, as generate gives them): every compared site within
    1e-5 on the real tokens, with eager and with fused attention."""
    model, ref = load(ckpts[variant]), refs(variant)
    toks, mask = left_padded(5, (3, 24), (0, 5, 11))
    check_report(compare(model, ref, toks, mask), model)
    model.set_attention_backend("fused")
    report = compare(model, ref, toks, mask)
    assert report.max_logit_diff <= 1e-5, report


@pytest.mark.parametrize("variant", ["base", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_transformers(ckpts, refs, variant, dtype):
    """transformers' router returns dense sigmoid scores (zero where an expert was not chosen): the experts it
    chose are hook_expert_indices' and its scores hook_expert_weights' (float32 within 1e-6, bfloat16 bit for bit)."""
    model, ref = load(ckpts[variant], dtype=dtype), refs(variant, dtype)
    seen = reference_routing(ref, tokens())
    _, cache = model.run_with_cache(tokens(), names_filter=lambda n: n.endswith(("expert_indices", "expert_weights")))
    assert sorted(seen) == model.cfg.moe_layer_indices
    for layer, dense in seen.items():
        idx = cache["expert_indices", layer].reshape(dense.shape[0], -1)
        w = cache["expert_weights", layer].reshape(dense.shape[0], -1)
        order = idx.argsort(-1)
        theirs = dense.topk(idx.shape[-1], dim=-1)
        assert torch.equal(theirs.indices.sort(-1).values, idx.gather(-1, order))
        assert ((dense > 0).sum(-1) == idx.shape[-1]).all()
        tol = 1e-6 if dtype == torch.float32 else 0.0
        assert (dense.gather(-1, idx) - w).abs().max() <= tol and w.dtype == dtype


def test_variants_are_what_they_claim(ckpts):
    cfg = {v: load(p).cfg for v, p in ckpts.items()}
    base = cfg["base"]
    assert base.moe_layers == (True,) * 4 and base.top_k_per_layer == (1,) * 4 and base.use_qk_norm
    assert base.rope_layers == (True, False, True, False) and base.attention_chunks == (8, None, 8, None)
    assert base.rope.kind == "llama3" and base.attn_temperature_tuning and base.floor_scale == 4
    assert (base.d_expert, base.d_shared, base.d_mlp) == (32, 32, 0)
    inter = cfg["interleaved"]
    assert inter.moe_layers == (False, True, False, True) and inter.d_mlp == 80 and inter.top_k_per_layer == (0, 2, 0, 2)
    assert not inter.use_qk_norm and inter.rope.kind == "default"
    plain = cfg["plain"]
    assert plain.attention_chunks == (None,) * 4 and not plain.attn_temperature_tuning and plain.tie_word_embeddings
    hub = cfg["hub_nested"]
    assert hub.key_prefix == "language_model." and hub.attn_temperature_tuning and hub.rope.kind == "llama3"
    assert "text_config.attention_chunk_size" in hub.fields_read and "vision_config" in hub.fields_ignored
    assert len(list(ckpts["sharded"].glob("*.safetensors"))) > 1
    assert "model.layers.0.feed_forward.experts.7.down_proj.weight" in stored_keys(ckpts["per_expert"])
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in stored_keys(ckpts["base"])


def test_recipe():
    cfg = HookedLlama4.config_from_hf(tiny_l4.llama4_config(interleave_moe_layer_step=2).to_dict())
    layers = HookedLlama4.recipe(cfg).layers
    assert [spec.mixer for spec in layers] == [
        PairRotaryL2NormAttention, TemperatureNoRopeAttention, PairRotaryL2NormAttention, TemperatureNoRopeAttention,
    ]
    assert [spec.is_moe for spec in layers] == [False, True, False, True]
    assert layers[1].ffn.moe is SharedExpertMoe and layers[1].ffn.router is SigmoidOfChosenLogits
    cfg = HookedLlama4.config_from_hf(tiny_l4.llama4_config(use_qk_norm=False, attn_temperature_tuning=False).to_dict())
    assert [spec.mixer for spec in HookedLlama4.recipe(cfg).layers][:2] == [PairRotaryAttention, Llama4Attention]


# ---- the router weight on the expert's input -------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "interleaved"])
def test_router_weight_scales_the_expert_input(ckpts, variant):
    """By hand from the cached tensors and the weights: each slot's hook_expert_outputs is expert(weight * x)
    (not weight * expert(x), which differs), they sum to hook_routed_out, and hook_mlp_out adds the shared expert."""
    model = load(ckpts[variant])
    _, cache = model.run_with_cache(tokens())
    layer = model.cfg.moe_layer_indices[-1]
    experts = model.blocks[layer].mlp.experts
    x = cache["ln2_normalized", layer]
    idx, w = cache["expert_indices", layer], cache["expert_weights", layer]
    gate_up, down = experts.W_gate_up[idx], experts.W_down[idx]  # [b p k 2I H], [b p k H I]
    scaled = x[:, :, None, :] * w[..., None]
    g, u = torch.einsum("bpkih,bpkh->bpki", gate_up, scaled).chunk(2, dim=-1)
    by_hand = torch.einsum("bpkhi,bpki->bpkh", down, torch.nn.functional.silu(g) * u)
    outputs = cache[f"blocks.{layer}.mlp.hook_expert_outputs"]
    assert (outputs - by_hand).abs().max() <= 1e-5
    g0, u0 = torch.einsum("bpkih,bpkh->bpki", gate_up, x[:, :, None, :].expand_as(scaled)).chunk(2, dim=-1)
    weighted_after = w[..., None] * torch.einsum("bpkhi,bpki->bpkh", down, torch.nn.functional.silu(g0) * u0)
    assert (outputs - weighted_after).abs().max() > 1e-2  # the rule matters on these weights
    assert (outputs.sum(2) - cache["routed_out", layer]).abs().max() <= 1e-5
    shared = cache[f"blocks.{layer}.mlp.hook_shared_out"]
    assert (cache["routed_out", layer] + shared - cache["mlp_out", layer]).abs().max() <= 1e-5


def test_neuron_decomposition_does_not_weight_twice(ckpts):
    """The routed experts' neurons (get_neuron_results) sum over slots and neurons to hook_routed_out: the
    routing weight is inside the neurons already, not applied again."""
    model = load(ckpts["base"])
    _, cache = model.run_with_cache(tokens())
    for layer in model.cfg.moe_layer_indices:
        neurons = cache.get_neuron_results(layer)  # [b p k n d]
        assert (neurons.sum((2, 3)) - cache["routed_out", layer]).abs().max() <= 1e-5


def test_expert_spec_weight_at():
    spec = ExpertSpec(4, 8, 2, GLU("silu"), weight_at="input")
    assert "input" in spec.describe() and spec.triton_refusal() is not None and not spec.fused_by_triton
    assert "routing weight to each expert's output" in spec.triton_refusal()
    with pytest.raises(ValueError, match="weight_at must be 'output' or 'input', got 'middle'"):
        ExpertSpec(4, 8, 2, GLU("silu"), weight_at="middle")


def test_triton_backend_is_refused_with_the_reason(ckpts):
    model = load(ckpts["base"])
    with pytest.raises(ValueError, match="routing weight to each expert's output"):
        model.set_experts_backend("triton")


def test_support_says_where_the_weight_is(ckpts):
    table = load(ckpts["base"]).support(print_table=False)
    rows = {r.name: r for r in table.rows}
    assert "input scaled by the slot's weight" in rows["blocks.L.mlp.experts.hook_post"].meaning
    assert "weight is inside" in rows["blocks.L.mlp.hook_expert_outputs"].meaning
    assert "before its expert" in rows["blocks.L.mlp.hook_expert_weights"].meaning
    assert "sigmoid is its weight" in rows["blocks.L.mlp.hook_router_scores"].meaning
    rot_q = rows["blocks.L.attn.hook_rot_q"].meaning  # RoPE and NoPE layers, each with its blocks
    assert rot_q.startswith("blocks 0,2: queries entering attention (after rotary") and "blocks 1,3: " in rot_q
    assert "attention temperature" in rot_q
    assert rows["blocks.L.mlp.hook_router_logits"].reference.startswith("model.layers.L.feed_forward.router")
    assert "text_config" not in " ".join(table.config_fields) and "attention_chunk_size" in table.config_fields


# ---- attention: rotary, temperature, chunks ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_transformers_apply_rotary_emb(ckpts, refs, dtype, monkeypatch):
    """transformers turns q and k inside its attention forward (no module to hook): its apply_rotary_emb's
    outputs, L2-normed as its qk_norm does, equal hook_rot_q / hook_rot_k on the RoPE layers (bfloat16 bit for
    bit), and its attention probabilities hook_pattern on every layer."""
    import transformers.models.llama4.modeling_llama4 as modeling

    seen = []
    original = modeling.apply_rotary_emb
    monkeypatch.setattr(modeling, "apply_rotary_emb", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    model, ref = load(ckpts["base"], dtype=dtype), refs("base", dtype)
    with torch.no_grad():
        out = ref(tokens(), output_attentions=True)
    _, cache = model.run_with_cache(tokens(), names_filter=["*rot_q", "*rot_k", "*pattern"])
    rope = [layer for layer, on in enumerate(model.cfg.rope_layers) if on]
    assert len(seen) == len(rope) == 2
    tol = 1e-5 if dtype == torch.float32 else 0.0
    l2 = modeling.Llama4TextL2Norm(model.cfg.norm_eps)
    for layer, (q_rot, k_rot) in zip(rope, seen):
        assert (cache["rot_q", layer] - l2(q_rot)).abs().max() <= tol
        assert (cache["rot_k", layer] - l2(k_rot)).abs().max() <= tol
    for layer in range(model.cfg.n_layers):
        assert (cache["pattern", layer] - out.attentions[layer]).abs().max() <= tol


def test_llama3_inverse_frequencies_are_transformers():
    """The llama3 rotary kind against transformers' own function, with Scout's equal factors and with a band."""
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for high in (1.0, 4.0):
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": high, "original_max_position_embeddings": 8192}
        config = Llama4TextConfig(head_dim=128, rope_parameters=dict(rope))
        theirs, scaling = ROPE_INIT_FUNCTIONS["llama3"](config)
        ours = HFConfig({"rope_parameters": rope}).rope()
        mine, my_scaling = inverse_frequencies(ours, 128)
        assert torch.equal(mine, theirs) and my_scaling == scaling == 1.0
    plain = inverse_frequencies(HFConfig({"rope_theta": 500000.0}).rope(), 128)[0]
    assert not torch.equal(plain, mine)


def test_nope_temperature_by_hand(ckpts):
    """A NoPE layer's queries entering attention are hook_q times log1p(floor((i + 1) / floor_scale)) * attn_scale
    + 1, i the index among the input's positions, padding counted (as transformers counts it)."""
    model = load(ckpts["base"])
    toks, mask = left_padded(5, (3, 24), (0, 5, 11))
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=["*hook_q", "*rot_q"])
    i = torch.arange(24, dtype=torch.float32)
    scale = torch.log1p(torch.floor((i + 1) / tiny_l4.FLOOR_SCALE)) * 0.1 + 1
    assert scale[-1] > scale[0] == 1.0
    for layer in (1, 3):
        expected = cache["q", layer] * scale[None, :, None, None]
        assert (cache["rot_q", layer] - expected).abs().max() <= 1e-6


def test_chunks_count_from_each_rows_first_real_token(ckpts):
    """On a chunked layer a query sees the keys of its chunk only, chunks of attention_chunk_size counted from
    the row's first real token; NoPE layers see every earlier real key."""
    model = load(ckpts["base"])
    toks, mask = left_padded(5, (3, 24), (0, 5, 11))
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=["*pattern"])
    for row, pad in enumerate((0, 5, 11)):
        for q in range(pad, 24):
            pos = q - pad
            seen = cache["pattern", 0][row, :, q].amax(0) > 0
            start = pad + (pos // tiny_l4.CHUNK) * tiny_l4.CHUNK
            assert torch.equal(seen.nonzero().flatten(), torch.arange(start, q + 1)), (row, q)
            assert torch.equal((cache["pattern", 1][row, :, q].amax(0) > 0).nonzero().flatten(), torch.arange(pad, q + 1))


def test_a_padded_row_differs_from_the_row_alone_as_in_transformers(ckpts, refs):
    """transformers' Llama 4 is not left-pad invariant: the NoPE layers' temperature counts the padding. A
    padded row's logits differ from the row run alone (in moelens as in transformers), and equal transformers'
    padded run; without temperature tuning (the plain variant) they are the row alone's."""
    toks, mask = left_padded(5, (3, 24), (0, 5, 11))
    for variant, invariant in (("base", False), ("plain", True)):
        model, ref = load(ckpts[variant]), refs(variant)
        padded = model(toks, attention_mask=mask)[2, 11:]
        alone = model(toks[2:, 11:])[0]
        assert ((padded - alone).abs().max() <= 1e-4) == invariant, variant
        with torch.no_grad():
            theirs = ref(toks, attention_mask=mask, position_ids=harness_positions(mask)).logits[2, 11:]
        assert (padded - theirs).abs().max() <= 1e-5


# ---- bfloat16 and generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,seeds", [("base", (3, 0)), ("interleaved", (3, 1)), ("plain", (3,))])
def test_bfloat16_is_bit_exact(ckpts, refs, variant, seeds):
    """Router logits and weights bfloat16 (the sigmoid computed float32 and cast, as transformers), the rotary in
    float32 from torch.polar's tables, the softmax in bfloat16: the same experts chosen and every site but the
    routed experts' bit for bit, unpadded and padded. The routed experts' output is bitwise on some CPUs only:
    transformers runs every expert on every token (one bmm of all the tokens per expert), moelens the routed
    rows alone (a grouped GEMM with fewer rows), and a bfloat16 GEMM kernel may round a row by the rows around
    it (on an AMD EPYC one bfloat16 ulp on the tiny "plain" variant). There, the result is as close to
    transformers' float32 run as transformers' own bfloat16 run is."""
    model, ref = load(ckpts[variant], dtype=torch.bfloat16), refs(variant, torch.bfloat16)
    ref32 = refs(variant, torch.float32)
    for toks, mask in [(tokens(seed), None) for seed in seeds] + [left_padded(5, (3, 24), (0, 5, 11))]:
        report = compare(model, ref, toks, mask)
        assert report.index_mismatches == 0, report
        routed = [s for s in report.sites if ".mlp." in s.site or s.site.endswith(("hook_mlp_out", "hook_resid_post"))]
        if report.max_logit_diff == 0.0 and all(s.max_abs_diff == 0.0 for s in routed):
            check_bit_exact(report)
            continue
        first = min(int(s.site.split(".")[1]) for s in report.sites if s.site.startswith("blocks.") and s.max_abs_diff)
        assert all(s.max_abs_diff == 0.0 for s in report.sites  # everything before the first differing routed output
                   if s.site.startswith("blocks.") and int(s.site.split(".")[1]) < first), report
        assert any(s.site == f"blocks.{first}.mlp.hook_routed_out" and s.max_abs_diff for s in report.sites), report
        positions = None if mask is None else harness_positions(mask)  # as compare() gives transformers
        with torch.no_grad():
            real = torch.ones_like(toks, dtype=torch.bool) if mask is None else mask.bool()  # padding means nothing
            exact = ref32(toks, attention_mask=mask, position_ids=positions).logits[real]
            theirs = (ref(toks, attention_mask=mask, position_ids=positions).logits[real].float() - exact).abs().mean()
            ours = (model(toks, attention_mask=mask)[real].float() - exact).abs().mean()
        assert ours <= 1.5 * theirs, (ours, theirs)


@pytest.mark.parametrize("variant,padded", [("base", False), ("base", True), ("interleaved", True)])
def test_greedy_generation_matches_transformers(ckpts, refs, variant, padded):
    """64 new tokens, each with its own cache (transformers' chunked layers keep a sliding cache, moelens every
    key under the chunk mask)."""
    prompt = left_padded(5, (3, 9), (0, 3, 1)) if padded else (tokens(5, (3, 9)), None)
    check_greedy_generation(load(ckpts[variant]), refs(variant), *prompt, new=64)


# ---- spellings ---------------------------------------------------------------------------------------------------


def test_hub_nested_checkpoint_is_the_flat_one(ckpts, refs, tmp_path):
    """The Hub's spelling of one checkpoint (model_type llama4, text_config, keys under language_model., a vision
    tower beside it) loads bit for bit as the flat one and matches transformers' flat model; the vision tower
    and projector are skipped, any other unknown key refused."""
    nested = tiny_l4.hub_nested(copy_checkpoint(ckpts, tmp_path))
    assert json.loads((nested / "config.json").read_text())["model_type"] == "llama4"
    flat, hub = load(ckpts["base"]).state_dict(), load(nested).state_dict()
    assert flat.keys() == hub.keys() and all(torch.equal(flat[n], hub[n]) for n in flat)
    check_report(compare(load(nested), refs("base"), tokens()), load(nested))
    rewrite_tensors(nested, lambda t: t.__setitem__("language_model.model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="language_model.model.extra.weight"):
        load(nested)


def test_per_expert_keys_load_as_the_fused(ckpts, tmp_path):
    fused = load(ckpts["base"]).state_dict()
    per = load(tiny_l4.per_expert(copy_checkpoint(ckpts, tmp_path))).state_dict()
    assert fused.keys() == per.keys() and all(torch.equal(fused[n], per[n]) for n in fused)


def test_both_model_type_spellings_register():
    from moelens import FAMILIES

    assert FAMILIES["llama4_text"] is FAMILIES["llama4"] is HookedLlama4


def test_bad_checkpoints_name_the_family_keys(ckpts, tmp_path):
    folder = copy_checkpoint(ckpts, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("model.layers.2.feed_forward.router.weight"))
    with pytest.raises(CheckpointError, match="model.layers.2.feed_forward.router.weight"):
        load(folder)
    folder = copy_checkpoint(ckpts, tmp_path, "interleaved")
    shutil.rmtree(tmp_path / "base")

    def shrink(t):
        t["model.layers.1.feed_forward.experts.gate_up_proj"] = t["model.layers.1.feed_forward.experts.gate_up_proj"][:, :, :10].contiguous()

    rewrite_tensors(folder, shrink)
    with pytest.raises(CheckpointError, match="model.layers.1.feed_forward.experts.gate_up_proj"):
        load(folder)


@pytest.mark.parametrize("change,message", [
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers has 3 entries, expected one per layer"),
    ({"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers\[1\] = 2"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list 4 entries"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types must list 4 entries"),
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4}, "attention_chunk_size is null"),
    ({"attn_temperature_tuning": "yes"}, "attn_temperature_tuning = 'yes'"),
    ({"moe_layers": [0, 4]}, r"moe_layers\[1\] = 4"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}, "original_max_position_embeddings"),
])
def test_config_refusals(change, message):
    raw = {**tiny_l4.llama4_config().to_dict(), **change}
    with pytest.raises((ValueError, KeyError), match=message):
        HookedLlama4.config_from_hf(raw)


def test_nested_config_refusals_name_the_section():
    with pytest.raises(ValueError, match="text_config"):
        HookedLlama4.config_from_hf({"model_type": "llama4"})
    text = {**tiny_l4.llama4_config().to_dict(), "floor_scale": -1}
    with pytest.raises(ValueError, match="text_config.floor_scale = -1"):
        HookedLlama4.config_from_hf({"model_type": "llama4", "text_config": text})


# ---- plan at full size, verify, the embedded default ----------------------------------------------------------

SCOUT = flagship("llama4_text", "meta-llama/Llama-4-Scout-17B-16E")
MAVERICK = flagship("llama4_text", "meta-llama/Llama-4-Maverick-17B-128E")
# transformers' count of the text model, by hand: 48 x (attention 5120 x (40 + 2 x 8 + 40) x 128 + 2 norms) +
# per mixture layer (router 5120 x E + E experts x 3 x 5120 x 8192 + the shared expert 3 x 5120 x 8192), per
# dense layer 3 x 5120 x 16384, + 2 x 202048 x 5120 + 5120. Meta publishes 109B (Scout) and 400B (Maverick)
# total parameters, the vision tower included.
SCOUT_PARAMETERS = 107_769_861_120
MAVERICK_PARAMETERS = 400_711_848_960


@pytest.mark.parametrize("config,count", [(SCOUT, SCOUT_PARAMETERS), (MAVERICK, MAVERICK_PARAMETERS)])
def test_plan_counts_by_hand_at_full_size(config, count):
    """(The counts against transformers' and the published totals: tests/test_flagships.py.)"""
    p = plan(dict(config), dtype="bfloat16", cpu_memory="2TB")
    assert p.parameters == count
    assert p.bytes == 2 * count
    E = config["num_local_experts"]
    moe = 48 // config["interleave_moe_layer_step"]
    assert p.components["routed_experts"].parameters == moe * E * 3 * 5120 * 8192
    assert p.components["routers"].parameters == moe * E * 5120
    assert p.components["shared_experts"].parameters == moe * 3 * 5120 * 8192
    assert p.components["dense_mlp"].parameters == (48 - moe) * 3 * 5120 * 16384


@pytest.mark.parametrize("config", [SCOUT, MAVERICK])
def test_plan_places_scout_and_maverick(config):
    """bfloat16: Scout (216 GB) and Maverick (801 GB) fit no single 141 GB GPU; both fit one node of eight."""
    one = plan(dict(config), dtype="bfloat16", cpu_memory="2TB", gpus=1, gpu_memory="141GB")
    assert "one_device" not in [o["kind"] for o in one.placement["options"]]
    node = plan(dict(config), dtype="bfloat16", cpu_memory="2TB", gpus=8, gpu_memory="141GB")
    assert node.placement["recommended"]["kind"] == "device_map"


def test_plan_reads_the_hub_nesting():
    nested = {"model_type": "llama4", "text_config": {**SCOUT, "attn_temperature_tuning": 4}, "vision_config": {}}
    assert plan(nested, dtype="bfloat16", cpu_memory="2TB").parameters == SCOUT_PARAMETERS


def test_embedded_default_verify_and_generate(tmp_path, monkeypatch, capsys):
    from moelens.defaults import default_checkpoint

    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    model = HookedTransformer.from_pretrained("tiny-llama4", progress=False)
    assert type(model) is HookedLlama4 and model.cfg.d_vocab == 260
    assert model.generate("Hi", max_new_tokens=3, stop_at_eos=False, do_sample=False)
    folder = default_checkpoint("tiny-llama4")
    report = compare(model, load_reference(folder), torch.randint(0, 260, (2, 16)))
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0
    assert main(["verify", "tiny-llama4"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out and "blocks.3.mlp.hook_router_logits" in out
