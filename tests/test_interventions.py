"""On every family: the identities between sites, and what each intervention means.

Identities: each block's stream is resid_pre + attn_out + mlp_out; a mixture layer's mlp_out is its routed
experts' sum plus its shared expert's output (gated by the sigmoid of hook_shared_gate where the family gates
it). Interventions: a tensor a hook returns (or edits in place) is what the model uses from there on; new
router logits choose the experts and their weights anew by the family's rule; new expert indices re-route,
with each weight read from the router's score of the new expert; new expert weights are used as given, never
renormalised; ablating an expert changes only the tokens routed to it; and no result depends on which
other hooks are on or on the experts backend.
"""

import re

import pytest
import torch
from conftest import (BACKEND_CASES, FAMILIES, KERNEL_FAMILIES, as_added, attention_layers, has_shared_expert,
                      routable_experts, routed_scale, shared_expert_gated, sublayer_input)

from moelens import HookedTransformer
from moelens.models.deepseek_v2 import SoftmaxGroupLimitedTopK
from moelens.models.mistral4 import SoftmaxGroupedTopK
from moelens.models.components.router import SparseMixer
from moelens.models.ernie4_5_moe import StatisticsBiasedSoftmaxTopK
from moelens.models.components import Float32SoftmaxTopK, GatedSharedExpertMoe, SharedFirstMoe, SigmoidGroupedTopK
from moelens.models.gpt_oss import LogitTopKSoftmax
from moelens.models.llama4_text import SigmoidOfChosenLogits
from moelens.models.flint import Float32SigmoidTopK
from moelens.models.kolibri1 import BiasedLogitsSigmoidTopK
from moelens.models.lfm2_moe import Lfm2SigmoidTopK
from moelens.models.minimax_m2 import SigmoidTopKFloat32Weights
from moelens.models.mixtral import SoftmaxTopKFloat32Weights

zero = lambda t, hook: torch.zeros_like(t)  # noqa: E731
# the routers whose slot weights stay float32 in any model dtype (Hunyuan, Solar / DeepSeek, Mixtral, MiniMax-M2,
# Kolibri 1, Flint)
FLOAT32_WEIGHTS = (Float32SoftmaxTopK, SigmoidGroupedTopK, SoftmaxGroupLimitedTopK, SoftmaxTopKFloat32Weights, SigmoidTopKFloat32Weights,
                   BiasedLogitsSigmoidTopK, Float32SigmoidTopK)


def sparsemixer_by_hand(logits, idx, eps):
    """Phi-3.5-MoE's slot weights by hand, in float64: slot s keeps the experts no earlier slot took whose logit l
    is within 2 * eps of its chosen logit c relative to max(|l|, c); its weight is c's share of their exp."""
    logits = logits.double()
    taken = torch.zeros_like(logits, dtype=torch.bool)
    weights = []
    for s in range(idx.shape[-1]):
        chosen = idx[..., s : s + 1]
        c = logits.gather(-1, chosen)
        keep = ((c - logits) / torch.maximum(logits.abs(), c) <= 2 * eps) & ~taken
        share = torch.where(keep, (logits - c).exp(), torch.zeros_like(logits))
        weights.append(share.gather(-1, chosen) / share.sum(-1, keepdim=True))
        taken = taken | torch.zeros_like(taken).scatter_(-1, chosen, True)
    return torch.cat(weights, -1)


def moe_layers(model):
    return [i for i, m in enumerate(model.cfg.moe_layers) if m]


def weights_scale(model, layer: int) -> float:
    """What the routing weights carry of routed_scaling_factor: all of it, unless the mixture scales the experts'
    sum instead (its routed part's scale, Beam's)."""
    return model.cfg.routed_scaling_factor / routed_scale(model, layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_identities(family_models, family, tokens):
    model = family_models[family]
    _, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        added = [cache[f"blocks.{layer}.{sub.out_hook}"] for sub in model.blocks[layer].sublayers()]
        summed = sum(added, cache["resid_pre", layer])
        if model.blocks[layer].stream_is_sum:
            torch.testing.assert_close(summed, cache["resid_post", layer], rtol=0, atol=1e-6)
        else:  # a block that carries another stream says so, truly (its family's suite checks the stream it keeps)
            assert (summed - cache["resid_post", layer]).abs().max() > 1e-3
        mlp, block = f"blocks.{layer}.mlp", model.blocks[layer]
        if not block.is_moe:
            continue
        # what the mixture outputs, as the block adds it (through its post-norm, where it has one)
        if not has_shared_expert(model, layer):
            assert torch.equal(as_added(model, layer, "ffn", cache[f"{mlp}.hook_routed_out"]), cache["mlp_out", layer])
        else:
            mixture_out = cache[f"{mlp}.hook_routed_out"] + cache[f"{mlp}.hook_shared_out"]
            torch.testing.assert_close(as_added(model, layer, "ffn", mixture_out), cache["mlp_out", layer], rtol=0, atol=0)
        if shared_expert_gated(model, layer):
            gated = torch.sigmoid(cache[f"{mlp}.hook_shared_gate"]) * cache[f"{mlp}.shared_expert.hook_out"]
            torch.testing.assert_close(gated, cache[f"{mlp}.hook_shared_out"], rtol=0, atol=0)
        elif has_shared_expert(model, layer):
            assert torch.equal(cache[f"{mlp}.hook_shared_out"], cache[f"{mlp}.shared_expert.hook_out"])
        scale = routed_scale(model, layer)  # Beam's mixture scales its slots' sum
        torch.testing.assert_close((cache[f"{mlp}.hook_expert_outputs"].sum(2) * scale).to(cache["mlp_out", layer].dtype),
                                   cache[f"{mlp}.hook_routed_out"], rtol=0, atol=1e-6)


def p_normalised(model, w: torch.Tensor) -> torch.Tensor:
    """The k weights divided by their topk_norm_p-norm (DBRX's moe_normalize_expert_weights), where the config sets it."""
    p = model.cfg.topk_norm_p
    return w if p is None else w / w.abs().pow(p).sum(-1, keepdim=True).pow(1 / p)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_rules(family_models, family, tokens):
    """Each family's router rule, recomputed by hand from the cached logits."""
    model = family_models[family]
    _, cache = model.run_with_cache(tokens)
    for layer in moe_layers(model):
        logits, w, idx = cache["router_logits", layer], cache["expert_weights", layer], cache["expert_indices", layer]
        k = model.cfg.top_k_per_layer[layer]
        router = model.blocks[layer].mlp.router
        if isinstance(router, Lfm2SigmoidTopK):  # LFM2: sorted top-k of sigmoid (+ float32 bias), + 1e-6, scaled
            scores = logits.sigmoid()
            choice = scores + router.e_score_correction_bias if router.choice_bias else scores
            assert torch.equal(choice.topk(k, -1).indices, idx)
            expected = scores.gather(-1, idx)
            if model.cfg.norm_topk_prob:
                expected = expected / (expected.sum(-1, keepdim=True) + 1e-6)
            expected = expected * model.cfg.routed_scaling_factor
        elif isinstance(router, Float32SigmoidTopK):  # Flint: the top-k of the sigmoid scores, no bias, no groups
            scores = logits.float().sigmoid()
            assert torch.equal(scores.topk(k, -1).indices, idx)
            expected = scores.gather(-1, idx)
            if model.cfg.norm_topk_prob:
                expected = expected / expected.sum(-1, keepdim=True)
        elif router.scoring == "sigmoid":  # MiniMax-M2's is one group of all experts, unscaled
            scores = logits.float().sigmoid()
            bias = model.blocks[layer].mlp.router.e_score_correction_bias
            biased = (scores + bias).unflatten(-1, (model.cfg.n_group, -1))
            best_groups = biased.topk(2, -1).values.sum(-1).topk(model.cfg.topk_group, -1).indices
            keep = torch.zeros(biased.shape[:-1], dtype=torch.bool).scatter_(-1, best_groups, True)
            choice = biased.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
            assert torch.equal(choice.topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
            expected = scores.gather(-1, idx)
            if model.cfg.norm_topk_prob:
                expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
            expected = expected * weights_scale(model, layer)
        elif router.scoring == LogitTopKSoftmax.scoring:  # top-k of the logits, a softmax over the chosen k
            top = logits.topk(k, dim=-1)
            assert torch.equal(top.indices, idx)
            expected = top.values.float().softmax(-1)
        elif router.scoring == SigmoidOfChosenLogits.scoring:  # Llama 4: top-k of the logits, each one's sigmoid
            top = logits.topk(k, dim=-1)
            assert torch.equal(top.indices, idx)
            expected = top.values.float().sigmoid()
        elif isinstance(router, BiasedLogitsSigmoidTopK):  # Kolibri 1: top-k of logits + bias, each one's sigmoid
            assert torch.equal((logits.float() + router.e_score_correction_bias).topk(k, -1).indices, idx)
            expected = logits.float().gather(-1, idx).sigmoid()
            if model.cfg.norm_topk_prob:
                expected = expected / expected.sum(-1, keepdim=True)
        elif isinstance(router, StatisticsBiasedSoftmaxTopK):  # ERNIE-4.5: biased choice, a floor under the sum
            scores = logits.float().softmax(-1)
            assert torch.equal((scores + router.e_score_correction_bias).topk(k, -1).indices, idx)
            expected = scores.gather(-1, idx)
            expected = expected / expected.sum(-1, keepdim=True).clamp(min=router.norm_min)
        elif router.choice_bias:  # LongCat-Flash: top-k of softmax + correction bias; the scores, scaled, unnormalised
            scores = logits.float().softmax(-1)
            choice = scores + router.e_score_correction_bias.float()
            assert torch.equal(choice.topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
            expected = scores.gather(-1, idx) * model.cfg.routed_scaling_factor
        elif router.scoring == SparseMixer.scoring:  # Phi-3.5-MoE: the largest logit, then the largest of the rest
            first = logits.argmax(-1, keepdim=True)
            second = logits.scatter(-1, first, float("-inf")).argmax(-1, keepdim=True)
            assert torch.equal(torch.cat([first, second], -1), idx)
            expected = sparsemixer_by_hand(logits, idx, model.cfg.router_jitter_noise)
        elif isinstance(router, SoftmaxGroupLimitedTopK):  # DeepSeek-V2: groups by their best score, unsorted slots
            scores = logits.float().softmax(-1)
            grouped = scores.unflatten(-1, (model.cfg.n_group, -1))
            best_groups = grouped.amax(-1).topk(model.cfg.topk_group, -1).indices
            keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool).scatter_(-1, best_groups, True)
            choice = grouped.masked_fill(~keep[..., None], 0.0).flatten(-2)
            assert torch.equal(choice.topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
            expected = scores.gather(-1, idx) * model.cfg.routed_scaling_factor
        elif isinstance(router, SoftmaxGroupedTopK):  # Mistral 4: groups by their two best scores, the model's dtype
            scores = logits.softmax(-1)
            grouped = scores.unflatten(-1, (model.cfg.n_group, -1))
            best_groups = grouped.topk(2, -1).values.sum(-1).topk(model.cfg.topk_group, -1).indices
            keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool).scatter_(-1, best_groups, True)
            choice = grouped.masked_fill(~keep[..., None], 0.0).flatten(-2)
            assert torch.equal(choice.topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
            expected = scores.gather(-1, idx)
            if model.cfg.norm_topk_prob:
                expected = expected / (expected.sum(-1, keepdim=True) + 1e-20)
            expected = expected * model.cfg.routed_scaling_factor
        else:
            top = logits.float().softmax(-1).topk(k, dim=-1)
            assert torch.equal(top.indices, idx)
            expected = top.values / top.values.sum(-1, keepdim=True) if model.cfg.norm_topk_prob else top.values
            expected = p_normalised(model, expected)
        torch.testing.assert_close(expected.to(w.dtype), w, rtol=0, atol=1e-7)
        assert w.dtype == (torch.float32 if isinstance(router, FLOAT32_WEIGHTS) else model.cfg.dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_ablation_touches_only_routed_tokens(checkpoints, family, dtype, tokens):
    model = HookedTransformer.from_pretrained(checkpoints[family, "base"], dtype=dtype, progress=False)
    _, cache = model.run_with_cache(tokens)
    for layer in moe_layers(model):
        idx, clean = cache["expert_indices", layer], cache["mlp_out", layer]
        hit = 0
        for e in range(model.cfg.n_experts):
            ablate = lambda w, hook, e=e, idx=idx: w.masked_fill(idx == e, 0)  # noqa: E731
            with model.hooks([(f"blocks.{layer}.mlp.hook_expert_weights", ablate)]):
                _, ablated = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.hook_mlp_out")
            changed = (ablated["mlp_out", layer] != clean).any(-1)
            assert torch.equal(changed, (idx == e).any(-1)), (layer, e)
            hit += int(changed.any())
        assert hit > 1  # several experts were used, so the check was not vacuous


@pytest.mark.parametrize("family", FAMILIES)
def test_replacing_router_logits_reroutes_and_reweights(family_models, family, tokens):
    model, forced = family_models[family], [5, 4, 2]  # within two of Solar's groups
    if getattr(model.cfg, "topk_group", None) == 1:  # one group of four chosen (the tiny Nemotron-H): all in it
        forced = [5, 4, 6]
    layer = moe_layers(model)[0]
    k = model.cfg.top_k_per_layer[layer]

    def force(logits, hook):
        new = torch.full_like(logits, -10.0)
        for rank, e in enumerate(forced[:k]):
            new[..., e] = 4.0 - rank
        return new

    with model.hooks([(f"blocks.{layer}.mlp.hook_router_logits", force)]):
        _, cache = model.run_with_cache(tokens)
    idx, w = cache["expert_indices", layer], cache["expert_weights", layer]
    assert torch.equal(idx.sort(-1).values, torch.tensor(sorted(forced[:k])).expand_as(idx))
    new_logits = torch.tensor([4.0 - r for r in range(k)])
    if model.blocks[layer].mlp.router.scoring == "sigmoid":  # (the bias is small next to the forced gap)
        expected = torch.sigmoid(new_logits)
        expected = expected / expected.sum() if model.cfg.norm_topk_prob else expected
        expected = expected * weights_scale(model, layer)
    elif model.blocks[layer].mlp.router.scoring == LogitTopKSoftmax.scoring:  # a softmax over the chosen k only
        expected = torch.softmax(new_logits, -1)
    elif model.blocks[layer].mlp.router.scoring == SigmoidOfChosenLogits.scoring:  # each chosen logit's sigmoid
        expected = torch.sigmoid(new_logits)
    elif isinstance(model.blocks[layer].mlp.router, BiasedLogitsSigmoidTopK):  # the same, renormalised where asked
        expected = torch.sigmoid(new_logits)
        expected = expected / expected.sum() if model.cfg.norm_topk_prob else expected
    elif model.blocks[layer].mlp.router.scoring == SparseMixer.scoring:  # near logits share a slot's softmax
        row = torch.tensor([4.0 - r for r in range(k)] + [-10.0] * (model.cfg.n_experts - k))
        expected = sparsemixer_by_hand(row, torch.arange(k), model.cfg.router_jitter_noise).float()
    else:
        probs = torch.softmax(torch.tensor([4.0 - r for r in range(k)] + [-10.0] * (routable_experts(model) - k)), -1)[:k]
        expected = p_normalised(model, probs / probs.sum() if model.cfg.norm_topk_prob else probs)
        if model.blocks[layer].mlp.router.choice_bias:  # LongCat-Flash's weights: the scores times the scaling factor
            expected = expected * model.cfg.routed_scaling_factor
    order = idx.argsort(-1)
    by_expert = torch.tensor(forced[:k]).argsort()
    torch.testing.assert_close(w.gather(-1, order), expected[by_expert].expand_as(w), rtol=0, atol=1e-6)
    # only the forced experts ran: slot 0's gate pre-activation is that expert applied to the token
    x = sublayer_input(model, cache, layer, "ffn")
    experts = model.blocks[layer].mlp.experts.tensors()
    slot0 = idx[..., 0]
    if model.blocks[layer].mlp.experts.spec.weight_at == "input":  # Llama 4: the slot's weight scales its input
        x = x * w[..., 0, None]
    if hasattr(model.blocks[layer].mlp, "fc1_latent_proj"):  # a latent mixture's experts read its projection
        x = model.blocks[layer].mlp.fc1_latent_proj(x)
    gate = torch.einsum("bpd,bpid->bpi", x, experts.gate_up[slot0, : model.cfg.d_expert])
    if model.blocks[layer].mlp.experts.spec.bias:
        gate = gate + experts.gate_up_bias[slot0, : model.cfg.d_expert]
    # an ungated expert's first rows are its up projection (hook_pre_linear; hook_pre never fires)
    site = "hook_pre" if model.blocks[layer].mlp.experts.spec.activation.gated else "hook_pre_linear"
    torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{site}"][:, :, 0], gate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_new_indices_reroute_and_weights_follow(family_models, family, tokens):
    """Writing hook_expert_indices re-routes; the weights are read from the scores of the new experts."""
    model = family_models[family]
    layer = moe_layers(model)[0]
    k = model.cfg.top_k_per_layer[layer]
    new = torch.arange(k)
    with model.hooks([(f"blocks.{layer}.mlp.hook_expert_indices", lambda idx, hook: new.expand_as(idx).contiguous())]):
        _, cache = model.run_with_cache(tokens)
    scores = cache[f"blocks.{layer}.mlp.hook_router_scores"][..., :k]
    w = cache["expert_weights", layer]
    if model.blocks[layer].mlp.router.scoring == LogitTopKSoftmax.scoring:  # a softmax over the new experts' logits
        expected = scores.float().softmax(-1)
    elif model.blocks[layer].mlp.router.scoring == SigmoidOfChosenLogits.scoring:  # the new experts' logits' sigmoids
        expected = scores.float().sigmoid()
    elif isinstance(model.blocks[layer].mlp.router, BiasedLogitsSigmoidTopK):  # the same, renormalised where asked
        expected = scores.float().sigmoid()
        expected = expected / expected.sum(-1, keepdim=True) if model.cfg.norm_topk_prob else expected
    elif isinstance(model.blocks[layer].mlp.router, Lfm2SigmoidTopK):  # renormalised over the sum + 1e-6
        expected = scores / (scores.sum(-1, keepdim=True) + 1e-6) if model.cfg.norm_topk_prob else scores
        expected = expected * model.cfg.routed_scaling_factor
    elif model.blocks[layer].mlp.router.scoring == SparseMixer.scoring:  # from every logit near the new experts'
        logits = cache[f"blocks.{layer}.mlp.hook_router_scores"]
        expected = sparsemixer_by_hand(logits, new.expand(*logits.shape[:-1], k), model.cfg.router_jitter_noise)
    else:
        if model.cfg.norm_topk_prob:
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        expected = p_normalised(model, scores) * weights_scale(model, layer)
    torch.testing.assert_close(w, expected.to(w.dtype), rtol=0, atol=1e-7)


@pytest.mark.parametrize("family", FAMILIES)
def test_new_weights_are_not_renormalised(family_models, family, tokens):
    model = family_models[family]
    layer = moe_layers(model)[0]
    half = lambda w, hook: w * 0.5  # noqa: E731
    _, clean = model.run_with_cache(tokens)
    with model.hooks([(f"blocks.{layer}.mlp.hook_expert_weights", half)]):
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["expert_weights", layer], clean["expert_weights", layer] * 0.5)
    routed = f"blocks.{layer}.mlp.hook_routed_out"
    if model.blocks[layer].mlp.experts.spec.weight_at == "output":
        torch.testing.assert_close(cache[routed], clean[routed] * 0.5, rtol=1e-5, atol=1e-6)
        return
    # Llama 4: the halved weight scales each slot's input, so each slot is expert(0.5 * weight * x), by hand
    x, idx = sublayer_input(model, cache, layer, "ffn"), cache["expert_indices", layer]
    experts = model.blocks[layer].mlp.experts.tensors()
    scaled = x[:, :, None, :] * cache["expert_weights", layer][..., None]
    gate, up = torch.einsum("bpkih,bpkh->bpki", experts.gate_up[idx], scaled).chunk(2, dim=-1)
    by_hand = torch.einsum("bpkhi,bpki->bpkh", experts.down[idx], torch.nn.functional.silu(gate) * up).sum(2)
    torch.testing.assert_close(cache[routed], by_hand, rtol=1e-5, atol=1e-5)
    assert (cache[routed] - clean[routed] * 0.5).abs().max() > 1e-3  # not the output-weighted rule


@pytest.mark.parametrize("family", FAMILIES)
def test_replacing_expert_neurons_and_shared_out(family_models, family, tokens):
    model = family_models[family]
    first, last = moe_layers(model)[0], moe_layers(model)[-1]
    with model.hooks([(f"blocks.{last}.mlp.experts.hook_post", zero)]):
        _, cache = model.run_with_cache(tokens)
    routed = cache[f"blocks.{last}.mlp.hook_routed_out"]
    experts = model.blocks[last].mlp.experts
    if experts.spec.bias:  # zero neurons leave each slot's down bias, times the slot's weight
        idx, w = cache["expert_indices", last], cache["expert_weights", last]
        left = (w[..., None] * experts.tensors().down_bias[idx]).sum(-2)
        assert torch.count_nonzero(left) > 0
        torch.testing.assert_close(routed, left.to(routed.dtype), rtol=0, atol=0)
    elif experts.spec.n_identity:  # zero neurons leave the identity experts' slots: weight * the mixture's input
        idx, w = cache["expert_indices", last], cache["expert_weights", last]
        x = cache[f"blocks.{last}.ln2.hook_normalized"]
        left = (w * (idx >= model.cfg.n_experts)).sum(-1, keepdim=True) * x
        assert torch.count_nonzero(left) > 0
        torch.testing.assert_close(routed, left.to(routed.dtype), rtol=1e-6, atol=1e-6)
    else:
        assert torch.count_nonzero(routed) == 0
    if not has_shared_expert(model):
        assert torch.equal(cache["mlp_out", last], as_added(model, last, "ffn", routed))
        return
    shared_out = cache[f"blocks.{last}.mlp.hook_shared_out"]
    torch.testing.assert_close(cache["mlp_out", last], as_added(model, last, "ffn", routed + shared_out), rtol=0, atol=0)
    with model.hooks([(f"blocks.{first}.mlp.hook_shared_out", zero)]):
        _, cache = model.run_with_cache(tokens)
    routed_first = cache[f"blocks.{first}.mlp.hook_routed_out"]
    torch.testing.assert_close(cache["mlp_out", first], as_added(model, first, "ffn", routed_first), rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_fire_in_family_order(family_models, family, tokens):
    order = []
    model = family_models[family]
    model.run_with_hooks(tokens, fwd_hooks=[(lambda n: ".mlp." in n, lambda t, hook: order.append(hook.name))])
    mlp = next(b.mlp for b in model.blocks if b.is_moe)
    layer = mlp.hook_router_logits.name.split(".")[1]
    order = [n for n in order if n.startswith(f"blocks.{layer}.")]
    pos = {n.replace(f"blocks.{layer}.", "blocks.0."): i for i, n in enumerate(order)}
    router, routed = pos["blocks.0.mlp.hook_router_logits"], pos["blocks.0.mlp.hook_routed_out"]
    assert router < pos["blocks.0.mlp.hook_expert_indices"] < pos["blocks.0.mlp.hook_expert_weights"] < routed
    if isinstance(mlp, GatedSharedExpertMoe):  # shared expert first, gated after the routed experts
        shared, shared_out = pos["blocks.0.mlp.shared_expert.hook_out"], pos["blocks.0.mlp.hook_shared_out"]
        assert shared < router and routed < pos["blocks.0.mlp.hook_shared_gate"] < shared_out
    elif isinstance(mlp, SharedFirstMoe):  # shared expert first, added as it is
        assert pos["blocks.0.mlp.hook_shared_out"] < router
    elif has_shared_expert(model, int(layer)):  # the shared expert after the routed experts
        assert routed < pos["blocks.0.mlp.shared_expert.hook_out"]
    if mlp.router.choice_bias:
        assert pos["blocks.0.mlp.hook_router_scores"] < pos["blocks.0.mlp.hook_choice_scores"] < pos["blocks.0.mlp.hook_expert_indices"]


@pytest.mark.parametrize("family", FAMILIES)
def test_query_scaling_at_rot_q_survives_into_scores(family_models, family, tokens):
    """hook_rot_q is the query entering attention (after Hunyuan's q norm): scaling it scales the scores."""
    model = family_models[family]
    L = attention_layers(model)[0]  # a hybrid's first softmax-attention layer

    def double_head_1(q, hook):
        q = q.clone()
        q[:, :, 1] *= 2
        return q

    _, clean = model.run_with_cache(tokens, names_filter=f"blocks.{L}.attn.hook_attn_scores")
    with model.hooks([(f"blocks.{L}.attn.hook_rot_q", double_head_1)]):
        _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{L}.attn.hook_attn_scores")
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    window = model.cfg.window(L)
    if window is not None:  # a sliding layer sees the keys fewer than `window` positions back
        causal = causal.triu(-(window - 1))
    chunk = getattr(model.blocks[L].attn, "chunk", None)
    if chunk is not None:  # Llama 4's chunked layer sees the keys of the query's chunk
        pos = torch.arange(tokens.shape[1])
        causal &= (pos[:, None] // chunk) == (pos[None, :] // chunk)
    a, b = clean["attn_scores", L], cache["attn_scores", L]
    # DeepSeek Sparse Attention also masks the causal keys its indexer did not select (at finfo.min)
    causal = causal & (a[:, 1] > torch.finfo(a.dtype).min)
    torch.testing.assert_close(b[:, 1][causal], 2 * a[:, 1][causal], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[:, 0], a[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_support_table(family_models, family, tokens):
    model = family_models[family]
    _, cache = model.run_with_cache(tokens)
    b, p = tokens.shape
    cfg = model.cfg
    for layer in range(cfg.n_layers):
        k = cfg.top_k_per_layer[layer]
        if model.blocks[layer].has_attention:  # a hybrid's linear-attention layers have no pattern
            assert cache[f"blocks.{layer}.attn.hook_pattern"].shape == (b, cfg.n_heads, p, p)
        else:
            assert f"blocks.{layer}.attn.hook_pattern" not in cache.cache_dict
        if not model.blocks[layer].has_ffn:  # a layer of a token mixer alone (Nemotron-H)
            assert f"blocks.{layer}.hook_mlp_out" not in cache.cache_dict
            continue
        if not model.blocks[layer].is_moe:
            assert cache[f"blocks.{layer}.mlp.hook_post"].shape == (b, p, cfg.d_mlp)
            continue
        assert cache["router_logits", layer].shape == (b, p, routable_experts(model))
        assert cache["expert_indices", layer].shape == (b, p, k)
        assert cache[f"blocks.{layer}.mlp.experts.hook_post"].shape == (b, p, k, cfg.d_expert)
        assert cache[f"blocks.{layer}.mlp.hook_expert_outputs"].shape == (b, p, k, cfg.d_model)
        if has_shared_expert(model, layer):
            assert cache[f"blocks.{layer}.mlp.shared_expert.hook_post"].shape == (b, p, cfg.d_shared)
    table = model.support(print_table=False)
    names = set(table.names())
    # one row per site: L for the block, E for the expert of a per-expert view; a block's numbered repeats of a
    # module (LongCat-Flash's attn_1, ln1_1, ln2_1; its dense MLPs dense_0, dense_1) are the table's attn, ln1, ln2, mlp
    def site(name: str) -> str:
        name = re.sub(r"^blocks\.\d+\.", "blocks.L.", re.sub(r"\.experts\.\d+\.", ".experts.E.", name))
        return re.sub(r"^blocks\.L\.dense_\d+\.", "blocks.L.mlp.", re.sub(r"^blocks\.L\.(attn|ln1|ln2)_\d+\.", r"blocks.L.\1.", name))

    assert names == {site(n) for n in model.hook_dict}
    assert len(table.rows) == len(names)
    mlps = [b.mlp for b in model.blocks if b.is_moe]
    assert ("blocks.L.mlp.hook_shared_gate" in names) == shared_expert_gated(model)
    assert ("blocks.L.mlp.hook_choice_scores" in names) == any(m.router.choice_bias for m in mlps)
    assert ("blocks.L.mlp.shared_expert.hook_out" in names) == has_shared_expert(model)
    row = {r.name: r for r in table.rows}["blocks.L.mlp.hook_expert_indices"]
    top_k = sorted({cfg.top_k_per_layer[layer] for layer in moe_layers(model)})
    assert row.shape == "[batch, pos, " + "|".join(str(k) for k in top_k) + "]"
    assert row.standard == "expert_indices"
    text = str(table)
    assert "absent:" in text and "config.json fields read:" in text
    if family == "hunyuan_v1_moe":
        assert "moe_topk" in text and "q_norm" in repr(model)


@pytest.mark.parametrize("family, backend", BACKEND_CASES)
def test_results_do_not_depend_on_which_hooks_are_on(checkpoints, family, backend, tokens):
    """A clean run compared with a patched one must differ only where the patch acts: the plain forward,
    run_with_cache and a run with a reading hook on every site give bit-identical logits."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, experts_backend=backend)
    plain = model(tokens)
    cached, _ = model.run_with_cache(tokens)
    reading = model.run_with_hooks(tokens, fwd_hooks=[(lambda name: True, lambda t, hook: None)])
    only_experts = model.run_with_hooks(tokens, fwd_hooks=[("blocks.*.mlp.experts.hook_pre", lambda t, hook: None)])
    for other in (cached, reading, only_experts):
        assert torch.equal(plain, other)


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_gradients_through_the_triton_backend(checkpoints, family, tokens):
    pytest.importorskip("triton")
    grads = {}
    for backend in ("torch", "triton"):
        model = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, experts_backend=backend)
        names = ["blocks.0.hook_resid_pre", "blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.experts.hook_post"]
        _, cache = model.run_with_cache(tokens, return_type="loss", incl_bwd=True, names_filter=names)
        grads[backend] = {n: cache[n + "_grad"] for n in names}
        (grads[backend]["W_down"],) = torch.autograd.grad(model(tokens, return_type="loss"), [model.blocks[1].mlp.experts.W_down])
    for name, grad in grads["torch"].items():
        assert grad is not None and grad.abs().sum() > 0
        assert (grad - grads["triton"][name]).abs().max() <= 1e-5 * max(1.0, grad.abs().max().item()), name
