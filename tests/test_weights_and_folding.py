"""Weight views (W_Q ... W_out), FactoredMatrix, and from_pretrained(fold_ln=..., center_unembed=...).

Weight views are checked by reproducing the model's own hook tensors from the cached inputs; folding by
comparing logits (and routing) with the unprocessed model.
"""

import pytest
import torch
from conftest import (FAMILIES, LAYER_NORM_FAMILIES, SOFTCAPPED_LOGITS_FAMILIES, as_added, attention_layers, fold_ln_refused, has_shared_expert,
                      decomposition_refused, families_applying_norms, norm_factor, refused_for, routable_experts, uncapped,
                      shared_expert_gated, sublayer_input)

from moelens import HookedTransformer
from moelens.factored_matrix import FactoredMatrix
from moelens.fold import fold_ln_refusal

ATOL = 1e-5


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def runs(family_models, toks):
    with torch.no_grad():
        return {f: (m, *m.run_with_cache(toks)) for f, m in family_models.items()}


def require_foldable(path, model: HookedTransformer) -> None:
    """Skips where the model says fold_ln cannot fold it (moelens.fold.fold_ln_refusal: LongCat-Flash's identity
    experts output the normed stream itself), after checking that loading with fold_ln=True refuses, saying so."""
    refusal = fold_ln_refusal(model)
    if refusal is not None:
        with pytest.raises(ValueError, match="^fold_ln cannot fold"):
            HookedTransformer.from_pretrained(path, progress=False, fold_ln=True)
        pytest.skip(refusal)


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max error {err:.3g} > {atol}"


# ---- views ------------------------------------------------------------------------------------------
def attention_view(model, name, shape):
    """model.<name> as {layer: tensor}: a stack [n_layers, *shape] where every block is softmax attention; on a
    hybrid a dict over the attention blocks (a stack of those alone would renumber them), whose other indices
    are refused naming what those blocks are."""
    view, layers = getattr(model, name), attention_layers(model)
    if len(layers) == model.cfg.n_layers:
        assert view.shape == (len(layers), *shape), name
        return dict(enumerate(view))
    assert isinstance(view, dict) and sorted(view) == layers, name
    assert all(v.shape == shape for v in view.values()), name
    other = next(l for l in range(model.cfg.n_layers) if l not in layers)
    with pytest.raises(KeyError, match=rf"{name}\[{other}\]: .*softmax-attention layer.*linear-attention"):
        view[other]
    with pytest.raises(AttributeError, match="index it by block"):
        view.shape
    return view


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_views_reproduce_hooks(runs, toks, family):
    model, logits, cache = runs[family]
    cfg = model.cfg
    H, M = cfg.n_heads, cfg.d_model
    layers = attention_layers(model)
    attn = model.blocks[layers[0]].attn
    with torch.no_grad():
        D_v = cache["z", layers[0]].shape[-1]  # each head's value width (MLA's v_head_dim)
        W_O, b_O = attention_view(model, "W_O", (H, D_v, M)), attention_view(model, "b_O", (M,))
        for l in layers:
            out = torch.einsum("bphd,hdm->bpm", cache["z", l], W_O[l]) + b_O[l]
            close(as_added(model, l, "mixer", out), cache["attn_out", l])
        if not attn.per_head_projections:  # MLA: keys and values come out of a normed latent
            for view in ("W_Q", "W_K", "W_V", "b_Q"):
                with pytest.raises(ValueError, match="latent"):
                    getattr(model, view)
        else:
            check_qkv_views(model, cache, attn)
        close(model.W_E[toks], cache["hook_embed"], 0)
        unembedded = cache["ln_final.hook_normalized"] @ model.W_U + model.b_U  # b_U: Phi-3.5-MoE's head bias
        cap = model.unembed.softcap  # Beam's logits: the map's output softcapped, cap * tanh(x / cap)
        close(unembedded if cap is None else cap * torch.tanh(unembedded / cap), logits)
        # the token direction is TransformerLens's W_U column: the final norm's output . direction (+ b_U) is the logit
        close(model.tokens_to_residual_directions(toks), model.W_U.T[toks], 0)
        if family in LAYER_NORM_FAMILIES:  # a LayerNorm centres (and may add a bias): its output as cached
            normed = cache["ln_final.hook_normalized"]
        else:
            normed = cache["resid_post", -1] / cache["ln_final.hook_scale"] * norm_factor(model.ln_final)
        direct = (normed * model.tokens_to_residual_directions(toks)).sum(-1) + model.b_U[toks]
        close(direct, uncapped(model, logits).gather(-1, toks[..., None])[..., 0])  # the attribution is before a cap



def check_qkv_views(model, cache, attn):
    """x @ W + b of ln1's output gives the hooks that are linear projections (attn.linear_hooks)."""
    cfg = model.cfg
    H, D, M = cfg.n_heads, cfg.d_head, cfg.d_model
    layers = attention_layers(model)
    # each layer's kv heads, and the heads' value width, as its hooks hold them (MiMo-V2-Flash's kv heads differ
    # by layer type, its values are narrower than its keys)
    G = {l: cache["k", l].shape[2] for l in layers}
    D_v = cache["v", layers[0]].shape[-1]
    W_Q, W_K = (attention_view(model, name, (H, M, D)) for name in ("W_Q", "W_K"))
    W_V = attention_view(model, "W_V", (H, M, D_v))
    W_K_grouped = grouped_view(model, "W_K_grouped", {l: (G[l], M, D) for l in layers})
    grouped_view(model, "W_V_grouped", {l: (G[l], M, D_v) for l in layers})
    b_Q, b_K = (attention_view(model, name, (H, D)) for name in ("b_Q", "b_K"))
    b_V = attention_view(model, "b_V", (H, D_v))
    for l in layers:
        x = sublayer_input(model, cache, l, "mixer")
        group = H // G[l]
        if "q" in attn.linear_hooks:
            close(torch.einsum("bpm,hmd->bphd", x, W_Q[l]) + b_Q[l], cache["q", l])
        if "k" in attn.linear_hooks:
            k = torch.einsum("bpm,gmd->bpgd", x, W_K_grouped[l])
            close(k + b_K[l][::group], cache["k", l])
            # the repeated view: query head h uses kv head h // (H / G)
            close(torch.einsum("bpm,hmd->bphd", x, W_K[l]) + b_K[l], cache["k", l].repeat_interleave(group, dim=2))
        v = torch.einsum("bpm,hmd->bphd", x, W_V[l]) + b_V[l]
        if "v" not in attn.linear_hooks:  # DBRX's clip_qkv: the values are the projection clamped
            v = v.clamp(-attn.clip_qkv, attn.clip_qkv)
        close(v, cache["v", l].repeat_interleave(group, dim=2))


def grouped_view(model, name, shapes):
    """A grouped view (W_K_grouped, W_V_grouped) given each attention layer's shape: attention_view where they
    all share one; else {layer: tensor}, each of its layer's shape (a stack needs one)."""
    if len(set(shapes.values())) == 1:
        return attention_view(model, name, next(iter(shapes.values())))
    view = getattr(model, name)
    assert isinstance(view, dict) and {l: tuple(t.shape) for l, t in view.items()} == shapes, name
    with pytest.raises(AttributeError, match="index it by block"):
        view.shape
    return view


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_views_reproduce_hooks(runs, family):
    model, _, cache = runs[family]
    cfg = model.cfg
    if not cfg.expert_spec().activation.gated:
        pytest.skip("ungated experts (Nemotron-H): W_gate is refused and W_in is the up stack; "
                    "test_family_nemotron_h.py::test_ungated_expert_views_reproduce_the_hooks")
    L, E, M, I, S = cfg.n_layers, cfg.n_experts, cfg.d_model, cfg.d_expert, cfg.d_shared
    layers = cfg.moe_layer_indices
    if cfg.dense_layer_indices:
        # a stack of the mixture layers alone would renumber them: {block index: tensor} for the mixtures
        assert isinstance(model.W_gate, dict) and sorted(model.W_gate) == layers
        with pytest.raises(KeyError, match="dense MLP"):
            model.W_gate[cfg.dense_layer_indices[0]]
        assert model.W_gate[-1] is not None and torch.equal(model.W_gate[-1], model.W_gate[L - 1])

    def shape(view) -> tuple[int, ...]:
        """A stack's shape, or for a per-mixture-layer dict (blocks, *each tensor's shape)."""
        if isinstance(view, torch.Tensor):
            return tuple(view.shape)
        shapes = {tuple(t.shape) for t in view.values()}
        assert len(shapes) == 1, shapes
        return (L, *shapes.pop())

    with torch.no_grad():
        W_gate, W_in, W_out = model.W_gate, model.W_in, model.W_out
        R = routable_experts(model)  # the router's rows: the real experts', then the identity experts'
        assert shape(model.W_router) == (L, R, M)
        assert shape(W_gate) == shape(W_in) == (L, E, M, I) and shape(W_out) == (L, E, I, M)
        shared = has_shared_expert(model)
        if shared:
            assert shape(model.W_shared_gate) == shape(model.W_shared_in) == (L, M, S) and shape(model.W_shared_out) == (L, S, M)
        else:
            with pytest.raises(ValueError, match="no shared expert"):
                model.W_shared_out
        # biases where the model has them (gpt-oss), zeros otherwise; the views raise where there are none
        if model.blocks[layers[0]].mlp.experts.spec.bias:
            b_gate, b_in, b_out = model.b_gate, model.b_in, model.b_out
            assert shape(b_gate) == shape(b_in) == (L, E, I) and shape(b_out) == (L, E, M)
        else:
            for view in ("b_gate", "b_in", "b_out"):
                with pytest.raises(ValueError, match="no biases"):
                    getattr(model, view)
            b_gate = b_in = model.W_E.new_zeros(L, E, I)
            b_out = model.W_E.new_zeros(L, E, M)
        if getattr(model.blocks[layers[0]].mlp.router, "bias", None) is not None:
            b_router = model.b_router
            assert shape(b_router) == (L, R)
        else:
            with pytest.raises(ValueError, match="no bias"):
                model.b_router
            b_router = model.W_E.new_zeros(L, R)
        for l in layers:
            x = sublayer_input(model, cache, l, "ffn")
            close(x.float() @ model.W_router[l].float().T + b_router[l].float(), cache["router_logits", l])
            idx = cache["expert_indices", l]  # [b p k]: each slot through its expert's matrices
            # a slot routed to an identity expert computes nothing: its hooks hold zeros, its output weight * x
            identity = idx >= E
            idx = idx.clamp(max=E - 1)
            w = cache["expert_weights", l][..., None]
            # where the routing weight scales the expert's input (Llama 4), each slot reads x * weight
            on_input = model.blocks[l].mlp.experts.spec.weight_at == "input"
            xs = x[:, :, None, :] * w if on_input else x[:, :, None, :].expand(-1, -1, idx.shape[-1], -1)
            pre = torch.einsum("bpkm,bpkmi->bpki", xs, W_gate[l][idx]) + b_gate[l][idx]
            close(pre.masked_fill(identity[..., None], 0), cache["blocks.%d.mlp.experts.hook_pre" % l])
            pre_linear = torch.einsum("bpkm,bpkmi->bpki", xs, W_in[l][idx]) + b_in[l][idx]
            close(pre_linear.masked_fill(identity[..., None], 0), cache["blocks.%d.mlp.experts.hook_pre_linear" % l])
            post = cache["blocks.%d.mlp.experts.hook_post" % l]
            out = torch.einsum("bpki,bpkim->bpkm", post, W_out[l][idx]) + b_out[l][idx]
            out = torch.where(identity[..., None], x[:, :, None, :], out)
            close(out if on_input else out * w, cache["expert_outputs", l])
            if not shared:
                continue
            sh = "blocks.%d.mlp.shared_expert." % l
            close(x @ model.W_shared_gate[l], cache[sh + "hook_pre"])
            close(x @ model.W_shared_in[l], cache[sh + "hook_pre_linear"])
            close(cache[sh + "hook_post"] @ model.W_shared_out[l], cache[sh + "hook_out"])
            if shared_expert_gated(model, l):
                close(x @ model.W_shared_sigmoid_gate[l], cache["shared_gate", l][..., 0])
        if not shared_expert_gated(model):
            with pytest.raises(ValueError, match="not gated"):
                model.W_shared_sigmoid_gate


def test_views_are_live_and_differentiable(checkpoints):
    model = HookedTransformer.from_pretrained(checkpoints["solar_open", "base"], progress=False)
    with torch.no_grad():
        model.blocks[1].attn.q_proj.weight[5, 7] = 3.0  # row 5 = head 0, dim 5; column 7 = d_model 7
        model.blocks[2].mlp.experts.W_down[4, 9, 2] = -2.0
    assert model.W_Q[1, 0, 7, 5] == 3.0 and model.W_out[2, 4, 2, 9] == -2.0
    assert model.OV.AB.requires_grad
    model.W_O[0, 1].sum().backward()
    grad = model.blocks[0].attn.o_proj.weight.grad
    d = model.cfg.d_head
    assert (grad[:, d : 2 * d] == 1).all() and (grad[:, :d] == 0).all()


def test_mixture_views_of_a_model_with_a_dense_middle_block_keep_block_numbers(checkpoints):
    """A dense block between mixtures (block 1): the mixture views are keyed by block, never renumbered."""
    model = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "dense_block"], progress=False)
    assert model.W_Q.shape[0] == 3
    for name in ("W_router", "W_gate", "W_out", "W_shared_in"):
        view = getattr(model, name)
        assert sorted(view) == [0, 2], name
        with pytest.raises(KeyError, match=r"block 1 is a dense MLP"):
            view[1]
    with torch.no_grad():
        assert torch.equal(model.W_router[2], model.blocks[2].mlp.router.weight)
        assert torch.equal(model.W_router[-1], model.blocks[2].mlp.router.weight)


def test_factored_matrix(family_models):
    model = family_models["qwen2_moe"]
    with torch.no_grad():
        OV, QK = model.OV, model.QK
        cfg = model.cfg
        assert OV.shape == QK.shape == (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_model)
        close(OV.AB, torch.einsum("lhmd,lhdn->lhmn", model.W_V, model.W_O))
        close(QK[1, 2].AB, model.W_Q[1, 2] @ model.W_K[1, 2].T)
        U, S, V = OV.svd()  # TransformerLens's convention: AB = U diag(S) V^T
        assert S.shape == (cfg.n_layers, cfg.n_heads, cfg.d_head)
        assert U.shape == V.shape == (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head)
        close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), OV.AB)
        close(OV.norm(), torch.linalg.matrix_norm(OV.AB))
        close(S, torch.linalg.svdvals(OV.AB)[..., : cfg.d_head], 1e-4)
        # BA is d_head x d_head with the eigenvalues of AB that are not zero
        ba = torch.linalg.eigvals(OV[0, 0].BA).abs().sort().values
        ab = torch.linalg.eigvals(OV[0, 0].AB).abs().sort().values[-cfg.d_head :]
        close(ba, ab, 1e-4)
        close((OV[0, 0] @ OV[1, 0]).AB, OV[0, 0].AB @ OV[1, 0].AB, 1e-4)
        close(OV[0, 0].T.AB, OV[0, 0].AB.T)
        close(OV[0, 0, 3].AB, OV[0, 0].AB[3:4])  # as TransformerLens: past the leading axes, rows of AB
        with pytest.raises(IndexError):
            OV[0, 0, 0, 0, 0]
        with pytest.raises(ValueError):
            FactoredMatrix(torch.ones(3, 2), torch.ones(3, 2))


# ---- folding ----------------------------------------------------------------------------------------
FOLD_CASES = [(f, "base") for f in FAMILIES] + [("qwen2_moe", "dense_block"), ("hunyuan_v1_moe", "untied_biased")]


@pytest.mark.parametrize("key", FOLD_CASES, ids=lambda key: f"{key[0]}-{key[1]}")
def test_fold_ln_keeps_logits(checkpoints, toks, key):
    ref = HookedTransformer.from_pretrained(checkpoints[key], progress=False)
    require_foldable(checkpoints[key], ref)
    folded = HookedTransformer.from_pretrained(checkpoints[key], progress=False, fold_ln=True)
    with torch.no_grad():
        ref_logits, ref_cache = ref.run_with_cache(toks, names_filter="*expert_indices")
        logits, cache = folded.run_with_cache(toks, names_filter="*expert_indices")
    tol = ATOL
    if any(b.token_mixer is not None and not b.has_attention for b in ref.blocks):
        # linear-attention layers amplify float32 rounding (folding moves it: 4e-5 on the tiny Qwen3-Next): within
        # twice the model's own float32 rounding, measured against its float64 run
        exact = HookedTransformer.from_pretrained(checkpoints[key], progress=False, dtype=torch.float64)
        with torch.no_grad():
            tol = max(ATOL, 2 * (exact(toks).float() - ref_logits).abs().max().item())
    close(logits, ref_logits, tol)
    for name, indices in ref_cache.items():  # the same experts chosen
        assert torch.equal(cache[name], indices), name
    # every norm that reads the stream (a sublayer reading it unnormed has none) ...
    norms = [folded.ln_final] + [sub.norm for b in folded.blocks for sub in b.sublayers() if sub.norm is not None]
    assert all((norm_factor(n) == 1).all() for n in norms)  # (a zero-centred norm's weight is 0 then)
    # ... but a norm of a sublayer's output (a post-norm block's) folds into nothing: kept as it is
    for b, r in zip(folded.blocks, ref.blocks):
        for kind in ("mixer", "ffn"):
            if r.post_norm(kind) is not None:
                close(b.post_norm(kind).weight, r.post_norm(kind).weight.detach(), 0)
    close(folded.W_E, ref.W_E, 0)  # a tied embedding is untied, not scaled
    assert folded.unembed.weight is not folded.embed.weight and not folded.cfg.tie_word_embeddings
    close(folded.W_U, ref.W_U * norm_factor(ref.ln_final)[:, None])
    if folded.cfg.family == "hunyuan_v1_moe":  # per-head q/k norms come after the rotary: kept as they are
        close(folded.blocks[0].attn.q_norm.weight, ref.blocks[0].attn.q_norm.weight.detach(), 0)
    if folded.cfg.family in ("hunyuan_v1_moe", "solar_open"):  # float32 routers stay float32
        assert all(b.mlp.router.weight.dtype == torch.float32 for b in folded.blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_fold_ln_in_bfloat16_keeps_dtypes(checkpoints, toks, family):
    path = checkpoints[family, "base"]
    ref = HookedTransformer.from_pretrained(path, progress=False, dtype=torch.bfloat16)
    require_foldable(path, ref)
    folded = HookedTransformer.from_pretrained(path, progress=False, dtype=torch.bfloat16, fold_ln=True)
    for (name, p), q in zip(ref.named_parameters(), folded.parameters()):
        assert p.dtype == q.dtype, name
    if family in ("hunyuan_v1_moe", "solar_open"):  # their routers stay float32, folded in float32
        assert folded.blocks[0].mlp.router.weight.dtype == torch.float32
    # bfloat16 rounds the folded products: folding must not move the output more than bfloat16 itself does
    with torch.no_grad():
        exact = HookedTransformer.from_pretrained(path, progress=False)(toks).softmax(-1)
        err_ref = (ref(toks).float().softmax(-1) - exact).abs().mean()
        err_folded = (folded(toks).float().softmax(-1) - exact).abs().mean()
    assert err_folded < max(2 * err_ref, 5e-4), (err_folded, err_ref)


@pytest.mark.parametrize("family", refused_for(fold_ln_refused(FAMILIES), SOFTCAPPED_LOGITS_FAMILIES, "softcapped logits"))
def test_center_unembed(checkpoints, toks, family):
    ref = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False)
    centered = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, center_unembed=True)
    assert centered.W_U.mean(-1).abs().max() < 1e-6
    close(centered.W_E, ref.W_E, 0)
    with torch.no_grad():
        ref_logits, logits = ref(toks), centered(toks)
    shift = logits - ref_logits  # one constant per position
    close(shift, shift[..., :1].expand_as(shift))
    close(logits.log_softmax(-1), ref_logits.log_softmax(-1))
    require_foldable(checkpoints[family, "base"], ref)
    both = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, fold_ln=True, center_unembed=True)
    with torch.no_grad():
        close(both(toks).softmax(-1), ref_logits.softmax(-1))


def test_process_weights_in_place_is_the_folding_written_out(checkpoints, toks):
    """Oracle by hand on the unprocessed weights: each reader's input axis times its norm's weight, norms set
    to 1, the unembedding scaled by ln_final's weight and then centred over the vocabulary."""
    path = checkpoints["hunyuan_v1_moe", "base"]
    ref = HookedTransformer.from_pretrained(path, progress=False)
    model = HookedTransformer.from_pretrained(path, progress=False)
    model.process_weights_(fold_ln=True, center_unembed=True)
    with torch.no_grad():
        for b, r in zip(model.blocks, ref.blocks):
            w1, w2 = r.ln1.weight, r.ln2.weight
            for proj in ("q_proj", "k_proj", "v_proj"):
                close(getattr(b.attn, proj).weight, getattr(r.attn, proj).weight * w1, 0)
            close(b.mlp.router.weight, r.mlp.router.weight * w2, 0)
            close(b.mlp.experts.W_gate_up, r.mlp.experts.W_gate_up * w2, 0)
            close(b.mlp.shared_expert.gate_proj.weight, r.mlp.shared_expert.gate_proj.weight * w2, 0)
            close(b.mlp.shared_expert.up_proj.weight, r.mlp.shared_expert.up_proj.weight * w2, 0)
            assert (b.ln1.weight == 1).all() and (b.ln2.weight == 1).all()
        scaled = ref.unembed.weight * ref.ln_final.weight
        close(model.unembed.weight, scaled - scaled.mean(0, keepdim=True), 1e-6)
        close(model.embed.weight, ref.embed.weight, 0)  # the tied embedding is untied, not changed
        close(model(toks).softmax(-1), ref(toks).softmax(-1))


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))  # DBRX folds, but its LayerNorms centre: refused
def test_folded_model_logit_attribution(checkpoints, family_models, toks, family):
    """After fold_ln the norm weights are 1: the direct logit attribution is the same as before folding."""
    require_foldable(checkpoints[family, "base"], family_models[family])
    model = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, fold_ln=True)
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
    stack = cache.get_full_resid_decomposition(apply_ln=True, return_labels=False)
    W_U_cols = model.W_U[:, toks].permute(1, 2, 0)  # TransformerLens's plain W_U direction
    close((stack * W_U_cols).sum(-1).sum(0), logits.gather(-1, toks[..., None])[..., 0])


def count_routing_changes(ref, folded, tokens):
    """By hand: tokens whose set of chosen experts differs between two models, per mixture layer."""
    with torch.no_grad():
        _, a = ref.run_with_cache(tokens, names_filter="*expert_indices")
        _, b = folded.run_with_cache(tokens, names_filter="*expert_indices")
    return {
        int(name.split(".")[1]): int((a[name].sort(-1).values != b[name].sort(-1).values).any(-1).sum())
        for name in a.keys()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fold_ln_reports_how_often_routing_changed(checkpoints, dtype):
    """Routing is discontinuous, so folding can flip near-tied choices: from_pretrained(fold_ln=True) counts
    them on its probe batch, and warns when there are any (bfloat16 re-rounds Qwen's bf16 router: there are)."""
    import warnings

    from moelens.fold import probe_tokens

    path = checkpoints["qwen2_moe", "base"]
    ref = HookedTransformer.from_pretrained(path, progress=False, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folded = HookedTransformer.from_pretrained(path, progress=False, dtype=dtype, fold_ln=True)
    probe = probe_tokens(ref)
    expected = count_routing_changes(ref, folded, probe)
    report = folded.routing_changes
    assert report.per_layer == expected and report.probe_tokens == probe.numel()
    warned = [w for w in caught if "fold_ln: routing changed" in str(w.message)]
    if dtype == torch.bfloat16:
        assert report.total > 0 and len(warned) == 1 and f"for {report.total} of" in str(warned[0].message)
    else:
        assert report.total == 0 and warned == []


@pytest.mark.parametrize("family", FAMILIES)
def test_block_attention_views_are_transformer_lens_s(runs, family):
    """model.blocks[L].attn.W_Q and friends, TransformerLens's primary names: [n_heads d_model d_head] etc.,
    the same as model.W_Q[L], and reproducing the block's own hooks."""
    model, _, cache = runs[family]
    cfg = model.cfg
    H, D, M = cfg.n_heads, cfg.d_head, cfg.d_model
    with torch.no_grad():
        for l in attention_layers(model):
            attn = model.blocks[l].attn
            assert torch.equal(attn.W_O, model.W_O[l]) and torch.equal(attn.b_O, model.b_O[l])
            out = torch.einsum("bphd,hdm->bpm", cache["z", l], attn.W_O) + attn.b_O
            close(as_added(model, l, "mixer", out), cache["attn_out", l])
            if not attn.per_head_projections:
                for view in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_K_grouped"):
                    with pytest.raises(ValueError, match=rf"{view}: .*latent"):
                        getattr(attn, view)
                continue
            D_v = cache["v", l].shape[-1]  # each head's value width (narrower than d_head in MiMo-V2-Flash)
            assert attn.W_Q.shape == attn.W_K.shape == (H, M, D) and attn.W_V.shape == (H, M, D_v)
            assert attn.b_Q.shape == attn.b_K.shape == (H, D) and attn.b_V.shape == (H, D_v)
            for view in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_K_grouped", "W_V_grouped"):
                assert torch.equal(getattr(attn, view), getattr(model, view)[l]), view
            # W_Q is a view of q_proj: TL code editing it in place edits the model
            assert attn.W_Q.data_ptr() == attn.q_proj.weight.data_ptr()
            x = sublayer_input(model, cache, l, "mixer")
            if "q" in attn.linear_hooks:
                close(torch.einsum("bpm,hmd->bphd", x, attn.W_Q) + attn.b_Q, cache["q", l])
