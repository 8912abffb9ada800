"""Per-expert logit lens, expert specialization (JSD, REAP saliency), routing paths and routing overlap, in
memory: each against a hand computation, on routing tables small enough to work out (forced through hooks)
and on expert outputs recomputed from the experts' weights."""

import math

import pytest
import torch
from conftest import FAMILIES

from moelens import HookedTransformer
from moelens.analysis import (
    expert_logit_lens,
    expert_specialization,
    jensen_shannon,
    routing_overlap,
    routing_paths,
)


@pytest.fixture(scope="module")
def model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards on shared cores
    yield HookedTransformer.from_pretrained("tiny-code-moe", progress=False)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def other():
    """A second copy of the model: its own hooks force its own routing table."""
    return HookedTransformer.from_pretrained("tiny-code-moe", progress=False)


def h2(p):
    """Shannon entropy in bits, written out."""
    return -sum(x * math.log2(x) for x in p if x > 0)


def jsd_by_hand(p, q):
    p = [x / sum(p) for x in p]
    q = [x / sum(q) for x in q]
    m = [(a + b) / 2 for a, b in zip(p, q)]
    return h2(m) - (h2(p) + h2(q)) / 2


# (experts, weights) per token, layers 1 and 2 of tiny-code-moe (8 experts, top-2)
TABLE_A = {
    1: ([[0, 1], [1, 0], [4, 5]], [[0.6, 0.4], [0.3, 0.7], [0.9, 0.1]]),  # top-1: 0, 0, 4
    2: ([[2, 3], [2, 5], [3, 2]], [[0.7, 0.3], [0.5, 0.5], [0.8, 0.2]]),  # top-1: 2, 2 (a tie: the first slot), 3
}
TABLE_B = {
    1: ([[0, 2], [0, 1], [6, 7]], [[0.5, 0.5], [0.7, 0.3], [0.5, 0.5]]),  # top-1: 0, 0, 6
    2: TABLE_A[2],
}
TOKENS = torch.tensor([[5, 6, 5]])


def forcing(table):
    """Hooks replacing each layer's chosen experts and weights by the table's."""
    hooks = []
    for layer, (experts, weights) in table.items():
        hooks.append((f"blocks.{layer}.mlp.hook_expert_indices", lambda x, hook, e=experts: torch.tensor([e], dtype=x.dtype)))
        hooks.append((f"blocks.{layer}.mlp.hook_expert_weights", lambda x, hook, w=weights: torch.tensor([w], dtype=x.dtype)))
    return hooks


def test_the_forced_table_is_what_the_model_routes(model):
    with model.hooks(fwd_hooks=forcing(TABLE_A)):
        _, cache = model.run_with_cache(TOKENS)
    for layer, (experts, weights) in TABLE_A.items():
        assert cache["expert_indices", layer][0].tolist() == experts
        torch.testing.assert_close(cache["expert_weights", layer][0], torch.tensor(weights), rtol=0, atol=0)


def test_jensen_shannon_of_explicit_distributions():
    got = jensen_shannon(torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.25, 0.75], [3.0, 1.0]]),
                         torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.25, 0.75], [1.0, 1.0]]))
    # disjoint: 1 bit; (1/2, 1/2) against (1, 0): H(3/4, 1/4) - 1/2; equal: 0; counts are normalised first
    want = [1.0, h2([0.75, 0.25]) - 0.5, 0.0, jsd_by_hand([0.75, 0.25], [0.5, 0.5])]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert math.isclose(want[1], 0.3112781244591328, abs_tol=1e-12)
    assert torch.isnan(jensen_shannon(torch.zeros(1, 2), torch.ones(1, 2))).all()  # an expert with no token


def test_routing_paths_and_their_entropy_by_hand(model):
    with model.hooks(fwd_hooks=forcing(TABLE_A)):
        paths = routing_paths(model, TOKENS, layers=[1, 2])
    assert paths.paths == [((0, 2), 2), ((4, 3), 1)] and (paths.n_tokens, paths.n_distinct) == (3, 2)
    assert math.isclose(paths.entropy, -(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3), abs_tol=1e-12)
    assert math.isclose(paths.max_entropy, math.log2(3))  # 3 tokens: below log2(8**2) = 6 bits
    with pytest.raises(ValueError, match="consecutive mixture layers"):
        routing_paths(model, TOKENS, layers=[1, 3])


def test_routing_overlap_by_hand(model, other):
    with model.hooks(fwd_hooks=forcing(TABLE_A)), other.hooks(fwd_hooks=forcing(TABLE_B)):
        overlap = routing_overlap(model, other, TOKENS, layers=[1, 2])
    # layer 1, per token: {0: .6, 1: .4} vs {0: .5, 2: .5}: .5 / 1.5; the same weights: 1; disjoint: 0
    torch.testing.assert_close(overlap.token_jaccard, torch.tensor([(1 / 3 + 1 + 0) / 3, 1.0]), rtol=0, atol=1e-6)
    # loads (slots of 6): A e0 2, e1 2, e4 1, e5 1; B e0 2, e1 1, e2 1, e6 1, e7 1: min 3, max 9
    torch.testing.assert_close(overlap.load_jaccard, torch.tensor([3 / 9, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(overlap.top1_agreement, torch.tensor([2 / 3, 1.0]), rtol=0, atol=0)
    assert overlap.n_tokens == 3


def expert_by_hand(model, layer, x, e):
    """Expert e of the layer on input x, from its weights: down(silu(gate x) * up x) (no biases in this model)."""
    part = next(p for p in model.blocks[layer].mlp.parts() if p.kind == "routed")
    x = x.detach()
    gate_up, down = part.module.tensors().gate_up[e].detach().double(), part.module.tensors().down[e].detach().double()
    d = down.shape[1]
    gate, up = gate_up[:d] @ x.double(), gate_up[d:] @ x.double()
    return down @ (torch.nn.functional.silu(gate) * up)


def test_specialization_jsd_and_reap_saliency_by_hand(model):
    with model.hooks(fwd_hooks=forcing(TABLE_A)):
        spec = expert_specialization(model, TOKENS, layers=[1, 2], classes={5: "a", 6: "b"})
        _, cache = model.run_with_cache(TOKENS)
    assert spec.classes == ["a", "b"]
    # layer 1: tokens a, b, a (each in two slots): the layer's (2/3, 1/3); E0 and E1 get a and b, E4 and E5 a
    assert spec.counts[0, :, 0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0] and spec.counts[0, :, 1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    want = [jsd_by_hand([1, 1], [2, 1])] * 2 + [math.nan] * 2 + [jsd_by_hand([1, 0], [2, 1])] * 2 + [math.nan] * 2
    torch.testing.assert_close(spec.jsd[0], torch.tensor(want), rtol=0, atol=1e-6, equal_nan=True)
    # REAP: mean over the expert's tokens of weight * ||expert output||, the output from the expert's weights
    for i, layer in enumerate([1, 2]):
        x = cache[f"blocks.{layer}.ln2.hook_normalized"][0]
        experts, weights = TABLE_A[layer]
        sums, counts = [0.0] * 8, [0] * 8
        for pos in range(3):
            for e, w in zip(experts[pos], weights[pos]):
                sums[e] += w * float(expert_by_hand(model, layer, x[pos], e).norm())
                counts[e] += 1
        want = torch.tensor([s / c if c else math.nan for s, c in zip(sums, counts)])
        torch.testing.assert_close(spec.saliency[i], want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_specialization_by_token_counts_every_real_token(model):
    tokens = torch.tensor([[7, 7, 9, 3], [0, 0, 9, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    spec = expert_specialization(model, tokens, layers=3, attention_mask=mask, saliency=False)
    assert spec.classes == ["3", "7", "9"] and spec.saliency is None
    assert spec.counts.sum().item() == 6 * 2  # six real tokens, top-2
    assert spec.counts.sum((0, 1)).tolist() == [2, 6, 4]
    with pytest.raises(ValueError, match="no class for token"):
        expert_specialization(model, tokens, classes={7: "seven"}, attention_mask=mask)


def test_expert_logit_lens_by_hand(model):
    prompt = "def add(a, b):\n    return a + b"
    layer, top = 2, 5
    lens = expert_logit_lens(model, prompt, layer, top=top)
    _, cache = model.run_with_cache(prompt)
    x = cache[f"blocks.{layer}.ln2.hook_normalized"][0]
    idx, w = cache["expert_indices", layer][0], cache["expert_weights", layer][0]
    W, eps, W_U = model.ln_final.weight.double(), model.ln_final.eps, model.unembed.weight.double()
    for pos in range(x.shape[0]):
        order = sorted(range(idx.shape[1]), key=lambda k: -float(w[pos, k]))
        outs = [float(w[pos, k]) * expert_by_hand(model, layer, x[pos], int(idx[pos, k])) for k in order]
        routed = sum(outs)
        for slot, (k, out) in enumerate(zip(order, outs)):
            assert int(lens.experts[0, pos, slot]) == int(idx[pos, k])
            logits = W_U @ (W * out / torch.sqrt(out.pow(2).mean() + eps))  # RMSNorm, then the unembedding (no bias)
            want = logits.topk(top)
            assert lens.top_ids[0, pos, slot].tolist() == want.indices.tolist()
            torch.testing.assert_close(lens.top_logits[0, pos, slot].double(), want.values, rtol=0, atol=1e-5)
        mix = W_U @ (W * routed / torch.sqrt(routed.pow(2).mean() + eps))
        assert lens.mixture_top_ids[0, pos].tolist() == mix.topk(top).indices.tolist()
        cos = float(outs[0] @ routed / (outs[0].norm() * routed.norm()))
        assert math.isclose(float(lens.cosine[0, pos]), cos, abs_tol=1e-5)
    # with the shared expert: the cosine against hook_mlp_out, by hand
    lens_mlp = expert_logit_lens(model, prompt, layer, mixture="mlp")
    mlp = cache[f"blocks.{layer}.hook_mlp_out"][0].double()
    first = torch.stack([float(w[p].max()) * expert_by_hand(model, layer, x[p], int(idx[p, w[p].argmax()])) for p in range(x.shape[0])])
    torch.testing.assert_close(lens_mlp.cosine[0].double(), torch.nn.functional.cosine_similarity(first, mlp, dim=-1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="dense block"):
        expert_logit_lens(model, prompt, 0)
    with pytest.raises(ValueError, match="mixture must be"):
        expert_logit_lens(model, prompt, layer, mixture="shared")
    with model.hooks(fwd_hooks=[("ln_final.hook_normalized", lambda x, hook: x * 0)]):
        with pytest.raises(ValueError, match=r"remove the hooks on \['ln_final.hook_normalized'\]"):
            expert_logit_lens(model, prompt, layer)


# ---- every family: the numbers from the hook tensors, written out ------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_lens_and_saliency_on_every_family(family_models, family, tokens):
    model = family_models[family]
    layer = model.cfg.moe_layer_indices[-1]
    lens = expert_logit_lens(model, tokens, layer, top=4)
    spec = expert_specialization(model, tokens, layers=layer)
    _, cache = model.run_with_cache(tokens)
    idx, w = cache["expert_indices", layer], cache["expert_weights", layer]
    outs, routed = cache[f"blocks.{layer}.mlp.hook_expert_outputs"], cache[f"blocks.{layer}.mlp.hook_routed_out"]
    out_before = cache[f"blocks.{layer}.mlp.experts.hook_out"]
    weight_at_input = any(p.kind == "routed" and p.module.spec.weight_at == "input" for p in model.blocks[layer].mlp.parts())
    E = model.cfg.n_routable_experts
    sums, counts = [0.0] * E, [0] * E
    for b in range(tokens.shape[0]):
        for p in range(tokens.shape[1]):
            first = max(range(idx.shape[-1]), key=lambda k: (float(w[b, p, k]), -k))  # the largest weight, first slot on a tie
            assert int(lens.experts[b, p, 0]) == int(idx[b, p, first])
            o, r = outs[b, p, first].double(), routed[b, p].double()
            assert math.isclose(float(lens.cosine[b, p]), float(o @ r / (o.norm() * r.norm())), abs_tol=1e-5)
            for k in range(idx.shape[-1]):
                e = int(idx[b, p, k])
                sums[e] += float(w[b, p, k]) * float(out_before[b, p, k].double().norm())
                counts[e] += 1
    assert spec.counts[0].sum(-1).tolist() == counts
    if weight_at_input:  # Llama 4: no output before the weight, no saliency
        assert torch.isnan(spec.saliency).all()
    else:
        want = torch.tensor([s / c if c else math.nan for s, c in zip(sums, counts)])
        torch.testing.assert_close(spec.saliency[0], want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_plots_write_pngs(model, tmp_path):
    pytest.importorskip("matplotlib")
    from moelens.analysis import plot_expert_lens, plot_routing_paths, plot_specialization

    tokens = torch.tensor([[5, 6, 5, 9, 11]])
    plot_expert_lens(expert_logit_lens(model, tokens, 3), tmp_path / "lens.png", labels=["a", "$b$", "c", "d", "e"])
    plot_specialization(expert_specialization(model, tokens), tmp_path / "spec.png")
    plot_routing_paths(routing_paths(model, tokens), tmp_path / "paths.png")
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("lens.png", "spec.png", "paths.png"))


def test_lens_of_a_padded_batch_is_each_prompt_alone(model):
    prompts = ["import numpy as np", "def add(a, b):\n    return a + b"]
    both = expert_logit_lens(model, prompts, 3, top=3)
    for row, prompt in enumerate(prompts):
        alone = expert_logit_lens(model, prompt, 3, top=3)
        valid = both.valid[row]
        assert int(valid.sum()) == alone.tokens.shape[1]
        assert torch.equal(both.experts[row][valid], alone.experts[0]) and torch.equal(both.top_ids[row][valid], alone.top_ids[0])
        torch.testing.assert_close(both.cosine[row][valid], alone.cosine[0], rtol=0, atol=1e-5)
