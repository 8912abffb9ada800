"""moelens.analysis: every statistic recomputed by hand from the hook tensors, every intervention checked
to change exactly what it says, on every family."""

import math

import pytest
import torch
from conftest import FAMILIES, routable_experts, routed_scale

from moelens import HookedTransformer
from moelens.analysis import (
    ablate_experts,
    ablate_experts_hooks,
    coactivation,
    coactivations,
    expert_usage,
    force_route,
    force_route_hooks,
    patch_routing,
    patch_routing_hooks,
    routing_table,
    steer_router,
    steer_router_hooks,
    top_tokens,
)
from moelens.models.components.router import SparseMixer
from moelens.models.gpt_oss import LogitTopKSoftmax
from moelens.models.kolibri1 import BiasedLogitsSigmoidTopK
from moelens.models.llama4_text import SigmoidOfChosenLogits


def moe_layers(model):
    return [i for i, m in enumerate(model.cfg.moe_layers) if m]


def site(layer, name):
    return f"blocks.{layer}.mlp.hook_{name}"


def left_padded(tokens):
    """A mask padding the first 6 positions of row 0 and 2 of row 1 (zero ids there, as a tokenizer would)."""
    mask = torch.ones_like(tokens)
    mask[0, :6] = 0
    mask[1, :2] = 0
    return tokens.masked_fill(mask == 0, 0), mask


def routing(model, tokens, mask=None):
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    valid = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    return cache, valid


# ---- usage -----------------------------------------------------------------------------------------------
def router_probabilities(model, layer, scores):
    """Each token's distribution over the experts, by hand from the router's declared scoring: a softmax of
    logit scores (gpt-oss, Phi-3.5-MoE's sparsemixer), the scores normalised to sum to one otherwise (softmax or
    sigmoid scores)."""
    scores = scores.double()
    if model.blocks[layer].mlp.router.scoring in (LogitTopKSoftmax.scoring, SparseMixer.scoring):
        return scores.softmax(-1)
    # Llama 4, Kolibri 1: logit scores, sigmoid weights
    if model.blocks[layer].mlp.router.scoring in (SigmoidOfChosenLogits.scoring, BiasedLogitsSigmoidTopK.scoring):
        return scores.sigmoid() / scores.sigmoid().sum(-1, keepdim=True)
    return scores / scores.sum(-1, keepdim=True)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_usage_counts_by_hand(family_models, family, tokens, padded):
    model = family_models[family]
    mask = None
    if padded:
        tokens, mask = left_padded(tokens)
    usage = expert_usage(model, tokens, attention_mask=mask)
    cache, valid = routing(model, tokens, mask)
    E = routable_experts(model)
    assert usage.layers == moe_layers(model) and usage.n_tokens == int(valid.sum())
    table = None if padded else routing_table(model, tokens[:1])
    assert table is None or table.layers == usage.layers
    for i, layer in enumerate(usage.layers):
        idx = cache["expert_indices", layer]
        by_hand = torch.zeros(E, dtype=torch.long)
        for r, p in valid.nonzero().tolist():
            for e in idx[r, p].tolist():
                by_hand[e] += 1
        assert torch.equal(usage.counts[i], by_hand)
        assert int(usage.counts[i].sum()) == usage.n_tokens * model.cfg.top_k_per_layer[layer]
        torch.testing.assert_close(usage.load[i], by_hand.float() / by_hand.sum())
        load = by_hand.double() / by_hand.sum()
        h_load = -sum(float(q) * math.log(float(q)) for q in load if q > 0)
        assert float(usage.load_entropy[i]) == pytest.approx(h_load, rel=1e-5)
        probs = router_probabilities(model, layer, cache["router_scores", layer][valid])
        h_tokens = [-sum(float(q) * math.log(float(q)) for q in row if q > 0) for row in probs]
        assert float(usage.routing_entropy[i]) == pytest.approx(sum(h_tokens) / len(h_tokens), rel=1e-5)
        assert 0 < float(usage.routing_entropy[i]) <= math.log(E) + 1e-6
        if table is not None:  # routing_table's entropy of the first prompt: the same probabilities
            first = probs[: tokens.shape[1]]
            h_first = [-sum(float(q) * math.log(float(q)) for q in row if q > 0) for row in first]
            assert table.summaries[i].entropy == pytest.approx(sum(h_first) / len(h_first), rel=1e-5)
    assert (usage.bias_changed is not None) == any(b.is_moe and b.mlp.router.choice_bias for b in model.blocks)
    text = str(usage)
    assert f"{usage.n_tokens} tokens" in text and all(f"\n{layer:>5}" in text for layer in usage.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_usage_over_a_dataset_sums_its_batches(family_models, family, tokens):
    """A generator of (tokens, mask) pairs, dicts and plain batches: counts add up, padding never counts."""
    model = family_models[family]
    padded, mask = left_padded(tokens)
    other = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(5))

    def dataset():
        yield padded, mask
        yield {"input_ids": other, "attention_mask": torch.ones_like(other)}
        yield other[0]  # one sequence, [pos]

    whole = expert_usage(model, dataset())
    parts = [expert_usage(model, padded, attention_mask=mask), expert_usage(model, other), expert_usage(model, other[:1])]
    assert whole.n_tokens == sum(p.n_tokens for p in parts) == int(mask.sum()) + 21 + 7
    assert torch.equal(whole.counts, sum(p.counts for p in parts))
    expected = sum(p.routing_entropy * p.n_tokens for p in parts) / whole.n_tokens
    torch.testing.assert_close(whole.routing_entropy, expected)


def test_usage_of_texts_is_padded_and_masked(tmp_path):
    """Texts are batched with left padding; the counts are those of each text run alone."""
    from moelens.defaults import default_checkpoint

    model = HookedTransformer.from_pretrained(default_checkpoint("tiny-qwen2-moe", root=tmp_path), progress=False)
    texts = ["Hi", "a longer text", "mid one"]
    together = expert_usage(model, texts, batch_size=2)
    alone = [expert_usage(model, model.to_tokens(t)) for t in texts]
    assert together.n_tokens == sum(len(model.to_tokens(t)[0]) for t in texts)
    assert torch.equal(together.counts, sum(u.counts for u in alone))
    top = top_tokens(model, texts, moe_layers(model)[0], 0, k=3, context=4)
    for entry in top:  # decoded contexts: the real text before the token
        row_text = texts[entry.batch * 2 + entry.row]
        assert (entry.context_str + entry.token_str) in row_text


def test_bias_changed_share_by_hand(family_models, tokens):
    """Solar: the share of tokens whose choice with the correction bias differs from the group top-k without it."""
    model = family_models["solar_open"]
    usage = expert_usage(model, tokens)
    cache, _ = routing(model, tokens)
    cfg = model.cfg
    for i, layer in enumerate(usage.layers):
        scores = cache["router_logits", layer].float().sigmoid()
        grouped = scores.unflatten(-1, (cfg.n_group, -1))
        best_groups = grouped.topk(2, -1).values.sum(-1).topk(cfg.topk_group, -1).indices
        keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool).scatter_(-1, best_groups, True)
        unbiased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2).topk(cfg.top_k_per_layer[layer], -1).indices
        chosen = cache["expert_indices", layer]
        differs = [set(u) != set(c) for u, c in zip(unbiased.flatten(0, 1).tolist(), chosen.flatten(0, 1).tolist())]
        assert float(usage.bias_changed[i]) == pytest.approx(sum(differs) / len(differs))
    assert 0 < float(usage.bias_changed.max())  # the tiny Solar's bias is large enough to re-route


# ---- co-activation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_coactivation_by_hand(family_models, family, tokens):
    model = family_models[family]
    tokens, mask = left_padded(tokens)
    layers = moe_layers(model)
    pairs = [(layers[0], layers[-1]), (layers[1], layers[1]), (layers[-1], layers[0])]
    got = coactivations(model, tokens, pairs, attention_mask=mask)
    cache, valid = routing(model, tokens, mask)
    E = routable_experts(model)
    for a, b in pairs:
        by_hand = torch.zeros(E, E, dtype=torch.long)
        for r, p in valid.nonzero().tolist():
            for e in cache["expert_indices", a][r, p].tolist():
                for f in cache["expert_indices", b][r, p].tolist():
                    by_hand[e, f] += 1
        assert torch.equal(got[a, b], by_hand), (a, b)
    within = coactivation(model, tokens, layers[1], attention_mask=mask)
    usage = expert_usage(model, tokens, attention_mask=mask)
    assert torch.equal(within.diagonal(), usage.counts[1]) and torch.equal(within, within.T)
    assert torch.equal(got[layers[0], layers[-1]], got[layers[-1], layers[0]].T)


# ---- top tokens --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["weight", "score"])
@pytest.mark.parametrize("family", FAMILIES)
def test_top_tokens_have_the_highest_values(family_models, family, tokens, by):
    model = family_models[family]
    layer = moe_layers(model)[-1]
    second = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(11))
    padded, mask = left_padded(tokens)
    batches = [(padded, mask), second]
    values = []
    for b, (toks, m) in enumerate([(padded, mask), (second, None)]):
        cache, valid = routing(model, toks, m)
        idx, w = cache["expert_indices", layer], cache["expert_weights", layer].float()
        expert = 2
        for r, p in valid.nonzero().tolist():
            if by == "score":
                values.append((float(cache["router_scores", layer][r, p, expert]), b, r, p, toks))
            elif expert in idx[r, p].tolist():
                values.append((float(w[r, p][idx[r, p] == expert].sum()), b, r, p, toks))
    top = top_tokens(model, batches, layer, 2, k=5, by=by, context=3)
    assert len(top) == min(5, len(values)) > 0
    got = [t.value for t in top]
    assert got == sorted(got, reverse=True)
    chosen = {(t.batch, t.row, t.pos) for t in top}
    rest = [v for v, b, r, p, _ in values if (b, r, p) not in chosen]
    assert min(got) >= max(rest, default=float("-inf"))
    found = {(b, r, p): (v, toks) for v, b, r, p, toks in values}
    for t in top:
        value, toks = found[t.batch, t.row, t.pos]
        assert t.value == pytest.approx(value, abs=1e-6)
        start = 6 if (t.batch, t.row) == (0, 0) else 2 if (t.batch, t.row) == (0, 1) else 0  # padding is no context
        assert t.token == int(toks[t.row, t.pos]) and t.context == toks[t.row, max(start, t.pos - 3) : t.pos].tolist()
        assert t.token_str == str(t.token)  # no tokenizer: ids
    assert f"expert 2 of layer {layer}" in str(top)


# ---- interventions -------------------------------------------------------------------------------------------
def run_with(model, tokens, hooks, mask=None):
    with model.hooks(fwd_hooks=hooks):
        return model.run_with_cache(tokens, attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_ablation_changes_only_tokens_routed_to_the_expert(family_models, family, tokens):
    model = family_models[family]
    layer, expert = moe_layers(model)[1], 3
    clean_logits, clean = model.run_with_cache(tokens)
    _, ablated = run_with(model, tokens, ablate_experts_hooks(model, {layer: expert}))
    hit = (clean["expert_indices", layer] == expert).any(-1)
    assert hit.any() and (~hit).any()
    mlp_clean, mlp_ablated = clean["mlp_out", layer], ablated["mlp_out", layer]
    assert torch.equal(mlp_clean[~hit], mlp_ablated[~hit])
    assert (mlp_clean[hit] != mlp_ablated[hit]).any(-1).all()
    w_clean, w_ablated = clean["expert_weights", layer], ablated["expert_weights", layer]
    slot = clean["expert_indices", layer] == expert
    assert torch.equal(ablated["expert_indices", layer], clean["expert_indices", layer])
    assert (w_ablated[slot] == 0).all() and torch.equal(w_ablated[~slot], w_clean[~slot])
    for earlier in moe_layers(model)[:1]:
        assert torch.equal(clean["mlp_out", earlier], ablated["mlp_out", earlier])

    result = ablate_experts(model, tokens, {layer: expert})
    assert torch.equal(result.baseline_logits, clean_logits)
    with model.hooks(fwd_hooks=ablate_experts_hooks(model, {layer: expert})):
        assert torch.equal(result.logits, model(tokens))
    assert result.loss_change == pytest.approx(result.loss - result.baseline_loss)
    assert result.loss == pytest.approx(float(model.loss(result.logits, tokens)))
    changed = result.logits.argmax(-1) != clean_logits.argmax(-1)
    assert torch.equal(result.changed, changed) and len(result.changed_tokens()) == int(changed.sum())
    assert "loss" in str(result)


@pytest.mark.parametrize("family", FAMILIES)
def test_mean_ablation_uses_the_reference_mean(family_models, family, tokens):
    model = family_models[family]
    layer = moe_layers(model)[0]
    reference = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(7))
    _, ref = model.run_with_cache(reference)
    _, clean = model.run_with_cache(tokens)
    # two experts the reference data reaches (a mean needs tokens), the most and the least used of those; the
    # input reaches them too, as the last run below takes the input as its own reference
    counts = torch.bincount(ref["expert_indices", layer].flatten(), minlength=routable_experts(model))
    reached = torch.isin(torch.arange(routable_experts(model)), clean["expert_indices", layer])
    used = [int(e) for e in counts.argsort(descending=True) if counts[e] > 0 and reached[e]]
    assert len(used) >= 2
    experts = [used[0], used[-1]]
    means = {}
    for e in experts:
        chosen = ref["expert_indices", layer] == e
        means[e] = ref["expert_outputs", layer][chosen].double().mean(0).float()
    hooks = ablate_experts_hooks(model, {layer: experts}, mode="mean", reference=reference)
    _, ablated = run_with(model, tokens, hooks)
    idx = clean["expert_indices", layer]
    out_clean, out_ablated = clean["expert_outputs", layer], ablated["expert_outputs", layer]
    hit = torch.isin(idx, torch.tensor(experts))
    assert hit.any()
    assert torch.equal(out_ablated[~hit], out_clean[~hit])
    for e in experts:
        torch.testing.assert_close(out_ablated[idx == e], means[e].expand_as(out_ablated[idx == e]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ablated["routed_out", layer], out_ablated.sum(2) * routed_scale(model, layer), rtol=0,
                               atol=1e-6)
    result = ablate_experts(model, tokens, {layer: experts}, mode="mean")  # reference defaults to the input
    assert result.loss is not None and result.logits.shape == result.baseline_logits.shape


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_force_route_sets_the_indices(family_models, family, tokens, with_weights):
    model = family_models[family]
    layer = moe_layers(model)[1]
    k = model.cfg.top_k_per_layer[layer]
    forced = list(range(routable_experts(model) - k, routable_experts(model)))
    weights = [0.5 / (i + 1) for i in range(k)] if with_weights else None
    positions = [0, 3, 7, -1]
    _, clean = model.run_with_cache(tokens)
    _, run = run_with(model, tokens, force_route_hooks(model, layer, forced, weights, positions))
    at = torch.zeros(tokens.shape, dtype=torch.bool)
    at[:, [0, 3, 7, tokens.shape[1] - 1]] = True
    idx = run["expert_indices", layer]
    assert (idx[at] == torch.tensor(forced)).all()
    assert torch.equal(idx[~at], clean["expert_indices", layer][~at])
    w = run["expert_weights", layer]
    if with_weights:
        assert torch.equal(w[at], torch.tensor(weights, dtype=w.dtype).expand_as(w[at]))
    else:  # the family's rule on the new experts' scores
        expected = model.blocks[layer].mlp.router.weights(run["router_scores", layer], idx, w.dtype)
        assert torch.equal(w, expected)
    assert torch.equal(w[~at], clean["expert_weights", layer][~at])
    result = force_route(model, tokens, layer, forced, weights, positions)
    assert result.changed.shape == tokens.shape and (result.logit_diff != 0).any()
    with pytest.raises(ValueError, match=f"top_k={k}"):
        force_route_hooks(model, layer, forced + [0])


@pytest.mark.parametrize("family", FAMILIES)
def test_steer_router_adds_exactly_the_value(family_models, family, tokens):
    model = family_models[family]
    layer, expert, value = moe_layers(model)[-1], 5, 0.75
    _, clean = model.run_with_cache(tokens)
    _, run = run_with(model, tokens, steer_router_hooks(model, layer, expert, value, positions=[2, 4]))
    logits, before = run["router_logits", layer], clean["router_logits", layer]
    expected = before.clone()
    expected[:, [2, 4], expert] = before[:, [2, 4], expert] + value
    assert torch.equal(logits, expected)
    # A large push makes every steered token choose the expert, and only the steered ones change.
    _, pushed = run_with(model, tokens, steer_router_hooks(model, layer, expert, 1e4))
    # (not where one group of experts is chosen first, and a group scores as its best two saturated sigmoids: the
    # tiny Nemotron-H's group of expert 5 can lose; the logits above are what steering means there)
    if getattr(model.cfg, "topk_group", None) != 1:
        assert (pushed["expert_indices", layer] == expert).any(-1).all()
    result = steer_router(model, tokens, layer, expert, 1e4)
    with model.hooks(fwd_hooks=steer_router_hooks(model, layer, expert, 1e4)):
        assert torch.equal(result.logits, model(tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_routing_copies_the_clean_decisions(family_models, family, tokens):
    model = family_models[family]
    clean_tokens, corrupted = tokens[:1], tokens[1:]
    layers = moe_layers(model)[1:]
    clean_logits, clean = model.run_with_cache(clean_tokens)
    corrupted_logits, base = model.run_with_cache(corrupted)
    _, patched = run_with(model, corrupted, patch_routing_hooks(model, clean, layers))
    for layer in layers:
        for name in ("expert_indices", "expert_weights"):
            assert torch.equal(patched[name, layer], clean[name, layer])
    first = moe_layers(model)[0]
    assert torch.equal(patched["expert_indices", first], base["expert_indices", first])
    # Only some positions, only the indices: the weights then follow the corrupted run's scores.
    _, part = run_with(model, corrupted, patch_routing_hooks(model, clean, layers[0], positions=[1, 5], what="indices"))
    idx = part["expert_indices", layers[0]]
    assert torch.equal(idx[:, [1, 5]], clean["expert_indices", layers[0]][:, [1, 5]])
    keep = [p for p in range(tokens.shape[1]) if p not in (1, 5)]
    assert torch.equal(idx[:, keep], base["expert_indices", layers[0]][:, keep])
    w = part["expert_weights", layers[0]]
    assert torch.equal(w, model.blocks[layers[0]].mlp.router.weights(part["router_scores", layers[0]], idx, w.dtype))

    result = patch_routing(model, clean_tokens, corrupted, layers)
    assert torch.equal(result.source_logits, clean_logits) and torch.equal(result.baseline_logits, corrupted_logits)
    with model.hooks(fwd_hooks=patch_routing_hooks(model, clean, layers)):
        assert torch.equal(result.logits, model(corrupted))
    with pytest.raises(ValueError, match="same length"):
        patch_routing(model, clean_tokens, corrupted[:, :-1])


def test_dense_layers_and_bad_experts_are_refused(checkpoints, qwen_model, tokens):
    dense = HookedTransformer.from_pretrained(checkpoints["qwen2_moe", "dense_block"], progress=False)
    with pytest.raises(ValueError, match="dense block"):
        expert_usage(dense, tokens, layers=1)
    assert expert_usage(dense, tokens).layers == [0, 2]
    with pytest.raises(IndexError, match="out of range"):
        ablate_experts(qwen_model, tokens, {0: 8})
    with pytest.raises(ValueError, match="reference"):
        ablate_experts_hooks(qwen_model, {0: 1}, mode="mean")
    with pytest.raises(ValueError, match="single token batch"):
        expert_usage(qwen_model, [tokens], attention_mask=torch.ones_like(tokens))


# ---- plots -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_plots_write_pngs(family_models, family, tokens, tmp_path):
    pytest.importorskip("matplotlib")
    from moelens.analysis import plot_expert_usage, plot_routing

    model = family_models[family]
    usage_png, routing_png = tmp_path / "usage.png", tmp_path / "routing.png"
    fig = plot_expert_usage(expert_usage(model, tokens), usage_png)
    plot_routing(routing_table(model, tokens[:1]), routing_png, n_experts=routable_experts(model))
    for png in (usage_png, routing_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert fig.axes[0].get_ylabel() == "layer"


def test_inspect_writes_the_routing_plot(qwen_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from moelens.cli import main

    out = tmp_path / "routing.png"
    assert main(["inspect", str(qwen_path), "--prompt", "1 2 3 4", "--plot", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "routing plot written" in capsys.readouterr().out


def test_plots_name_the_extra_without_matplotlib(qwen_model, tokens, monkeypatch):
    from moelens.analysis import plot_routing

    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)  # import now fails
    with pytest.raises(ImportError, match=r"pip install '\.\[plot\]' from moelens's checkout"):
        plot_routing(routing_table(qwen_model, tokens[:1]))
