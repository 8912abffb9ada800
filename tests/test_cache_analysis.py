"""ActivationCache analyses: residual stacks, head results, the full decomposition with experts, logit attribution.

Each check is against something computed another way: cached streams, the model's own logits, or a loop.
"""

import pytest
import torch
from conftest import (FAMILIES, attentions, decomposition_refused, families_applying_norms, ffn_stream, has_shared_expert, mixer_labels,
                      norm_factor, routable_experts, stream_factor, sublayer_input)

from moelens import HookedTransformer
from moelens.cache_analysis import MissingHooksError

ATOL = 1e-5


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def runs(family_models, toks):
    """family -> (model, logits, cache) of one run over toks."""
    out = {}
    with torch.no_grad():
        for family, model in family_models.items():
            logits, cache = model.run_with_cache(toks)
            out[family] = (model, logits, cache)
    return out


@pytest.fixture(scope="module")
def variant_runs(checkpoints, toks):
    """Qwen2-MoE with a dense block and Hunyuan with an o_proj bias."""
    out = {}
    for key in [("qwen2_moe", "dense_block"), ("hunyuan_v1_moe", "untied_biased")]:
        model = HookedTransformer.from_pretrained(checkpoints[key], progress=False)
        with torch.no_grad():
            logits, cache = model.run_with_cache(toks)
        out[key] = (model, logits, cache)
    return out


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max error {err:.3g} > {atol}"


def expected_labels(model, expand=False):
    """TransformerLens's order: every head (a headless token mixer's whole output), then each block's MLP part,
    then embed, then the summed bias."""
    return decomposition_labels(model, model.cfg.n_layers, expand)


def decomposition_labels(model, layer, expand=False, mlp_input=False):
    """The labels of the decomposition of the stream entering `layer` (with mlp_input: entering its ffn)."""
    cfg = model.cfg
    labels = [label for l in range(layer) for label in mixer_labels(model, l)]
    labels += mixer_labels(model, layer, before_ffn=True) if mlp_input else []
    for l, block in enumerate(model.blocks[:layer]):
        for sub in block.sublayers():
            if sub.kind != "ffn":
                continue
            if not hasattr(sub.module, "experts"):  # a dense MLP (a block's mlp, or another dense sublayer)
                neurons = f"L{l}" if sub.name == "mlp" else f"L{l}.{sub.name}."
                labels += [f"{neurons}N{i}" for i in range(cfg.d_mlp)] if expand else [f"{l}_{sub.name}_out"]
                continue
            if has_shared_expert(model, l):
                labels += [f"L{l}.shared.N{i}" for i in range(cfg.d_shared)] if expand else [f"L{l}.shared"]
            if expand:
                labels += [f"L{l}.E{e}.N{i}" for e in range(cfg.n_experts) for i in range(cfg.d_expert)]
                if block.mlp.experts.spec.bias:  # each expert's output bias, weighted as its slots
                    labels += [f"L{l}.E{e}.bias" for e in range(cfg.n_experts)]
                # an identity expert has no neurons: its whole output (weight * input)
                labels += [f"L{l}.E{e}" for e in range(cfg.n_experts, routable_experts(model))]
            else:
                labels += [f"L{l}.E{e}" for e in range(routable_experts(model))]
    return labels + ["embed", "bias"]


# ---- the full decomposition --------------------------------------------------------------------------
@pytest.mark.parametrize("family", decomposition_refused(FAMILIES))
def test_full_decomposition_sums_to_final_stream(runs, family):
    model, _, cache = runs[family]
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    assert labels == expected_labels(model)
    assert stack.shape == (len(labels), *cache["resid_post", -1].shape)
    close(stack.sum(0), cache["resid_post", -1])
    comp = dict(zip(labels, stack))
    close(comp["embed"], cache["hook_embed"], 0)
    for l in range(model.cfg.n_layers):
        if not model.blocks[l].is_moe:
            continue
        experts = torch.stack([comp[f"L{l}.E{e}"] for e in range(routable_experts(model))])
        # each part as the stream receives it: the residual multiplier (Granite's), a post-norm's frozen factor
        factor = stream_factor(model, cache, l, "ffn")
        close(experts.sum(0), cache["routed_out", l] * factor)
        if has_shared_expert(model, l):
            close(comp[f"L{l}.shared"], cache["shared_out", l] * factor, 0)
        # an expert (identity experts too) contributes only where the token chose it, and then exactly its slots' sum
        indices, outputs = cache["expert_indices", l], cache["expert_outputs", l]
        for e in range(routable_experts(model)):
            chosen = indices == e  # [batch pos k]
            expected = (outputs * chosen[..., None]).sum(-2) * factor
            close(experts[e], expected)
            assert (experts[e][~chosen.any(-1)] == 0).all()


@pytest.mark.parametrize("family", decomposition_refused(FAMILIES))
def test_full_decomposition_expanded_into_neurons(runs, family):
    model, _, cache = runs[family]
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)  # expand_neurons=True: TL's default
    assert labels == expected_labels(model, expand=True)
    close(stack.sum(0), cache["resid_post", -1])
    # each expert's neurons add up to that expert's part of the unexpanded decomposition
    coarse = dict(zip(*cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)[::-1]))
    index = {lab: i for i, lab in enumerate(labels)}
    for l in model.cfg.moe_layer_indices:
        experts = model.blocks[l].mlp.experts
        for e in (0, model.cfg.n_experts - 1):
            rows = [index[f"L{l}.E{e}.N{i}"] for i in range(model.cfg.d_expert)]
            if experts.spec.bias:  # the output bias, times the weight of each slot routed to e
                indices, weights = cache["expert_indices", l], cache["expert_weights", l]
                chosen = (indices == e).to(weights.dtype)
                bias = (weights * chosen).sum(-1)[..., None] * experts.tensors().down_bias[e].detach()
                bias = bias * stream_factor(model, cache, l, "ffn")
                close(stack[index[f"L{l}.E{e}.bias"]], bias)
                rows.append(index[f"L{l}.E{e}.bias"])
            close(stack[rows].sum(0), coarse[f"L{l}.E{e}"])
        for e in range(model.cfg.n_experts, routable_experts(model)):  # an identity expert: weight * its input
            chosen = cache["expert_indices", l] == e
            weight = (cache["expert_weights", l] * chosen).sum(-1, keepdim=True)
            close(stack[index[f"L{l}.E{e}"]], weight * cache[f"blocks.{l}.ln2.hook_normalized"])
        if has_shared_expert(model, l):
            rows = [index[f"L{l}.shared.N{i}"] for i in range(model.cfg.d_shared)]
            close(stack[rows].sum(0), coarse[f"L{l}.shared"])


@pytest.mark.parametrize("key", [("qwen2_moe", "dense_block"), ("hunyuan_v1_moe", "untied_biased")])
@pytest.mark.parametrize("expand", [False, True])
def test_full_decomposition_dense_block_and_o_bias(variant_runs, key, expand):
    model, _, cache = variant_runs[key]
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
    assert labels == expected_labels(model, expand)
    if key[1] == "dense_block":
        assert ("L1N0" if expand else "1_mlp_out") in labels and "L1.E0" not in labels
        assert (stack[labels.index("bias")] == 0).all()  # no block has an o_proj bias
    else:  # TransformerLens's one "bias" row: every block's o_proj bias, summed
        summed = sum(b.attn.o_proj.bias.detach() for b in model.blocks)
        close(stack[labels.index("bias")][0, 0], summed)
    close(stack.sum(0), cache["resid_post", -1])


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_full_decomposition_at_a_layer_with_pos_slice_and_ln(runs, family):
    model, _, cache = runs[family]
    stack, labels = cache.get_full_resid_decomposition(layer=2, expand_neurons=False, return_labels=True)
    assert labels == decomposition_labels(model, 2) and not set(mixer_labels(model, 2)) & set(labels)
    close(stack.sum(0), cache["resid_pre", 2])
    L = next(l for l in range(2, model.cfg.n_layers) if model.blocks[l].has_ffn)  # a block with a feed-forward
    stack, labels = cache.get_full_resid_decomposition(layer=L, mlp_input=True, expand_neurons=False, return_labels=True)
    assert labels == decomposition_labels(model, L, mlp_input=True) and f"L{L}.E0" not in labels
    # the stream the ffn reads: resid_mid, or resid_pre in a block whose only sublayer is the ffn
    close(stack.sum(0), cache[ffn_stream(model.blocks[L]), L])
    # an int pos_slice drops the pos axis; apply_ln applies ln2: its cached scale and its weight (nothing where
    # the feed-forward reads the stream unnormed: a post-norm block)
    stack = cache.get_full_resid_decomposition(layer=1, mlp_input=True, pos_slice=-1, apply_ln=True, return_labels=False)
    assert stack.shape[1:] == (2, model.cfg.d_model)
    close(stack.sum(0), sublayer_input(model, cache, 1, "ffn")[:, -1])
    stack = cache.get_full_resid_decomposition(pos_slice=slice(3, 7), return_labels=False)
    close(stack.sum(0), cache["resid_post", -1][:, 3:7])


# ---- accumulated and decomposed streams --------------------------------------------------------------
@pytest.mark.parametrize("family", families_applying_norms())  # the cached streams themselves
def test_accumulated_resid(runs, family):
    model, _, cache = runs[family]
    n = model.cfg.n_layers
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"{l}_pre" for l in range(n)] + ["final_post"]
    close(stack[:n], torch.stack([cache["resid_pre", l] for l in range(n)]), 0)
    close(stack[-1], cache["resid_post", -1], 0)
    mid = [l for l, b in enumerate(model.blocks) if b.has_resid_mid]
    stack, labels = cache.accumulated_resid(layer=2, incl_mid=True, return_labels=True)
    assert labels == ["0_pre"] + ["0_mid"] * (0 in mid) + ["1_pre"] + ["1_mid"] * (1 in mid) + ["2_pre"]
    if 1 in mid:
        close(stack[3], cache["resid_mid", 1], 0)
    assert cache.accumulated_resid(layer=1, mlp_input=True, return_labels=True)[1] == ["0_pre", "1_pre"] + ["1_mid"] * (1 in mid)
    # up to the final stream: each stream through the final norm itself (its own RMS, the norm's weight), the
    # logit lens: the final stream's is the norm's cached output, an earlier one's the norm applied to it
    stack = cache.accumulated_resid(apply_ln=True, pos_slice=-1)
    assert stack.shape == (n + 1, 2, model.cfg.d_model)
    close(stack[-1], cache["ln_final.hook_normalized"][:, -1])
    resid = cache["resid_pre", 1][:, -1].float()
    by_hand = norm_factor(model.ln_final) * resid / (resid.pow(2).mean(-1, keepdim=True) + model.ln_final.eps).sqrt()
    close(stack[1], by_hand)
    # and through the norm reading a block's resid_pre (ln1; ln2 in a block of a feed-forward alone)
    stack = cache.accumulated_resid(layer=2, apply_ln=True)
    close(stack[-1], sublayer_input(model, cache, 2, model.blocks[2].sublayers()[0].kind))


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_decompose_resid(runs, family):
    model, _, cache = runs[family]
    n = model.cfg.n_layers
    def terms(l, kinds=("mixer", "ffn")):  # what block l adds, in order (a block may lack a sublayer, or have several)
        return [f"{l}_{sub.out_hook[5:-4]}_out" for sub in model.blocks[l].sublayers() if sub.kind in kinds]

    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed"] + [label for l in range(n) for label in terms(l)]
    close(stack.sum(0), cache["resid_post", -1])
    stack, labels = cache.decompose_resid(layer=1, mlp_input=True, return_labels=True)
    block = model.blocks[1]  # the sublayers before its first feed-forward (none in a parallel block: no resid_mid)
    first_ffn = next(i for i, sub in enumerate(block.sublayers()) if sub.kind == "ffn")
    assert labels == ["embed"] + terms(0) + (terms(1)[:first_ffn] if block.has_resid_mid else [])
    close(stack.sum(0), cache[ffn_stream(block), 1])
    attn, labels = cache.decompose_resid(mode="attn", incl_embeds=False, return_labels=True)
    assert labels == [label for l in range(n) for label in terms(l, ("mixer",))]
    mlp = cache.decompose_resid(mode="mlp", incl_embeds=False)
    close(attn.sum(0) + mlp.sum(0) + cache["hook_embed"], cache["resid_post", -1])
    # apply_ln: the same scale for every component, so it commutes with the sum
    normed = cache.decompose_resid(apply_ln=True, pos_slice=[0, 5])
    close(normed.sum(0), cache.apply_ln_to_stack(cache["resid_post", -1][None, :, [0, 5]], pos_slice=[0, 5])[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_stack_activation(runs, family):
    model, _, cache = runs[family]
    n = model.cfg.n_layers
    close(cache.stack_activation("resid_pre"), torch.stack([cache["resid_pre", l] for l in range(n)]), 0)
    if model.cfg.dense_layer_indices:  # a router in every block is needed to stack them
        with pytest.raises(MissingHooksError, match="dense block"):
            cache.stack_activation("blocks.L.mlp.hook_router_logits")
    else:
        logits = cache.stack_activation("blocks.L.mlp.hook_router_logits")
        assert logits.shape == (n, 2, 12, routable_experts(model))
        close(logits[1], cache["blocks.1.mlp.hook_router_logits"], 0)
    assert cache.stack_activation("resid_pre", layer=2).shape[0] == 2
    if all(any(sub.kind == "ffn" and sub.norm is not None and block.norm_name(sub.norm) == "ln2"
               for sub in block.sublayers()) for block in model.blocks):
        close(cache.stack_activation("normalized", sublayer_type="ln2")[2], cache["blocks.2.ln2.hook_normalized"], 0)
    else:  # a block without a feed-forward, or whose feed-forward reads the stream unnormed or through ln1 (a
        # parallel block), has no ln2
        with pytest.raises(MissingHooksError, match="have no such tensor"):
            cache.stack_activation("normalized", sublayer_type="ln2")
    if len(set(model.cfg.top_k_per_layer)) > 1 and not model.cfg.dense_layer_indices:  # Hunyuan: top_k differs per layer
        with pytest.raises(ValueError, match="differ in shape"):
            cache.stack_activation("expert_indices")


# ---- heads ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_head_results(runs, family):
    model, _, cache = runs[family]
    cfg = model.cfg
    stack, labels = cache.stack_head_results(return_labels=True)
    heads = attentions(model)  # a hybrid's linear-attention layers have no heads in this sense
    assert labels == [label for l in sorted({l for l, _ in heads}) for label in mixer_labels(model, l)]
    assert labels[: cfg.n_heads] == [f"L{heads[0][0]}H{h}" for h in range(cfg.n_heads)]  # TransformerLens's labels
    per_attention = dict(zip(heads, stack.unflatten(0, (len(heads), cfg.n_heads))))
    for l, a in heads:
        W = getattr(model.blocks[l], a).o_proj.weight.detach()
        z = cache[f"blocks.{l}.{a}.hook_z"]
        d = z.shape[-1]  # a head's value width (MLA: v_head_dim)
        # as the stream receives it: the residual multiplier, a post-norm's weight over its cached scale
        factor = stream_factor(model, cache, l, "mixer")
        for h in (0, cfg.n_heads - 1):  # head h reads o_proj's input columns of that head
            close(per_attention[l, a][h], (z[:, :, h] @ W[:, h * d : (h + 1) * d].T) * factor)
        bias = getattr(model.blocks[l], a).o_proj.bias
        close(per_attention[l, a].sum(0) + (0 if bias is None else bias.detach() * factor), cache[f"blocks.{l}.hook_{a}_out"])
    layers = sorted({l for l, _ in heads})
    upto = layers[1] + 1 if len(layers) > 1 else cfg.n_layers  # a bound with heads of two layers before it, where there are
    stack, labels = cache.stack_head_results(layer=upto, incl_remainder=True, return_labels=True)
    assert labels[-1] == "remainder" and len(labels) == len([l for l, _ in heads if l < upto]) * cfg.n_heads + 1
    close(stack.sum(0), cache.accumulated_resid(layer=upto)[-1])
    if upto < cfg.n_layers:  # through the norm reading block upto's resid_pre (ln2 in a block of a feed-forward alone)
        normed = cache.stack_head_results(layer=upto, apply_ln=True, pos_slice=0)
        reader = model.blocks[upto].sublayers()[0].norm  # None: the block reads its stream unnormed (post-norm)
        expected = stack[:-1, :, 0] if reader is None else (
            stack[:-1, :, 0] / cache[reader.hook_scale.name][:, 0] * norm_factor(reader))
        close(normed, expected)
    fresh = model.run_with_cache(torch.zeros(1, 3, dtype=torch.long), names_filter=lambda n: n.endswith("hook_z"))[1]
    fresh.compute_head_results()
    assert fresh[f"blocks.{heads[0][0]}.attn.hook_result"].shape == (1, 3, cfg.n_heads, cfg.d_model)
    assert sorted(k for k in fresh.cache_dict if k.endswith("hook_result")) == sorted(f"blocks.{l}.{a}.hook_result" for l, a in heads)
    assert cache.stack_head_results(layer=0).shape == (0, 2, 12, cfg.d_model)


# ---- logit attribution ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_logit_attrs_sum_to_logits(runs, toks, family):
    model, logits, cache = runs[family]
    # as TransformerLens, logit_attrs applies the final norm's cached scale itself: the stack is un-normalised
    stack = cache.get_full_resid_decomposition(return_labels=False)
    # per-position token ids: components add up to that token's logit (RMSNorm has no centering constant)
    attrs = cache.logit_attrs(stack, toks)
    assert attrs.shape == (stack.shape[0], 2, 12)
    close(attrs.sum(0), logits.gather(-1, toks[..., None])[..., 0])
    # a logit difference, one token per row, last position only
    right, wrong = torch.tensor([5, 17]), torch.tensor([40, 2])
    last = cache.get_full_resid_decomposition(pos_slice=-1, return_labels=False)
    diff = cache.logit_attrs(last, right, incorrect_tokens=wrong, pos_slice=-1)
    assert diff.shape == (stack.shape[0], 2)
    close(diff.sum(0), logits[torch.arange(2), -1, right] - logits[torch.arange(2), -1, wrong])
    # one token everywhere, and the same as a float direction
    close(cache.logit_attrs(stack, 7).sum(0), logits[..., 7])
    close(cache.logit_attrs(stack, model.tokens_to_residual_directions(7)), cache.logit_attrs(stack, 7), 0)
    # full-length tokens with a pos_slice are sliced; already-sliced ones are taken as they are
    part = cache.get_full_resid_decomposition(pos_slice=slice(2, 5), return_labels=False)
    a = cache.logit_attrs(part, toks, pos_slice=slice(2, 5))
    close(a, cache.logit_attrs(part, toks[:, 2:5], pos_slice=slice(2, 5)), 0)
    close(a.sum(0), logits[:, 2:5].gather(-1, toks[:, 2:5, None])[..., 0])
    # accumulated stream at the end (logit_attrs normalises it): the last entry gives the logits
    acc = cache.accumulated_resid()
    close(cache.logit_attrs(acc, toks)[-1], logits.gather(-1, toks[..., None])[..., 0])
    # a stack normalised already is normalised again (TransformerLens's semantics): not the logits
    twice = cache.logit_attrs(cache.get_full_resid_decomposition(apply_ln=True, return_labels=False), toks)
    scale, weight = cache["ln_final.hook_scale"], norm_factor(model.ln_final)
    W_U = model.unembed.weight[toks].detach() / model.unembed.divisor  # Granite's logits_scaling divides
    close(twice, (stack / scale**2 * weight**2 * W_U).sum(-1))


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_expert_logit_attribution(runs, toks, family):
    model, logits, cache = runs[family]
    cfg = model.cfg
    n_experts = routable_experts(model)  # identity experts after the real ones
    ela = cache.expert_logit_attribution(toks)
    assert ela.shape == (cfg.n_layers, n_experts, 2, 12)
    # the same numbers as the decomposition's expert components through logit_attrs
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    attrs = dict(zip(labels, cache.logit_attrs(stack, toks)))
    for l in cfg.moe_layer_indices:
        close(ela[l], torch.stack([attrs[f"L{l}.E{e}"] for e in range(n_experts)]))
    for l in cfg.dense_layer_indices:  # a dense block routes nothing
        assert (ela[l] == 0).all()
    # an independent loop for one token: slot outputs / final rms . (W_U column * final norm weight)
    b, p, tok = 1, 7, int(toks[1, 7])
    direction = model.unembed.weight[tok].detach() / model.unembed.divisor * norm_factor(model.ln_final)
    rms = cache["ln_final.hook_scale"][b, p, 0]
    for l in cfg.moe_layer_indices:
        expected = torch.zeros(n_experts)
        factor = stream_factor(model, cache, l, "ffn")  # the residual multiplier, a post-norm's factor, or 1
        factor = factor[b, p] if torch.is_tensor(factor) else factor
        for s, e in enumerate(cache["expert_indices", l][b, p].tolist()):
            expected[e] += (cache["expert_outputs", l][b, p, s] * factor) @ direction / rms
        close(ela[l, :, b, p], expected)
        unchosen = torch.ones(n_experts, dtype=torch.bool)
        unchosen[cache["expert_indices", l][b, p]] = False
        assert (ela[l, unchosen, b, p] == 0).all()
    # logit difference at one position, and a float direction
    diff = cache.expert_logit_attribution(3, pos_slice=-1, incorrect_tokens=9)
    assert diff.shape == (cfg.n_layers, n_experts, 2)
    close(diff, cache.expert_logit_attribution(3, pos_slice=-1) - cache.expert_logit_attribution(9, pos_slice=-1))
    d = model.tokens_to_residual_directions(3) - model.tokens_to_residual_directions(9)
    close(cache.expert_logit_attribution(d, pos_slice=-1), diff)


def test_expert_logit_attribution_dense_block_is_zero(variant_runs, toks):
    model, _, cache = variant_runs["qwen2_moe", "dense_block"]
    ela = cache.expert_logit_attribution(toks)
    assert (ela[1] == 0).all() and ela[0].abs().sum() > 0


# ---- errors and layouts -----------------------------------------------------------------------------
def test_missing_hooks_are_named(runs, toks):
    model = runs["qwen2_moe"][0]
    _, cache = model.run_with_cache(toks, names_filter=lambda n: "expert_outputs" not in n and "resid_pre" not in n)
    with pytest.raises(MissingHooksError, match=r"blocks\.0\.mlp\.hook_expert_outputs"):
        cache.get_full_resid_decomposition(expand_neurons=False)
    with pytest.raises(MissingHooksError, match=r"expert_logit_attribution needs .*blocks\.0\.mlp\.hook_expert_outputs"):
        cache.expert_logit_attribution(toks)
    with pytest.raises(MissingHooksError, match=r"blocks\.0\.hook_resid_pre"):
        cache.accumulated_resid()
    _, cache = model.run_with_cache(toks, names_filter="hook_embed")
    with pytest.raises(MissingHooksError, match=r"ln_final\.hook_scale"):
        cache.apply_ln_to_stack(cache["hook_embed"][None])
    with pytest.raises(MissingHooksError, match="blocks"):
        cache.stack_activation("resid_post")
    with pytest.raises(ValueError, match="layer must be"):
        cache.decompose_resid(layer=7)


@pytest.mark.parametrize("family", decomposition_refused(families_applying_norms()))
def test_without_batch_dim(runs, toks, family):
    """The analyses of a cache without its batch axis are those of the same one-row run with it (a one-row run:
    a batch of two rounds a chunked linear-attention layer differently, as transformers' own does)."""
    model = runs[family][0]
    with torch.no_grad():
        _, cache = model.run_with_cache(toks[:1])
        _, single = model.run_with_cache(toks[:1], remove_batch_dim=True)
    stack, labels = single.get_full_resid_decomposition(apply_ln=True, return_labels=True)
    batched = cache.get_full_resid_decomposition(apply_ln=True, return_labels=False)
    close(stack, batched[:, 0])
    raw = single.get_full_resid_decomposition(return_labels=False)
    batched_raw = cache.get_full_resid_decomposition(return_labels=False)
    close(single.logit_attrs(raw, toks[0]), cache.logit_attrs(batched_raw, toks[:1])[:, 0])
    close(single.expert_logit_attribution(toks[0]), cache.expert_logit_attribution(toks[:1])[:, :, 0])
    assert single.accumulated_resid(pos_slice=-1).shape == (model.cfg.n_layers + 1, model.cfg.d_model)
