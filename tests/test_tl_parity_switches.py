"""TransformerLens's optional hooks: set_use_attn_result, set_use_split_qkv_input, set_use_attn_in and
set_use_hook_mlp_in. TransformerLens's meaning, checked here:

- use_attn_result: blocks.L.attn.hook_result [batch pos head_index d_model] is head h's z times its slice of
  W_O (no b_O); the attention output is their sum plus b_O.
- use_split_qkv_input: blocks.L.hook_q_input / hook_k_input / hook_v_input [batch pos head_index d_model] are
  copies of the residual stream entering the block (before ln1), one per (kv) head; head h's q / k / v read
  only its copy.
- use_attn_in: blocks.L.hook_attn_in, one copy per head read by its q, k and v; refused with grouped kv heads.
- use_hook_mlp_in: blocks.L.hook_mlp_in [batch pos d_model], resid_mid as the MLP reads it.
When the hooks only read, the output is the plain forward's (up to rounding: per-head sums). cfg.use_* says
which switches are on. The references are hand computations from the weights and the plain forward's cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FAMILIES, as_added, attention_layers, attentions

from moelens import HookedTransformer

ATOL = 1e-5
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def load(checkpoints):
    """A fresh model per test: the switches change the model."""

    def build(family: str, variant: str = "base") -> HookedTransformer:
        return HookedTransformer.from_pretrained(checkpoints[family, variant], progress=False)

    return build


def plain_run(model: HookedTransformer):
    with torch.no_grad():
        return model.run_with_cache(TOKENS)


# ---- use_attn_result ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_attn_result_is_each_heads_share_of_the_output(load, family):
    model = load(family)
    logits, plain = plain_run(model)
    model.set_use_attn_result(True)
    assert model.cfg.use_attn_result is True
    with torch.no_grad():
        out, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(out, logits, rtol=0, atol=ATOL)
    # every softmax attention (a block's several, LongCat-Flash's attn_1 too); a hybrid's linear-attention layers
    # have no heads: no hook_result there
    heads = attentions(model)
    assert sorted(n for n in cache.keys() if n.endswith("hook_result")) == sorted(
        f"blocks.{l}.{a}.hook_result" for l, a in heads)
    for layer, a in heads:
        attn = getattr(model.blocks[layer], a)
        z = plain[f"blocks.{layer}.{a}.hook_z"]  # [batch pos head d_head]
        n_heads, d_head = z.shape[-2:]
        w_o = attn.o_proj.weight.detach().view(-1, n_heads, d_head)  # [d_model head d_head]
        expected = torch.stack([z[:, :, h] @ w_o[:, h].T for h in range(n_heads)], dim=2)
        result = cache[f"blocks.{layer}.{a}.hook_result"]
        assert result.shape == (*TOKENS.shape, n_heads, model.cfg.d_model)
        torch.testing.assert_close(result, expected, rtol=0, atol=ATOL)
        bias = 0 if attn.o_proj.bias is None else attn.o_proj.bias.detach()
        # the heads' sum is attention's output as the block adds it (times the residual multiplier; a post-norm
        # block norms it first)
        torch.testing.assert_close(as_added(model, layer, "mixer", result.sum(2) + bias), plain[f"blocks.{layer}.hook_{a}_out"], rtol=0, atol=ATOL)


def test_attn_result_edits_reach_the_output(load):
    model = load("qwen2_moe")
    model.set_use_attn_result(True)
    _, plain = plain_run(model)

    def drop_head_1(result, hook):
        result[:, :, 1] = 0

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_result", drop_head_1)]):
        _, dropped = model.run_with_cache(TOKENS, names_filter=["blocks.0.hook_attn_out"])
    expected = plain["attn_out", 0] - plain["result", 0][:, :, 1]
    torch.testing.assert_close(dropped["attn_out", 0], expected, rtol=0, atol=ATOL)


def test_switching_off_removes_the_hook_points_and_restores_the_plain_forward(load):
    model = load("qwen2_moe")
    with torch.no_grad():
        plain = model(TOKENS)
    names = set(model.hook_dict)
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    added = set(model.hook_dict) - names
    layers = range(model.cfg.n_layers)
    assert added == {f"blocks.{l}.{s}" for l in layers for s in (
        "attn.hook_result", "hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in")}
    for switch in ("attn_result", "split_qkv_input", "hook_mlp_in"):
        getattr(model, f"set_use_{switch}")(False)
    assert set(model.hook_dict) == names
    assert not (model.cfg.use_attn_result or model.cfg.use_split_qkv_input or model.cfg.use_hook_mlp_in)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain)
    with pytest.raises(KeyError, match=r"hook_result exists only after model.set_use_attn_result\(True\)"):
        model.run_with_cache(TOKENS, names_filter=["blocks.0.attn.hook_result"])
    with pytest.raises(KeyError, match=r"hook_q_input exists only after model.set_use_split_qkv_input\(True\)"):
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_q_input", lambda t, hook: None)])


def test_an_optional_hook_named_while_off_is_an_assertion_error_as_in_transformer_lens(load):
    """TL's test_conditional_hooks: add_hook on hook_result / hook_q_input with the switch off raises
    AssertionError; moelens's error is that and a KeyError (an unknown name), and names the switch."""
    model = load("qwen2_moe")
    with pytest.raises(AssertionError, match=r"set_use_attn_result\(True\)"):
        model.add_hook("blocks.0.attn.hook_result", lambda t, hook: t)
    with pytest.raises(KeyError, match=r"set_use_split_qkv_input\(True\)"):
        model.add_hook("blocks.0.hook_q_input", lambda t, hook: t)
    with pytest.raises(KeyError) as unknown:
        model.add_hook("blocks.0.hook_nothing", lambda t, hook: t)
    assert not isinstance(unknown.value, AssertionError)  # only the switchable sites say "assert"


def test_a_switch_takes_a_bool(load):
    model = load("qwen2_moe")
    with pytest.raises(TypeError, match="use_attn_result must be True or False, got 1"):
        model.set_use_attn_result(1)


def test_a_cfg_with_a_switch_on_builds_a_model_with_it_on(load):
    model = load("qwen2_moe")
    built = type(model).build(dataclasses.replace(model.cfg, use_hook_mlp_in=True))
    assert built.cfg.use_hook_mlp_in and "blocks.0.hook_mlp_in" in built.hook_dict


# ---- use_split_qkv_input -----------------------------------------------------------------------------------
def require_per_head_inputs(model: HookedTransformer) -> None:
    """Latent attention (DeepSeek-V2 / V3, LongCat-Flash, ...) has no per-head map of the stream, and
    set_use_split_qkv_input refuses it (tested below): what its attention reports, per_head_projections."""
    if not all(sub.module.per_head_projections for b in model.attention_blocks() for sub in b.attention_sublayers()):
        pytest.skip(f"{model.cfg.family}'s attention has no per-head projections: split inputs are refused")


@pytest.mark.parametrize("family", FAMILIES)
def test_split_qkv_inputs_are_copies_of_resid_pre_and_the_output_is_unchanged(load, family):
    model = load(family)
    require_per_head_inputs(model)
    logits, plain = plain_run(model)
    model.set_use_split_qkv_input(True)
    assert model.cfg.use_split_qkv_input is True
    with torch.no_grad():
        out, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(out, logits, rtol=0, atol=ATOL)
    cfg = model.cfg
    layers = attention_layers(model)  # the split inputs are per attention head: only attention blocks have them
    assert sorted(n for n in cache.keys() if n.endswith("hook_q_input")) == sorted(f"blocks.{l}.hook_q_input" for l in layers)
    for layer in layers:
        resid = plain["resid_pre", layer]
        kv_heads = model.blocks[layer].attn.n_kv_heads  # per layer where a family's differ (MiMo-V2-Flash's)
        for site, heads in (("q_input", cfg.n_heads), ("k_input", kv_heads), ("v_input", kv_heads)):
            got = cache[f"blocks.{layer}.hook_{site}"]
            assert got.shape == (*TOKENS.shape, heads, cfg.d_model)
            for h in range(heads):
                assert torch.equal(got[:, :, h], resid)
        for site in ("q", "k", "v"):
            torch.testing.assert_close(cache[site, layer], plain[site, layer], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_editing_one_heads_input_changes_only_that_heads_projection(load, family):
    """For the projections that are linear maps of the normed stream (attn.linear_hooks; OLMoE norms its q and
    k over all heads together, so only its v qualifies)."""
    model = load(family)
    require_per_head_inputs(model)
    model.set_use_split_qkv_input(True)
    _, plain = plain_run(model)
    gen = torch.Generator().manual_seed(0)
    L = [l for l in attention_layers(model) if l > 0][0]
    for site in type(model.blocks[L].attn).linear_hooks:
        head = 1

        def nudge(x, hook):
            x[:, :, head] += torch.randn(x[:, :, head].shape, generator=gen)

        with torch.no_grad(), model.hooks(fwd_hooks=[(f"blocks.{L}.hook_{site}_input", nudge)]):
            _, cache = model.run_with_cache(TOKENS, names_filter=[f"blocks.{L}.attn.hook_{site}"])
        edited, before = cache[site, L], plain[site, L]
        assert not torch.allclose(edited[:, :, head], before[:, :, head]), site
        others = [h for h in range(edited.shape[2]) if h != head]
        assert torch.equal(edited[:, :, others], before[:, :, others]), site


def test_split_qkv_input_is_refused_for_latent_attention(load):
    model = load("deepseek_v3")
    with pytest.raises(ValueError, match=r"set_use_split_qkv_input: deepseek_v3's MultiHeadLatentAttention has no "
                                         r"per-head linear map.*ln1.hook_normalized.*hook_kv_latent"):
        model.set_use_split_qkv_input(True)
    assert not model.cfg.use_split_qkv_input and "blocks.0.hook_q_input" not in model.hook_dict


def test_split_qkv_input_with_the_kv_cache_generates_the_plain_tokens(load):
    model = load("mixtral")
    prompt = TOKENS[:1, :6]
    plain = model.generate(prompt, max_new_tokens=5, do_sample=False, stop_at_eos=False)
    model.set_use_split_qkv_input(True)
    model.set_use_attn_result(True)
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False, stop_at_eos=False), plain)


# ---- use_attn_in ----------------------------------------------------------------------------------------------
def test_attn_in_feeds_each_heads_q_k_and_v(load):
    model = load("qwen2_moe", "plain_attn")  # as many kv heads as query heads
    logits, plain = plain_run(model)
    model.set_use_attn_in(True)
    assert model.cfg.use_attn_in
    with torch.no_grad():
        out, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(out, logits, rtol=0, atol=ATOL)
    assert cache["blocks.0.hook_attn_in"].shape == (*TOKENS.shape, model.cfg.n_heads, model.cfg.d_model)

    def nudge(x, hook):
        x[:, :, 2] += 1.0

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.hook_attn_in", nudge)]):
        _, edited = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    for site in ("q", "k", "v"):
        assert not torch.allclose(edited[site, 0][:, :, 2], plain[site, 0][:, :, 2]), site
        assert torch.equal(edited[site, 0][:, :, [0, 1, 3]], plain[site, 0][:, :, [0, 1, 3]]), site


def test_attn_in_is_refused_with_grouped_kv_heads(load):
    """TL asserts "Can't use attn_in with GroupedQueryAttention, ...": an AssertionError with its message (and
    a ValueError), saying why and what to use."""
    model = load("qwen2_moe")  # 4 query heads over 2 kv heads
    said = r"^Can't use attn_in with GroupedQueryAttention, please use split_qkv_input instead: .*4 query heads over 2 kv heads"
    for kind in (AssertionError, ValueError):
        with pytest.raises(kind, match=said):
            model.set_use_attn_in(True)
    assert not model.cfg.use_attn_in


# ---- use_hook_mlp_in ------------------------------------------------------------------------------------------
def test_hook_mlp_in_is_what_the_mlp_reads_not_the_residual_add(load):
    model = load("qwen2_moe")
    logits, plain = plain_run(model)
    model.set_use_hook_mlp_in(True)
    assert model.cfg.use_hook_mlp_in
    with torch.no_grad():
        out, cache = model.run_with_cache(TOKENS)
    assert torch.equal(out, logits)
    assert torch.equal(cache["mlp_in", 0], plain["resid_mid", 0])

    def double(x, hook):
        return 2 * x

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.hook_mlp_in", double)]):
        _, edited = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("blocks.0."))
    assert not torch.allclose(edited["mlp_out", 0], plain["mlp_out", 0])
    assert torch.equal(edited["resid_mid", 0], plain["resid_mid", 0])
    torch.testing.assert_close(edited["resid_post", 0], plain["resid_mid", 0] + edited["mlp_out", 0], rtol=0, atol=0)
