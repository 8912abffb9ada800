"""Causal expert analyses (expert_loss_effects, misrouting, super_experts) against their naive loops: one full
forward per removed expert or per route, with the hooks written out here."""

import pytest
import torch
from conftest import FAMILIES

from moelens import HookedTransformer
from moelens.analysis import expert_loss_effects, misrouting, super_experts
from moelens.analysis import expert_effects
from moelens.analysis.misrouting import alternative_routes


def site(layer, name):
    return f"blocks.{layer}.mlp.hook_{name}"


def moe_layers(model):
    return [i for i, m in enumerate(model.cfg.moe_layers) if m]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # the naive loops' forwards need no graph
        yield


@pytest.fixture(scope="module")
def code_model():
    return HookedTransformer.from_pretrained("tiny-code-moe")


@pytest.fixture(scope="module")
def code_tokens(code_model):
    texts = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())  # where we are\n"]
    return code_model.to_tokens(texts)[:, :12]


def naive_effects(model, tokens, mode, mask=None, layers=None):
    """[layer expert] mean loss change and [layer expert pred] per-token change: one full forward per expert."""
    base, cache = model.run_with_cache(tokens, return_type="loss", loss_per_token=True, attention_mask=mask)
    keep = torch.ones_like(base, dtype=torch.bool) if mask is None else (mask[:, 1:] * mask[:, :-1]).bool()
    layers, E = layers or moe_layers(model), model.cfg.n_routable_experts
    mean, per = torch.zeros(len(layers), E), torch.zeros(len(layers), E, int(keep.sum()))
    for li, layer in enumerate(layers):
        clean = cache[site(layer, "expert_indices")]
        for e in range(E):
            if mode == "zero":
                seen = {}

                def remember(indices, hook):
                    seen["i"] = indices

                def zero(w, hook, e=e):
                    return w.masked_fill(seen["i"] == e, 0)

                hooks = [(site(layer, "expert_indices"), remember), (site(layer, "expert_weights"), zero)]
            else:

                def minus_inf(logits, hook, e=e, clean=clean):
                    logits = logits.clone()
                    column = logits[..., e]
                    column[(clean == e).any(-1)] = float("-inf")
                    logits[..., e] = column
                    return logits

                hooks = [(site(layer, "router_logits"), minus_inf)]
            loss = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss", loss_per_token=True, attention_mask=mask)
            delta = (loss - base)[keep]
            mean[li, e], per[li, e] = delta.mean(), delta
    return mean, per


@pytest.mark.parametrize("mode", ["zero", "reroute"])
def test_expert_loss_effects_match_one_forward_per_expert(code_model, code_tokens, mode):
    mean, per = expert_loss_effects(code_model, code_tokens, mode=mode, per_token=True, progress=False)
    want_mean, want_per = naive_effects(code_model, code_tokens, mode)
    assert mean.shape == (3, 8) and per.shape == (3, 8, 2 * 11)
    assert (mean - want_mean).abs().max() < 1e-5
    assert (per - want_per).abs().max() < 1e-5
    assert mean.abs().max() > 1e-3  # removing an expert moves the loss: the comparison is not of zeros


def test_expert_loss_effects_left_padding_and_one_expert_per_pass(code_model, code_tokens):
    mask = torch.ones_like(code_tokens)
    mask[0, :4] = 0
    tokens = code_tokens.masked_fill(mask == 0, 1)
    got = expert_loss_effects(code_model, (tokens, mask), mode="reroute", experts_per_pass=1, progress=False)
    want, _ = naive_effects(code_model, tokens, "reroute", mask)
    assert (got - want).abs().max() < 1e-5


def test_expert_loss_effects_over_a_dataset_weights_batches_by_predictions(code_model, code_tokens):
    a, b = code_tokens[:1], code_tokens[1:, :7]
    both = expert_loss_effects(code_model, [a, b], layers=[2], progress=False)
    n_a, n_b = 11, 6
    want = (expert_loss_effects(code_model, a, layers=2, progress=False) * n_a
            + expert_loss_effects(code_model, b, layers=2, progress=False) * n_b) / (n_a + n_b)
    assert both.shape == (1, 8) and (both - want).abs().max() < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_loss_effects_every_family(family_models, family, tokens):
    model = family_models[family]
    tokens = tokens[:, :8]
    layers = sorted({moe_layers(model)[0], moe_layers(model)[-1]})  # the first and last: runs from early and late
    for mode in ("zero", "reroute"):
        try:
            got = expert_loss_effects(model, tokens, layers=layers, mode=mode, progress=False)
        except ValueError as err:  # only a rule with a choice bias may still choose an expert whose logit is -inf
            biased = any(model.blocks[layer].mlp.router.choice_bias for layer in moe_layers(model))
            assert mode == "reroute" and biased and "still chooses expert" in str(err), (family, err)
            continue
        want, _ = naive_effects(model, tokens, mode, layers=layers)
        assert (got - want).abs().max() < 1e-5, (family, mode)


def test_reroute_is_the_next_ranked_unchosen_expert(code_model, code_tokens):
    """With expert e's logit at -inf a softmax top-k takes the next-ranked expert, and (no renormalisation in
    tiny-code-moe) the other slot's weight becomes p / (1 - p_e): the definition the docs give."""
    layer, e = 2, 4
    _, cache = code_model.run_with_cache(code_tokens)
    logits = cache[site(layer, "router_logits")]
    clean = cache[site(layer, "expert_indices")]
    hit = (clean == e).any(-1)
    assert int(hit.sum()) > 0

    def minus_inf(x, hook):
        x = x.clone()
        column = x[..., e]
        column[hit] = float("-inf")
        x[..., e] = column
        return x

    seen = {}
    code_model.run_with_hooks(code_tokens, fwd_hooks=[
        (site(layer, "router_logits"), minus_inf),
        (site(layer, "expert_indices"), lambda x, hook: seen.__setitem__("i", x.clone())),
        (site(layer, "expert_weights"), lambda x, hook: seen.__setitem__("w", x.clone())),
    ])
    probs = logits.softmax(-1)
    for b, p in hit.nonzero().tolist():
        ranked = probs[b, p].argsort(descending=True).tolist()
        k = clean.shape[-1]
        want = [x for x in ranked[: k + 1] if x != e]
        assert sorted(seen["i"][b, p].tolist()) == sorted(want)
        for slot, x in enumerate(seen["i"][b, p].tolist()):
            assert abs(float(seen["w"][b, p, slot]) - float(probs[b, p, x] / (1 - probs[b, p, e]))) < 1e-6


def test_reroute_refused_where_minus_inf_keeps_the_expert(family_models, tokens):
    model = family_models["deepseek_v3"]  # sigmoid scores + a choice bias: a large bias outweighs a score of 0
    layer = moe_layers(model)[0]
    bias = model.blocks[layer].mlp.router.e_score_correction_bias
    saved = bias.clone()
    try:
        bias[0] = 100.0
        with pytest.raises(ValueError, match="still chooses expert 0"):
            expert_loss_effects(model, tokens[:, :6], layers=layer, mode="reroute", progress=False)
    finally:
        bias.copy_(saved)


def test_expert_loss_effects_bad_arguments(code_model, code_tokens):
    with pytest.raises(ValueError, match="mode must be"):
        expert_loss_effects(code_model, code_tokens, mode="mean")
    with pytest.raises(ValueError, match="dense block"):
        expert_loss_effects(code_model, code_tokens, layers=0)
    with pytest.raises(ValueError, match="experts_per_pass"):
        expert_loss_effects(code_model, code_tokens, experts_per_pass=0)


def test_alternative_routes_by_hand():
    routes = alternative_routes(torch.tensor([[2, 0]]), 4)[0]
    assert routes.tolist() == [[2, 0], [1, 0], [3, 0], [2, 1], [2, 3]]


def test_misrouting_matches_one_forward_per_route(code_model, code_tokens):
    tokens = code_tokens[:, :6]
    layer = 2
    got = misrouting(code_model, tokens, layer, batch_size=16, progress=False)
    k, E = 2, 8
    assert got.probs.shape == (2, 5, 1 + k * (E - k))
    for b in range(2):
        for t in range(5):
            for r in (0, 1, 6, 7, 12):  # the router's route, each slot's first and last swap
                route = got.routes[b, t, r]

                def set_route(indices, hook, route=route, t=t):
                    indices = indices.clone()
                    indices[0, t] = route
                    return indices

                logits = code_model.run_with_hooks(tokens[b:b + 1], fwd_hooks=[(site(layer, "expert_indices"), set_route)])
                p = logits[0, t].softmax(-1)[tokens[b, t + 1]]
                assert abs(float(p) - float(got.probs[b, t, r])) < 1e-5
    _, cache = code_model.run_with_cache(tokens)
    assert torch.equal(got.routes[:, :, 0], cache[site(layer, "expert_indices")][:, :-1])
    gain = got.probs[..., 1:].max(-1).values - got.probs[..., 0]
    assert torch.allclose(got.gain, gain)
    assert got.share == pytest.approx(float((gain > 0).double().mean()))
    best = got.routes.gather(2, (got.probs[..., 1:].argmax(-1) + 1)[..., None, None].expand(2, 5, 1, k))[:, :, 0]
    assert torch.equal(got.best_route, best)


def test_misrouting_leaves_padding_out(code_model, code_tokens):
    tokens = code_tokens[:, :6]
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0
    got = misrouting(code_model, (tokens, mask), 3, progress=False)
    assert got.valid[1].tolist() == [False, False, True, True, True]
    assert got.probs[1, :2].isnan().all() and not got.probs[got.valid].isnan().any()
    # a left-padded row's scores are its unpadded run's
    alone = misrouting(code_model, tokens[1:, 2:], 3, progress=False)
    assert (alone.probs[0] - got.probs[1, 2:]).abs().max() < 1e-5


def test_super_experts_by_hand(code_model, code_tokens):
    got = super_experts(code_model, code_tokens, threshold=1.2, max_found=2)
    layers = moe_layers(code_model)
    names = [site(layer, "expert_indices") for layer in layers] + [f"blocks.{layer}.mlp.experts.hook_out" for layer in layers]
    loss, cache = code_model.run_with_cache(code_tokens, names_filter=names, return_type="loss")
    maxima = torch.zeros(len(layers), 8)
    for li, layer in enumerate(layers):
        idx, out = cache[site(layer, "expert_indices")], cache[f"blocks.{layer}.mlp.experts.hook_out"]
        for b in range(idx.shape[0]):
            for p in range(idx.shape[1]):
                for s in range(idx.shape[2]):
                    e = int(idx[b, p, s])
                    maxima[li, e] = max(maxima[li, e], float(out[b, p, s].abs().max()))
    assert torch.equal(got.max_abs, maxima)
    ratio = maxima / maxima.sort(-1).values[:, 3:5].mean(-1, keepdim=True)  # 8 experts: median of the middle two
    assert torch.allclose(got.ratio, ratio)
    assert [(s.layer, s.expert) for s in got.ranked][:2] == [(s.layer, s.expert) for s in got.found]
    assert got.loss == pytest.approx(float(loss), rel=1e-6)
    removed = {}
    for s in got.found:
        removed.setdefault(s.layer, []).append(s.expert)
    hooks = []
    for layer, experts in removed.items():
        seen = {}
        hooks += [(site(layer, "expert_indices"), lambda x, hook, seen=seen: seen.__setitem__("i", x)),
                  (site(layer, "expert_weights"),
                   lambda w, hook, seen=seen, ex=torch.tensor(experts): w.masked_fill(torch.isin(seen["i"], ex), 0))]
    want = code_model.run_with_hooks(code_tokens, fwd_hooks=hooks, return_type="loss")
    assert got.loss_removed == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3", "phimoe", "gpt_oss"])
def test_misrouting_other_routers_and_shared_selection(family_models, family, tokens):
    """A sigmoid grouped rule, sparsemixer, gpt-oss's top-k logits, and GLM-5's layers that reuse the selection
    of the layer before (the runs then start a layer earlier): the last mixture layer, one full forward per route."""
    model = family_models[family]
    tokens = tokens[:1, :4]
    layer = moe_layers(model)[-1]
    got = misrouting(model, tokens, layer, progress=False)
    for t in range(3):
        for r in range(got.routes.shape[2]):
            route = got.routes[0, t, r]

            def set_route(indices, hook, route=route, t=t):
                indices = indices.clone()
                indices[0, t] = route
                return indices

            logits = model.run_with_hooks(tokens, fwd_hooks=[(site(layer, "expert_indices"), set_route)])
            p = logits[0, t].float().softmax(-1)[tokens[0, t + 1]]
            assert abs(float(p) - float(got.probs[0, t, r])) < 1e-5, (family, t, r)


def test_super_experts_generation_with_and_without_them(code_model, code_tokens):
    """The continuation with the experts found removed is the greedy loop written out here: each step one full
    forward with their routing weights zeroed, the argmax appended (no cache; eos ignored)."""
    prompt = "def read_config(path):\n"
    got = super_experts(code_model, code_tokens[:2], threshold=1.0, max_found=6, prompt=prompt, max_new_tokens=6)
    assert len(got.found) == 6
    removed = {}
    for s in got.found:
        removed.setdefault(s.layer, []).append(s.expert)

    def greedy(hooks):
        ids = code_model.to_tokens(prompt)
        for _ in range(6):
            logits = code_model.run_with_hooks(ids, fwd_hooks=hooks)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return code_model.tokenizer.batch_decode(ids, skip_special_tokens=True)[0]  # as generate decodes

    hooks = []
    for layer, experts in removed.items():
        seen = {}
        hooks += [(site(layer, "expert_indices"), lambda x, hook, seen=seen: seen.__setitem__("i", x)),
                  (site(layer, "expert_weights"),
                   lambda w, hook, seen=seen, ex=torch.tensor(experts): w.masked_fill(torch.isin(seen["i"], ex), 0))]
    assert got.generated == greedy([])
    assert got.generated_removed == greedy(hooks)
    assert f"without them: {got.generated_removed!r}" in str(got)


def test_expert_loss_effects_resumes_after_a_kill_bit_for_bit(code_model, code_tokens, tmp_path, monkeypatch):
    """A run killed after its second batch, started again with the same file, finishes with the uninterrupted
    run's numbers, bit for bit, running only the batches left; other arguments or data are refused, by name."""
    rows = torch.cat([code_tokens, code_tokens.flip(0)])
    tokens = [rows[i:i + 1] for i in range(4)]  # a dataset of four batches
    whole, whole_tokens = expert_loss_effects(code_model, tokens, batch_size=1, per_token=True, progress=False)
    file = tmp_path / "effects.pt"
    real_batches = expert_effects.iter_batches

    def killed_after_two(*args, **kwargs):
        for i, item in enumerate(real_batches(*args, **kwargs)):
            if i == 2:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(expert_effects, "iter_batches", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        expert_loss_effects(code_model, tokens, batch_size=1, per_token=True, progress=False, resume=file)
    monkeypatch.setattr(expert_effects, "iter_batches", real_batches)
    assert torch.load(file, weights_only=True)["batches"] == 2
    forwards = []
    monkeypatch.setattr(code_model, "run_with_cache", lambda *a, _run=code_model.run_with_cache, **k: forwards.append(1) or _run(*a, **k))
    resumed, resumed_tokens = expert_loss_effects(code_model, tokens, batch_size=1, per_token=True, progress=False, resume=file)
    assert len(forwards) == 2  # the two batches left, one caching forward each
    assert torch.equal(resumed, whole) and torch.equal(resumed_tokens, whole_tokens)
    with pytest.raises(ValueError, match=r"effects.pt: written by a run with mode = 'zero', this one has mode = 'reroute'"):
        expert_loss_effects(code_model, tokens, batch_size=1, per_token=True, mode="reroute", resume=file)
    with pytest.raises(ValueError, match=r"effects.pt: the first 4 batches differ from the data"):
        expert_loss_effects(code_model, tokens[1:] + tokens[:1], batch_size=1, per_token=True, resume=file)
    with pytest.raises(ValueError, match=r"effects.pt: the run that wrote it did 4 batches, this data has 2"):
        expert_loss_effects(code_model, tokens[:2], batch_size=1, per_token=True, resume=file)
