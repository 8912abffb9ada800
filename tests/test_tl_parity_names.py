"""TransformerLens parity: get_act_name's rules, FactoredMatrix.svd's (U, S, V) and remove_batch_dim in place."""

import pytest
import torch

from moelens.factored_matrix import FactoredMatrix
from moelens.utils import get_act_name


# ---- get_act_name -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, expected",
    [
        # transformer_lens.utils.get_act_name's documented examples, verbatim
        (("k", 6, "a"), "blocks.6.attn.hook_k"),
        (("pre", 2), "blocks.2.mlp.hook_pre"),
        (("embed",), "hook_embed"),
        (("normalized", 27, "ln2"), "blocks.27.ln2.hook_normalized"),
        (("k6",), "blocks.6.attn.hook_k"),
        (("scale4ln1",), "blocks.4.ln1.hook_scale"),
        (("pre5",), "blocks.5.mlp.hook_pre"),
        (("scale", 4, "ln1"), "blocks.4.ln1.hook_scale"),
        (("pre", 5, "mlp"), "blocks.5.mlp.hook_pre"),
        (("pre", 5), "blocks.5.mlp.hook_pre"),
        # aliases
        (("attn", 0), "blocks.0.attn.hook_pattern"),
        (("attn_logits", 1), "blocks.1.attn.hook_attn_scores"),
        (("key", 2), "blocks.2.attn.hook_k"),
        (("query", 2), "blocks.2.attn.hook_q"),
        (("value", 2), "blocks.2.attn.hook_v"),
        (("mlp_pre", 3), "blocks.3.mlp.hook_pre"),
        (("mlp_post", 3), "blocks.3.mlp.hook_post"),
        (("mlp_mid", 3), "blocks.3.mlp.hook_mid"),
        # attention / MLP names choose their layer type whatever is given; layer-type letters
        (("z", 1, "m"), "blocks.1.attn.hook_z"),
        (("pattern", 1, "attention"), "blocks.1.attn.hook_pattern"),
        (("resid_post", 3, "b"), "blocks.3.hook_resid_post"),
        (("resid_mid", 3, "block"), "blocks.3.hook_resid_mid"),
        (("mlp_out", 3, "blocks"), "blocks.3.hook_mlp_out"),
        (("router_logits", 0, "m"), "blocks.0.mlp.hook_router_logits"),
        (("pre_linear", 1), "blocks.1.mlp.hook_pre_linear"),
        (("rot_q", 1), "blocks.1.attn.hook_rot_q"),
        (("result", 3), "blocks.3.attn.hook_result"),
        (("z0",), "blocks.0.attn.hook_z"),
        (("attn12",), "blocks.12.attn.hook_pattern"),
        (("normalized2ln2",), "blocks.2.ln2.hook_normalized"),
        # norm sites without a layer are ln_final's; the layer number is not checked
        (("scale",), "ln_final.hook_scale"),
        (("normalized",), "ln_final.hook_normalized"),
        (("resid_pre", 1000), "blocks.1000.hook_resid_pre"),
        (("resid_pre",), "hook_resid_pre"),
        # full names come back as they are
        (("blocks.3.hook_resid_pre",), "blocks.3.hook_resid_pre"),
        (("hook_logits",), "hook_logits"),
        (("logits",), "hook_logits"),
        # moelens's own names
        (("router_logits", 0), "blocks.0.mlp.hook_router_logits"),
        (("expert_post", 1), "blocks.1.mlp.experts.hook_post"),
        (("layer_output", 2), "blocks.2.hook_resid_post"),
    ],
)
def test_get_act_name_follows_transformer_lens(args, expected):
    assert get_act_name(*args) == expected


def test_get_act_name_former_mistakes():
    assert get_act_name("attn", 0) == "blocks.0.attn.hook_pattern"  # was 'attn'
    assert get_act_name("k6") == "blocks.6.attn.hook_k"  # was 'k6'
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"  # was 'blocks.6.a.hook_k'


@pytest.mark.parametrize(
    "args",
    [("foo", 1), ("foo",), ("foo3",), ("resid_pre", 3, "zz"), ("resid_pre", 1, "a"), ("router_logits",),
     ("attn_scores0",)],  # TL's compact form takes [a-z]+ names only
)
def test_get_act_name_refuses_what_names_no_hook(args):
    with pytest.raises(ValueError):
        get_act_name(*args)


# ---- FactoredMatrix.svd -----------------------------------------------------------------------------
@pytest.mark.parametrize("shapes", [((5, 3), (3, 4)), ((2, 6, 2), (2, 2, 6)), ((4, 4), (4, 4))])
def test_factored_svd_is_transformer_lens_u_s_v(shapes):
    g = torch.Generator().manual_seed(0)
    A = torch.randn(*shapes[0], generator=g, dtype=torch.float64)
    B = torch.randn(*shapes[1], generator=g, dtype=torch.float64)
    AB = torch.einsum("...ij,...jk->...ik", A, B)  # the dense product, by hand
    fm = FactoredMatrix(A, B)
    U, S, V = fm.svd()
    m, n = AB.shape[-2:]
    r = min(A.shape[-1], m, n)
    assert U.shape[-2:] == (m, r) and S.shape[-1] == r and V.shape[-2:] == (n, r)
    torch.testing.assert_close(U @ S.diag_embed() @ V.transpose(-2, -1), AB)  # TL: M = U diag(S) V^T
    torch.testing.assert_close(fm.U, U)
    torch.testing.assert_close(fm.S, S)
    torch.testing.assert_close(fm.V, V)
    with pytest.warns(DeprecationWarning):
        torch.testing.assert_close(fm.Vh, V)  # TL's Vh has always been V
    torch.testing.assert_close(S, torch.linalg.svdvals(AB)[..., :r])


# ---- remove_batch_dim -------------------------------------------------------------------------------
def test_remove_batch_dim_is_in_place(qwen_model, tokens):
    names = ["blocks.0.hook_resid_pre", "blocks.1.mlp.hook_router_logits"]
    _, cache = qwen_model.run_with_cache(tokens[:1], names_filter=names)
    before = {k: v.clone() for k, v in cache.items()}
    assert cache.has_batch_dim
    out = cache.remove_batch_dim()
    assert out is cache and not cache.has_batch_dim
    for key, value in before.items():
        assert cache.cache_dict[key].shape == value.shape[1:]
        torch.testing.assert_close(cache[key], value[0])
    assert cache.remove_batch_dim() is cache  # a second call changes nothing
    assert cache["resid_pre", 0].shape == before["blocks.0.hook_resid_pre"].shape[1:]

    _, direct = qwen_model.run_with_cache(tokens[:1], names_filter=["blocks.0.hook_resid_pre"], remove_batch_dim=True)
    assert not direct.has_batch_dim
    torch.testing.assert_close(direct["blocks.0.hook_resid_pre"], before["blocks.0.hook_resid_pre"][0])

    _, batched = qwen_model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_pre"])
    with pytest.raises(ValueError, match="batch of one"):
        batched.remove_batch_dim()
    assert batched.has_batch_dim and batched["blocks.0.hook_resid_pre"].shape[0] == tokens.shape[0]


# ---- padding: a list of texts through to_tokens and the forward -----------------------------------------
def test_to_tokens_pads_right_by_default_so_each_rows_logits_are_its_own():
    """TransformerLens's default: model(model.to_tokens([a, b])) gives each row the logits it gets alone."""
    from moelens import HookedTransformer

    model = HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)
    texts = ["The quick brown fox", "Hi"]
    tokens = model.to_tokens(texts)
    assert model.tokenizer.padding_side == "right" and tokens[1, -1] == model.tokenizer.pad_token_id
    logits = model(tokens)
    for row, text in enumerate(texts):
        alone = model(model.to_tokens(text))
        n = alone.shape[1]
        torch.testing.assert_close(logits[row, :n], alone[0], rtol=0, atol=1e-5)


def test_left_padding_side_makes_the_forward_infer_the_mask():
    from moelens import HookedTransformer

    model = HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)
    model.tokenizer.padding_side = "left"
    try:
        texts = ["The quick brown fox", "Hi"]
        tokens = model.to_tokens(texts)
        assert tokens[1, 0] == model.tokenizer.pad_token_id
        logits = model(tokens)
        alone = model(model.to_tokens(texts[1]))
        torch.testing.assert_close(logits[1, -alone.shape[1]:], alone[0], rtol=0, atol=1e-5)
        explicit = model(*model.tokenize(texts)[:1], attention_mask=model.tokenize(texts)[1])
        assert torch.equal(logits, explicit)
    finally:
        model.tokenizer.padding_side = "right"
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        model.to_tokens(texts, padding_side="middle")


def test_config_answers_to_transformer_lens_names(qwen_model):
    cfg = qwen_model.cfg
    assert (cfg.n_ctx, cfg.n_key_value_heads) == (256, 2)  # the tiny checkpoint's max_position_embeddings, kv heads
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_vocab) == (64, 3, 4, 16, 96)
    assert (cfg.normalization_type, cfg.positional_embedding_type, cfg.act_fn) == ("RMS", "rotary", "silu")


def test_generate_on_a_right_padded_batch_warns_and_left_padding_is_masked():
    """generate continues each row from its last position: a to_tokens batch (right-padded) is flagged, not
    silently continued from pads; with the tokenizer padding on the left the pads are masked as in forward."""
    from moelens import HookedTransformer

    model = HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)
    texts = ["The quick brown fox", "Hi"]
    with pytest.warns(UserWarning, match=r"rows \[1\] end with the pad token"):
        model.generate(model.to_tokens(texts), max_new_tokens=2, do_sample=False)
    model.tokenizer.padding_side = "left"
    try:
        out = model.generate(model.to_tokens(texts), max_new_tokens=3, do_sample=False)
    finally:
        model.tokenizer.padding_side = "right"
    assert torch.equal(out, model.generate(*model.tokenize(texts)[:1], attention_mask=model.tokenize(texts)[1], max_new_tokens=3, do_sample=False))
