"""MiniMax (HookedMiniMax) against transformers' MiniMaxForCausalLM: the hybrid layers (lightning attention and
softmax attention) site by site in float32 and bit for bit in bfloat16, the scaled normed residual, left padding,
a prompt in the block form against token-by-token decode, greedy generation, the recurrent state as a site, the
decay tables against the ones transformers stores, the config's layer kinds refused by name, plan at full size."""

import pytest
import torch
import transformers
import family_harness as harness
import tiny_minimax
from flagships import flagship
from family_harness import MODEL_SITES, References, build_checkpoints, check_greedy_generation, left_padded, tokens
from safetensors.torch import load_file

from moelens import HookedTransformer
from moelens.cache_analysis import StreamNotDecomposable
from moelens.kv_cache import KVCache
from moelens.models.components.sliding_window_attention import SlidingWindowAttention
from moelens.models.minimax import HookedMiniMax, MiniMaxBlock
from moelens.models.mixers.lightning import LightningAttention, decay_rates, decay_tables
from moelens.plan import plan
from moelens.state import RecurrentState
from moelens.verify import compare

VARIANTS = [v for (_, v) in tiny_minimax.VARIANTS]
BLOCK_SITES = ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid", "ln2.hook_normalized",
               "hook_mlp_out", "hook_resid_post")
LIGHTNING_SITES = ("mixer.hook_core_out", "mixer.hook_gate", "mixer.hook_z")
ATTENTION_SITES = ("attn.hook_k", "attn.hook_v", "attn.hook_z")
ROUTER_SITES = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routed_out")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory, "minimax", tiny_minimax.VARIANTS)


@pytest.fixture(scope="module")
def refs(ckpts):
    return References(ckpts)


def block_sites(model):
    def sites(layer: int):
        kind = LIGHTNING_SITES if model.cfg.layer_types[layer] == "linear_attention" else ATTENTION_SITES
        return BLOCK_SITES + kind + ROUTER_SITES
    return sites


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_every_site(ckpts, refs, variant):
    """40 tokens: five blocks of 8 in the lightning layers (32 in the one_block variant's single partial block)."""
    model = HookedTransformer.from_pretrained(ckpts[variant], progress=False)
    assert type(model) is HookedMiniMax
    harness.check_report(compare(model, refs(variant), tokens(shape=(2, 43))), model, block_sites(model), 1e-5, MODEL_SITES)


@pytest.mark.parametrize("variant", ["base", "sliding_window"])
def test_bfloat16_routing_identical_and_bit_exact(ckpts, refs, variant):
    """The decay tables cast from float32 as transformers' stored buffers are, the block form's and the
    residual factors' products in transformers' order: every site and the logits bit for bit."""
    model = HookedTransformer.from_pretrained(ckpts[variant], dtype=torch.bfloat16, progress=False)
    harness.check_bit_exact(compare(model, refs(variant, torch.bfloat16), tokens(shape=(2, 43))))


def test_the_layers_and_factors_are_what_the_config_says(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    assert [type(b.token_mixer) for b in model.blocks] == [LightningAttention, SlidingWindowAttention,
                                                             LightningAttention, LightningAttention]
    assert all(type(b) is MiniMaxBlock for b in model.blocks)
    assert (model.blocks[0].attn_alpha, model.blocks[0].attn_beta) == (1.25, 0.8)
    assert (model.blocks[1].attn_alpha, model.blocks[1].attn_beta) == (1.5, 0.75)
    assert (model.blocks[2].mlp_alpha, model.blocks[2].mlp_beta) == (1.1, 1.3)
    assert model.cfg.lightning_block_size == 8 and model.cfg.d_rot == 16
    defaults = HookedTransformer.from_pretrained(ckpts["defaults"], progress=False)
    assert defaults.cfg.layer_types == ("full_attention", "linear_attention") * 2


def test_the_block_keeps_the_scaled_normed_stream(ckpts):
    """resid_mid = alpha * ln1(resid_pre) + attn_out and resid_post = alpha_mlp * ln2(resid_mid) + mlp_out, written
    out from the cached sites; attn_out and mlp_out are beta times the sublayers' own outputs."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens(shape=(1, 12)))
    for layer, block in enumerate(model.blocks):
        mid = block.attn_alpha * cache[f"blocks.{layer}.ln1.hook_normalized"] + cache["attn_out", layer]
        post = block.mlp_alpha * cache[f"blocks.{layer}.ln2.hook_normalized"] + cache["mlp_out", layer]
        torch.testing.assert_close(mid, cache["resid_mid", layer], rtol=0, atol=0)
        torch.testing.assert_close(post, cache["resid_post", layer], rtol=0, atol=0)
        torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_routed_out"] * block.mlp_beta,
                                   cache["mlp_out", layer], rtol=0, atol=0)


def test_decompositions_of_the_stream_are_refused_naming_the_block(ckpts):
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens(shape=(1, 6)))
    with pytest.raises(StreamNotDecomposable, match="block 0 \\(MiniMaxBlock\\) does not add"):
        cache.decompose_resid(layer=2)
    with pytest.raises(StreamNotDecomposable):
        cache.stack_head_results(layer=-1)
    assert cache.accumulated_resid().shape[0] == model.cfg.n_layers + 1  # the cached streams themselves


def test_decay_tables_equal_the_buffers_transformers_stores(ckpts):
    """transformers writes its decay buffers into the checkpoint; moelens computes them from the config: bit for bit
    in float32, every lightning layer (each layer's rate depends on its depth)."""
    stored = load_file(ckpts["base"] / "model.safetensors")
    cfg = HookedTransformer.from_pretrained(ckpts["base"], progress=False).cfg
    for layer, kind in enumerate(cfg.layer_types):
        if kind != "linear_attention":
            continue
        rates = decay_rates(cfg.n_heads, layer, cfg.n_layers)
        query, key, within = decay_tables(rates, cfg.lightning_block_size)
        prefix = f"model.layers.{layer}.self_attn."
        for name, ours in (("slope_rate", rates), ("query_decay", query), ("key_decay", key), ("diagonal_decay", within)):
            assert torch.equal(ours, stored[prefix + name]), (layer, name)


def test_left_padded_batch_matches_transformers_padded_run(ckpts, refs):
    """transformers zeroes padded positions' q, k and v in the lightning layers (after the SiLU) and masks them in
    attention; moelens does the same."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    toks, mask = left_padded(7, (3, 30), (0, 9, 20))
    report = compare(model, refs("base"), toks, mask)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0, report


def test_block_prompt_then_token_by_token_decode_matches_transformers(ckpts, refs):
    """A 30-token forward (the block form) and a 12-token prompt then 18 one-token steps each equal transformers'
    run with its own cache within 1e-5. transformers is given the positions (as its generate does): its
    MiniMaxCache counts the cached tokens in layer 0's keys, which a lightning layer 0 never fills, so it cannot
    run an 18-token forward after the prompt either (its softmax layer's mask is built for no cached keys);
    moelens's (token by token in the lightning layers after a cached state, as transformers' form) equals the
    stepped run within 1e-5."""
    model, ref = HookedTransformer.from_pretrained(ckpts["base"], progress=False), refs("base")
    toks = tokens(11, (2, 30))

    def hf_run(chunks):
        cache = transformers.models.minimax.modeling_minimax.MiniMaxCache()
        return torch.cat([ref(toks[:, a:b], position_ids=torch.arange(a, b)[None], past_key_values=cache,
                              use_cache=True).logits for a, b in chunks], dim=1)

    def our_run(chunks):
        cache = KVCache.for_model(model)
        out = torch.cat([model(toks[:, a:b], past_kv_cache=cache) for a, b in chunks], dim=1)
        assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].length == 30
        return out

    stepped = [(0, 12)] + [(i, i + 1) for i in range(12, 30)]
    with torch.no_grad():
        assert (model(toks) - ref(toks).logits).abs().max() <= 1e-5
        theirs = hf_run(stepped)
        assert (our_run(stepped) - theirs).abs().max() <= 1e-5
        assert (our_run([(0, 12), (12, 30)]) - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generation_equals_transformers(ckpts, refs, dtype):
    """A prompt crossing a block boundary, then 24 tokens; a left-padded batch on the variant whose layer 0 is
    softmax attention."""
    model = HookedTransformer.from_pretrained(ckpts["base"], dtype=dtype, progress=False)
    check_greedy_generation(model, refs("base", dtype), tokens(4, (1, 12)), new=24)
    defaults = HookedTransformer.from_pretrained(ckpts["defaults"], dtype=dtype, progress=False)
    toks, mask = left_padded(8, (2, 10), (0, 3))
    check_greedy_generation(defaults, refs("defaults", dtype), toks, mask, new=12)


def test_left_padded_generation_equals_each_row_generated_alone(ckpts, refs):
    """With lightning attention on layer 0, transformers' MiniMaxCache reports no cached tokens (it counts layer 0's
    keys), so its decode steps build the softmax layers' mask without the cached padding: a left-padded row then
    sees its padding, and its tokens depart from the row's own (here from the second new token). moelens's padded
    batch gives each row what transformers gives the row alone."""
    model, ref = HookedTransformer.from_pretrained(ckpts["base"], progress=False), refs("base")
    ref.generation_config.eos_token_id = None
    toks, mask = left_padded(8, (2, 10), (0, 3))
    got = model.generate(toks, attention_mask=mask, max_new_tokens=12, stop_at_eos=False, do_sample=False)
    for row in range(2):
        alone = toks[row : row + 1, mask[row].bool()]
        with torch.no_grad():
            expected = ref.generate(alone, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(got[row, -expected.shape[1]:], expected[0]), row


def test_the_state_handed_on_is_a_site_and_an_edit_there_is_what_later_tokens_see(ckpts):
    """Halving blocks.0.mixer.hook_state_out after the prompt (in place) changes every later token exactly as a
    decode from a cache holding the halved state does."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    prompt, nxt = tokens(12, (1, 20)), tokens(13, (1, 1))

    def halve(state, hook):
        state.mul_(0.5)

    with torch.no_grad():
        edited = KVCache.for_model(model)
        model.run_with_hooks(prompt, past_kv_cache=edited, fwd_hooks=[("blocks.0.mixer.hook_state_out", halve)])
        by_hook = model(nxt, past_kv_cache=edited)
        plain_cache, by_hand = KVCache.for_model(model), KVCache.for_model(model)
        model(prompt, past_kv_cache=plain_cache)
        plain = model(nxt, past_kv_cache=plain_cache)
        model(prompt, past_kv_cache=by_hand)
        by_hand.layers[0].recurrent = by_hand.layers[0].recurrent * 0.5
        expected = model(nxt, past_kv_cache=by_hand)
    assert torch.equal(by_hook, expected)
    assert (by_hook - plain).abs().max() > 1e-4  # the edit mattered


def test_the_state_is_the_decayed_sum_of_k_transposed_v(ckpts):
    """The state after a prompt, written out from the cached keys and values: sum over j of exp(-s (n - 1 - j))
    k_j^T v_j per head (float64, against the mixer's float32 block form)."""
    model = HookedTransformer.from_pretrained(ckpts["base"], progress=False)
    _, cache = model.run_with_cache(tokens(14, (1, 21)))
    k, v = cache["blocks.2.mixer.hook_k"][0].double(), cache["blocks.2.mixer.hook_v"][0].double()  # [pos head d]
    rates = decay_rates(model.cfg.n_heads, 2, model.cfg.n_layers).double()[:, 0, 0]
    lags = torch.arange(20, -1, -1, dtype=torch.float64)
    weights = torch.exp(-rates[None, :] * lags[:, None])  # [pos head]
    expected = torch.einsum("ph,phk,phv->hkv", weights, k, v)
    torch.testing.assert_close(cache["blocks.2.mixer.hook_state_out"][0].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(layer_types=["linear_attention"] * 3), "layer_types has 3 entries, expected one per layer \\(4\\)"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types: unknown layer kinds"),
        (dict(layer_types="full_attention"), "layer_types = 'full_attention'"),
        (dict(block_size=0), "block_size = 0"),
        (dict(mlp_beta_factor="1"), "mlp_beta_factor"),
        (dict(linear_attn_alpha_factor=float("nan")), "linear_attn_alpha_factor"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}), "rope type 'linear'"),
    ],
)
def test_bad_config_fields_are_refused_by_name(edit, match):
    raw = {**tiny_minimax.minimax_config().to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        HookedMiniMax.config_from_hf(raw)


def test_partial_rotary_factor_is_reported_ignored_as_transformers_ignores_it():
    raw = tiny_minimax.minimax_config().to_dict()
    raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 0.5}
    cfg = HookedMiniMax.config_from_hf(raw)
    assert cfg.d_rot == cfg.d_head == 16 and cfg.fields_ignored == ("partial_rotary_factor",)


MINIMAX_TEXT_01 = flagship("minimax", "MiniMaxAI/MiniMax-Text-01-hf")


def test_plan_counts_the_attention_layers_keys_and_the_lightning_layers_state():
    """10 softmax layers cache 2 x 8 kv heads x 128 values per token (bfloat16); 70 lightning layers hold a state of
    64 heads x 128 x 128 per sequence (bfloat16, the model's dtype), whatever its length."""
    p = plan(MINIMAX_TEXT_01, dtype="bfloat16", gpus=8, gpu_memory="141GB", batch=1, seq=2048)
    per_token = 10 * 2 * 8 * 128 * 2
    state = 70 * 64 * 128 * 128 * 2
    assert p.kv_cache["bytes"] == 2048 * per_token + state


def test_plan_cache_is_what_transformers_cache_holds():
    """The plan's cache against transformers' MiniMaxCache after a forward: the softmax layer's keys and values per
    token, the lightning layers' states per sequence."""
    from transformers import MiniMaxForCausalLM

    config = tiny_minimax.minimax_config()
    for batch, seq in [(1, 5), (2, 13)]:
        model = MiniMaxForCausalLM(config).eval()
        with torch.no_grad():
            cache = model(torch.randint(0, 96, (batch, seq)), use_cache=True).past_key_values
        held = [t for t in cache.linear_cache if isinstance(t, torch.Tensor)]
        held += [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                 if isinstance(t, torch.Tensor)]
        expected = sum(t.numel() * t.element_size() for t in held)
        assert plan(config.to_dict(), dtype="float32", batch=batch, seq=seq, cpu_memory="1GB").kv_cache["bytes"] == expected
